// TrainerConfig::from_json and from_json_file: a DeepSpeed JSON config (whole, or its
// zero_optimization section) onto a TrainerConfig, every key checked and named. Here, the
// document: which keys it holds, the order they are read in, and the one error that names every
// problem; its sections are read in deepspeed_sections.cpp, its values by a ConfigReader
// (deepspeed_reader.hpp).
#include <nlohmann/json.hpp>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "coshard/async/files.hpp"
#include "coshard/async/json_limits.hpp"
#include "coshard/trainer/config.hpp"
#include "coshard/trainer/settings.hpp"
#include "deepspeed_reader.hpp"
#include "deepspeed_sections.hpp"

namespace coshard::trainer {

using json = nlohmann::json;

namespace {

using detail::ConfigReader;

// Lists of globs: the parameters that do not train (--freeze), the linear layers LoRA adapts
// (--lora-targets).
void read_globs(ConfigReader& r, const json& v, const std::string& key, std::vector<std::string>& out) {
  if (!v.is_array() || v.size() > 4096) {
    r.bad.push_back(key + "=" + async::bounded_echo(v.dump(), 64) + " (expected a list of at most 4096 globs)");
    return;
  }
  std::vector<std::string> patterns;
  for (const auto& pattern : v)
    if (auto text = r.string(pattern, key + "[]")) patterns.push_back(*text);
  out = std::move(patterns);
}

// The keys of a whole config but zero_optimization and fp16/bf16 (read apart): a setting of the
// table (under its DeepSpeed key or coshard's own name), a DeepSpeed section, or a list of globs.
void read_top_level(ConfigReader& r, const json& doc, TrainerConfig& c, std::size_t element) {
  for (const auto& [key, v] : doc.items()) {
    if (key == "zero_optimization" || key == "fp16" || key == "bf16") continue;
    // adaptive_prefetch after every other key: a prefetch_bucket_bytes given beside it is its cap
    // (alone, a fixed depth), whichever the file names first.
    if (key == "adaptive_prefetch") continue;
    if (key == "freeze" || key == "lora_targets") {
      read_globs(r, v, key, key == "freeze" ? c.freeze : c.lora_targets);
      continue;
    }
    // DeepSpeed's sections are objects; coshard's settings of the same name ("optimizer":
    // "sgd", "activation_checkpointing": "full") are not.
    const Setting* own = v.is_object() ? nullptr : setting_named(key);
    if (const Setting* setting = own ? own : setting_for_deepspeed(key)) {
      r.setting(*setting, v, key, c, element, !own && setting->deepspeed_elements);
    } else if (key == "optimizer") {
      detail::read_optimizer(r, v, c, element);
    } else if (key == "scheduler") {
      detail::read_scheduler(r, v, c);
    } else if (key == "tensorboard") {
      detail::read_tensorboard(r, v, c);
    } else if (key == "activation_checkpointing") {
      detail::read_activation_checkpointing(r, v, c);
    } else if (key == "tensor_parallel") {
      detail::read_tensor_parallel(r, v, c, element);
    } else if (key == "steps_per_print" || key == "wall_clock_breakdown" || key == "prescale_gradients" ||
               key == "gradient_predivide_factor") {
      r.notes.push_back(key + ": accepted, no effect in coshard");
    } else if (const Setting* setting = setting_named(key)) {
      r.setting(*setting, v, key, c, element, false);  // coshard's own name for a setting
    } else {
      r.unknown.push_back(key);
    }
  }
}

// The config's one error: its unknown keys, then its bad values.
std::string problems_message(const ConfigReader& r) {
  std::string msg = "config:";
  // Bounded whatever the file holds: each key cut to 128 characters, 20 entries of a kind
  // named, the rest counted (values are cut where they are echoed).
  constexpr std::size_t kListed = 20;
  auto list = [&](const std::vector<std::string>& items, const char* separator) {
    for (std::size_t i = 0; i < std::min(items.size(), kListed); ++i)
      msg += (i ? separator : "") + async::bounded_echo(items[i], 512);
    if (items.size() > kListed) msg += separator + ("and " + std::to_string(items.size() - kListed) + " more");
  };
  if (!r.unknown.empty()) {
    msg += " unknown or unsupported keys [";
    list(r.unknown, ", ");
    msg += "]";
  }
  if (!r.bad.empty()) {
    msg += r.unknown.empty() ? " bad values [" : "; bad values [";
    list(r.bad, "; ");
    msg += "]";
  }
  return msg;
}

}  // namespace

Result<TrainerConfig> TrainerConfig::from_json(std::string_view text, const TrainerConfig& base,
                                               std::vector<std::string>* notes) {
  if (auto nested = async::check_json_nesting(text, "config"); !nested) return fail(std::move(nested).error());
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (doc.is_discarded()) return fail(ErrorCode::invalid_argument, "config: not valid JSON");
  if (!doc.is_object()) return fail(ErrorCode::invalid_argument, "config: expected a JSON object, got ", doc.type_name());

  TrainerConfig c = base;
  ConfigReader r;
  // A bare zero_optimization section, or a whole DeepSpeed config.
  const bool whole = !doc.contains("stage") && !doc.contains("stage3_prefetch_bucket_size");
  json zero = whole ? (doc.contains("zero_optimization") ? doc["zero_optimization"] : json::object()) : doc;

  // The compute dtype first: it converts DeepSpeed's element counts into bytes.
  if (whole) detail::read_precision(r, doc, c);
  const std::size_t element = collectives::size_of(c.dtype);
  // (the table's DeepSpeed sizes are counts of these; ConfigReader::setting turns them into bytes)
  if (whole) read_top_level(r, doc, c, element);
  detail::read_zero_optimization(r, zero, whole, c, element);
  if (whole && doc.contains("adaptive_prefetch"))
    r.setting(*setting_named("adaptive_prefetch"), doc["adaptive_prefetch"], "adaptive_prefetch", c, element, false);

  if (!r.unknown.empty() || !r.bad.empty()) return fail(ErrorCode::invalid_argument, problems_message(r));
  if (auto ok = c.validate(); !ok) return fail(std::move(ok).error().with_context("config"));
  if (notes) *notes = std::move(r.notes);
  return c;
}

Result<TrainerConfig> TrainerConfig::from_json_file(const std::filesystem::path& path, const TrainerConfig& base,
                                                    std::vector<std::string>* notes) {
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, 64u << 20, "config"));
  auto c = from_json(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), base, notes);
  if (!c) return fail(std::move(c).error().with_context("config file " + path.string()));
  return c;
}

}  // namespace coshard::trainer
