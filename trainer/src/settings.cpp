// What the table of settings (settings_table.cpp) is used for: setting one from text, every one as
// JSON (--print-config), and finding one by its name, flag or DeepSpeed key.
#include "coshard/trainer/settings.hpp"

#include <filesystem>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "coshard/async/json_limits.hpp"
#include "coshard/trainer/config.hpp"

namespace coshard::trainer {

Result<void> Setting::set(TrainerConfig& c, std::string_view text, std::string_view label) const {
  const std::string_view named = label.empty() ? name : label;
  TrainerConfig next = c;  // nothing changes unless it all holds
  if (auto ok = parse(*this, next, text); !ok)
    return fail(ErrorCode::invalid_argument, named, "=", async::bounded_echo(text), ": ", ok.error().message());
  COSHARD_TRY(check(*this, next, named));
  c = std::move(next);
  return {};
}

std::string settings_json(const TrainerConfig& c) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  for (const auto& s : settings()) {
    const std::string text = s.value(c);
    if (text.empty()) continue;  // an optional left unset
    auto number = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    const bool numeric = number.is_number() && (s.kind == SettingKind::integer || s.kind == SettingKind::bytes ||
                                                s.kind == SettingKind::real);
    if (numeric) out[std::string(s.name)] = std::move(number);
    else if (s.kind == SettingKind::boolean) out[std::string(s.name)] = text == "true";
    else out[std::string(s.name)] = text;  // a choice, "auto", or a number JSON cannot hold (inf)
  }
  // What the table does not hold, under the names the config reader takes.
  if (!c.freeze.empty()) out["freeze"] = c.freeze;
  if (!c.lora_targets.empty()) out["lora_targets"] = c.lora_targets;
  if (!c.tensorboard_dir.empty()) {
    std::filesystem::path dir = c.tensorboard_dir.lexically_normal();
    if (dir.filename().empty()) dir = dir.parent_path();  // (a trailing '/')
    const std::filesystem::path parent = dir.parent_path();
    out["tensorboard"] = {{"enabled", true},
                          {"output_path", parent.empty() ? std::string(".") : parent.string()},
                          {"job_name", dir.filename().string()}};
  }
  return out.dump(2, ' ', false, nlohmann::json::error_handler_t::replace);
}

const Setting* setting_named(std::string_view name) noexcept {
  for (const auto& s : settings())
    if (s.name == name) return &s;
  return nullptr;
}

const Setting* setting_for_deepspeed(std::string_view key) noexcept {
  for (const auto& s : settings())
    if (!s.deepspeed.empty() && s.deepspeed == key) return &s;
  return nullptr;
}

const Setting* find_setting(std::string_view key) noexcept {
  for (const auto& s : settings())
    if (s.name == key || (!s.flag.empty() && s.flag == key) || (!s.deepspeed.empty() && s.deepspeed == key)) return &s;
  return nullptr;
}

}  // namespace coshard::trainer
