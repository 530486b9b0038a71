// The trainer's settings, each declared once (settings_table.cpp): its name (the TrainerConfig
// field, and the config file's own key), kind, range, help, coshard-train flag, DeepSpeed key,
// and where it lands (a field of TrainerConfig, most of them EngineOptions' own); its default is
// the field's. Made from the table: coshard-train's options (their help and defaults included),
// the JSON config's keys (TrainerConfig::from_json: the DeepSpeed key, and the name itself),
// TrainerBuilder::set, and the range checks of TrainerConfig::validate. A new setting is its
// entry in the table plus its use.
//
// Compound settings stay outside the table: lists (freeze, parameter_groups), DeepSpeed sections
// that set several fields at once (fp16/bf16, scheduler, offload_*, tensorboard, betas), and
// what a run's identity and rank agreement carry.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "coshard/async/result.hpp"

namespace coshard::trainer {

struct TrainerConfig;

enum class SettingKind : std::uint8_t {
  integer,  // a whole number
  bytes,    // a size: 4096, 64MiB, 1.5GB (parse_size)
  real,     // a number
  boolean,  // true or false
  choice,   // one of `choices` (or a form of its own, named in `expected`)
};

struct Setting {
  std::string_view name = {};       // "eval_every": the field, the config file's own key, TrainerBuilder::set's name
  std::string_view flag = {};       // "--eval-every"; empty: not on the command line
  std::string_view deepspeed = {};  // "zero_optimization.stage": the DeepSpeed key, dotted; empty: none
  std::string_view help = {};
  std::string_view expected = {};   // the allowed values, as errors name them ("0, 1, 2 or 3", ">= 1")
  SettingKind kind = SettingKind::integer;
  // boolean settings on the command line: a switch (no value) that sets this (--skip-memory-check
  // sets check_memory to false)
  bool switch_sets = true;
  // DeepSpeed counts this size in elements of the compute dtype (stage3_prefetch_bucket_size)
  bool deepspeed_elements = false;
  // Ranks may run with different values (a machine's own budget, a folder of its own); every
  // other setting is compared across ranks when the trainer is built (a difference is named).
  bool per_rank = false;
  std::span<const std::string_view> choices = {};  // choice: the values (empty: a form of its own)
  // integer, bytes, real: the range (an open end excludes its bound)
  long double min = 0, max = 0;
  bool min_open = false, max_open = false;

  // Where it lands and how it reads, made by the table's helpers: get formats the value; parse
  // reads text in the setting's form into the config (its error says what was expected, without
  // the range: validate checks that); check tests the range of the value held.
  std::string (*get)(const Setting&, const TrainerConfig&) = nullptr;
  Result<void> (*parse)(const Setting&, TrainerConfig&, std::string_view text) = nullptr;
  Result<void> (*check)(const Setting&, const TrainerConfig&, std::string_view label) = nullptr;

  // The value as text (--help's default, the messages).
  std::string value(const TrainerConfig& c) const { return get(*this, c); }
  // Sets it from text in its own form (a number, a size with a unit, true/false, a choice), then
  // checks its range; an error names `label` (the flag or key as the user wrote it; default: the
  // name), the text, and what is expected.
  Result<void> set(TrainerConfig& c, std::string_view text, std::string_view label = {}) const;
  // Whether the value held is in range: "label=value: expected ...".
  Result<void> validate(const TrainerConfig& c, std::string_view label = {}) const {
    return check(*this, c, label.empty() ? name : label);
  }
};

// Every setting of `c` as one JSON object under coshard's own names (numbers, sizes in bytes,
// true/false, choices as strings; an unset optional left out), in the table's order: what
// coshard-train --print-config shows, and what TrainerConfig::from_json reads back.
std::string settings_json(const TrainerConfig& c);

// The table, in --help's order.
std::span<const Setting> settings() noexcept;
// By name ("max_live_bytes"), flag ("--max-live") or DeepSpeed key ("zero_optimization.stage");
// null when none.
const Setting* find_setting(std::string_view key) noexcept;
// By its name only, or by its DeepSpeed key only (dotted); null when none.
const Setting* setting_named(std::string_view name) noexcept;
const Setting* setting_for_deepspeed(std::string_view key) noexcept;

}  // namespace coshard::trainer
