// How a DeepSpeed config's values are read (deepspeed_config.cpp, deepspeed_sections.cpp): each
// checked for its form, a bad one named by the key as written and its value (cut to a bound), an
// unknown key named, one accepted without effect noted; all of them kept, so that the config's one
// error names every problem in the file.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "coshard/trainer/config.hpp"
#include "coshard/trainer/settings.hpp"

namespace coshard::trainer::detail {

struct ConfigReader {
  std::vector<std::string> unknown, bad, notes;
  // Each setting given so far: the key that gave it and its value as read. Two names for one
  // setting (zero_stage and zero_optimization.stage, lr and optimizer.params.lr) must agree:
  // settling it by the order of the keys would train on a value the file also contradicts.
  std::map<std::string, std::pair<std::string, std::string>> given;

  // Numbers may be written as JSON numbers or (as DeepSpeed allows) strings like "5e7".
  std::optional<double> number(const nlohmann::json& v, const std::string& key);
  // A whole number in [0, 2^62] (every count and size here fits an int64 with room to multiply
  // by an element size), named by the value as written when it is not one.
  std::optional<std::size_t> count(const nlohmann::json& v, const std::string& key);
  std::optional<bool> boolean(const nlohmann::json& v, const std::string& key);
  std::optional<std::string> string(const nlohmann::json& v, const std::string& key);
  bool object(const nlohmann::json& v, const std::string& key);
  // A key of the settings table (settings.hpp), named `key` as written: its value read by the
  // setting's kind (numbers also as strings, as DeepSpeed allows; sizes also with units under
  // coshard's own names), DeepSpeed's element counts turned into bytes of `element` each.
  void setting(const Setting& s, const nlohmann::json& v, const std::string& key, TrainerConfig& c,
               std::size_t element, bool in_elements);
  // The setting `s` given `text` (its own form) by `key` (a DeepSpeed flag that means a value of
  // it: zero_quantized_gradients true, int4), agreeing with any other name for it.
  void give(const Setting& s, const std::string& key, const std::string& text, TrainerConfig& c);
};

}  // namespace coshard::trainer::detail
