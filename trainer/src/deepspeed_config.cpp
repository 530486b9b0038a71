// TrainerConfig::from_json and from_json_file: a DeepSpeed JSON config (whole, or its
// zero_optimization section) onto a TrainerConfig, every key checked and named.
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <fstream>
#include <map>
#include <sstream>

#include "coshard/async/json_limits.hpp"
#include "coshard/async/files.hpp"
#include "coshard/trainer/config.hpp"
#include "coshard/trainer/settings.hpp"

namespace coshard::trainer {

using modules::DataType;
using json = nlohmann::json;

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

}  // namespace

namespace {

struct Reader {
  std::vector<std::string> unknown, bad, notes;
  // Each setting given so far: the key that gave it and its value as read. Two names for one
  // setting (zero_stage and zero_optimization.stage, lr and optimizer.params.lr) must agree:
  // settling it by the order of the keys would train on a value the file also contradicts.
  std::map<std::string, std::pair<std::string, std::string>> given;

  // Numbers may be written as JSON numbers or (as DeepSpeed allows) strings like "5e7".
  std::optional<double> number(const json& v, const std::string& key) {
    if (v.is_number()) return v.get<double>();
    if (v.is_string()) {
      const auto s = v.get<std::string>();
      double d = 0;
      const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), d);
      if (ec == std::errc{} && end == s.data() + s.size()) return d;
      bad.push_back(key + "=\"" + async::bounded_echo(s) + "\" (expected a number" + (s == "auto" ? "; 'auto' is not supported" : "") + ")");
      return std::nullopt;
    }
    bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected a number)");
    return std::nullopt;
  }
  // A whole number in [0, 2^62] (every count and size here fits an int64 with room to multiply
  // by an element size), named by the value as written when it is not one.
  std::optional<std::size_t> count(const json& v, const std::string& key) {
    if (v.is_number_unsigned() || v.is_number_integer()) {  // exactly, where a double would round past 2^53
      const bool fits = v.is_number_unsigned() ? v.get<std::uint64_t>() <= (std::uint64_t{1} << 62) : v.get<std::int64_t>() >= 0;
      if (fits) return static_cast<std::size_t>(v.is_number_unsigned() ? v.get<std::uint64_t>() : static_cast<std::uint64_t>(v.get<std::int64_t>()));
      bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected a whole number from 0 to 2^62)");
      return std::nullopt;
    }
    auto d = number(v, key);
    if (!d) return std::nullopt;
    constexpr double kMax = 4611686018427387904.0;  // 2^62
    if (*d < 0 || *d != std::floor(*d) || *d > kMax) {
      bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected a whole number from 0 to 2^62)");
      return std::nullopt;
    }
    return static_cast<std::size_t>(*d);
  }
  std::optional<bool> boolean(const json& v, const std::string& key) {
    if (v.is_boolean()) return v.get<bool>();
    bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected true or false)");
    return std::nullopt;
  }
  std::optional<std::string> string(const json& v, const std::string& key) {
    if (v.is_string()) return v.get<std::string>();
    bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected a string)");
    return std::nullopt;
  }
  bool object(const json& v, const std::string& key) {
    if (v.is_object()) return true;
    bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected an object)");
    return false;
  }
  // A key of the settings table (settings.hpp), named `key` as written: its value read by the
  // setting's kind (numbers also as strings, as DeepSpeed allows; sizes also with units under
  // coshard's own names), DeepSpeed's element counts turned into bytes of `element` each.
  void setting(const Setting& s, const json& v, const std::string& key, TrainerConfig& c, std::size_t element,
               bool in_elements) {
    std::string text;
    switch (s.kind) {
      case SettingKind::integer: {
        if (v.is_string()) {
          // A word the setting takes for a number ("local" for shard_group_size); a number must
          // be written as one.
          TrainerConfig scratch = c;
          const auto given = v.get<std::string>();
          const bool numeric = !given.empty() && (std::isdigit(static_cast<unsigned char>(given[0])) || given[0] == '-');
          if (!numeric && s.parse(s, scratch, given)) {
            text = given;
            break;
          }
        }
        // A whole number as written, exactly: the setting's own range decides (--seed takes up to
        // 2^64 - 1 on the command line, and --print-config's JSON of it reads back).
        if (v.is_number_unsigned() || v.is_number_integer()) {
          text = v.dump();
          break;
        }
        auto n = count(v, key);
        if (!n) return;
        text = std::to_string(*n);
        break;
      }
      case SettingKind::bytes: {
        if (v.is_string()) {
          // A size with its unit under coshard's own name; under DeepSpeed's, a count, or "auto"
          // where the setting takes it (the prefetch).
          TrainerConfig scratch = c;
          const auto given = v.get<std::string>();
          if (!in_elements || (given == "auto" && s.parse(s, scratch, given))) {
            text = given;
            break;
          }
        }
        auto n = count(v, key);
        if (!n) return;
        if (in_elements && *n > (std::size_t{1} << 62) / element) {
          bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (" + std::to_string(element) +
                        " bytes an element: more than 2^62 bytes)");
          return;
        }
        text = std::to_string(in_elements ? *n * element : *n);
        break;
      }
      case SettingKind::real: {
        auto d = number(v, key);
        if (!d) return;
        char buffer[64];
        const auto end = std::to_chars(buffer, buffer + sizeof buffer, *d).ptr;
        text.assign(buffer, end);
        break;
      }
      case SettingKind::boolean: {
        auto b = boolean(v, key);
        if (!b) return;
        text = *b ? "true" : "false";
        break;
      }
      case SettingKind::choice: {
        auto t = string(v, key);
        if (!t) return;
        text = *t;
        break;
      }
    }
    if (auto [it, first] = given.try_emplace(std::string(s.name), key, text); !first) {
      if (it->second.second != text)
        bad.push_back(it->second.first + "=" + async::bounded_echo(it->second.second, 64) + " and " + key + "=" +
                      async::bounded_echo(text, 64) + " (two names for " + std::string(s.name) +
                      ": expected one value, or one of them)");
      return;
    }
    if (auto ok = s.set(c, text, key); !ok) bad.push_back(ok.error().message());
  }
};

void read_offload(Reader& r, const json& section, const std::string& prefix, OffloadOptions& out) {
  if (!r.object(section, prefix)) return;
  for (const auto& [key, v] : section.items()) {
    const std::string name = prefix + "." + key;
    if (key == "device") {
      if (auto s = r.string(v, name)) {
        const auto d = lower(*s);
        if (d == "none") out.device = OffloadDevice::none;
        else if (d == "cpu") out.device = OffloadDevice::cpu;
        else if (d == "nvme") out.device = OffloadDevice::nvme;
        else r.bad.push_back(name + "=\"" + async::bounded_echo(*s) + "\" (expected none, cpu or nvme)");
      }
    } else if (key == "nvme_path") {
      if (auto s = r.string(v, name)) out.nvme_path = *s;
    } else if (key == "pin_memory") {
      if (auto b = r.boolean(v, name))
        r.notes.push_back(name + "=" + (*b ? "true" : "false") +
                          ": no effect, offloaded memory is always pinned in coshard (its size is host_memory_budget)");
    } else if (key == "buffer_count") {
      if (auto n = r.count(v, name)) {
        if (*n < 1 || *n > 1024) r.bad.push_back(name + "=" + std::to_string(*n) + " (expected 1..1024)");
        else out.buffer_count = static_cast<int>(*n);
      }
    } else if (key == "buffer_size") {
      if (r.count(v, name))
        r.notes.push_back(name + ": no effect, a swap buffer is the size of the largest sub-group (sub_group_size) in coshard");
    } else if (key == "ratio" || key == "fast_init" || key == "pipeline_read" || key == "pipeline_write" ||
               key == "max_in_cpu") {
      r.notes.push_back(name + ": accepted, no effect in coshard");
    } else {
      r.unknown.push_back(name);
    }
  }
}

// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, onto the schedule of lr_at:
//   WarmupLR        warmup_min_lr -> warmup_max_lr (= lr) over warmup_num_steps, then constant
//   WarmupDecayLR   the same, then linear to warmup_min_lr at total_num_steps
//   WarmupCosineLR  warmup_min_ratio x lr -> lr over warmup_num_steps, then cosine to
//                   cos_min_ratio x lr at total_num_steps (lr from the optimizer section)
// warmup_type "log" (DeepSpeed's default) or "linear".
// DeepSpeed's activation_checkpointing section: its presence checkpoints every block (as
// transformers' gradient_checkpointing_enable does under DeepSpeed), unless the base config
// already picks every N-th. What only shapes DeepSpeed's own buffers is accepted as a note;
// cpu_checkpointing (inputs kept in host memory) is refused.
void read_activation_checkpointing(Reader& r, const json& section, TrainerConfig& c) {
  if (!r.object(section, "activation_checkpointing")) return;
  for (const auto& [key, v] : section.items()) {
    const std::string name = "activation_checkpointing." + key;
    if (key == "cpu_checkpointing") {
      if (auto b = r.boolean(v, name); b && *b)
        r.bad.push_back(name + "=true (not supported: checkpointed inputs stay on the compute device)");
    } else if (key == "partition_activations" || key == "contiguous_memory_optimization" ||
               key == "synchronize_checkpoint_boundary" || key == "profile") {
      if (r.boolean(v, name)) r.notes.push_back(name + ": accepted, no effect in coshard");
    } else if (key == "number_checkpoints") {
      if (r.count(v, name))
        r.notes.push_back(name + ": accepted, no effect in coshard (every block is checkpointed; "
                                 "--activation-checkpointing N picks every N-th)");
    } else {
      r.unknown.push_back(name);
    }
  }
  if (!c.activation_checkpointing.enabled()) c.activation_checkpointing.every = 1;
}

// DeepSpeed's monitor section {"enabled": true, "output_path": "runs", "job_name": "gpt"}: event
// files in output_path/job_name (job_name defaults to DeepSpeed's "DeepSpeedJobName").
void read_tensorboard(Reader& r, const json& section, TrainerConfig& c) {
  if (!r.object(section, "tensorboard")) return;
  bool enabled = false;
  std::string output_path, job_name = "DeepSpeedJobName";
  for (const auto& [key, v] : section.items()) {
    const std::string name = "tensorboard." + key;
    if (key == "enabled") {
      if (auto b = r.boolean(v, name)) enabled = *b;
    } else if (key == "output_path") {
      if (auto s = r.string(v, name)) output_path = *s;
    } else if (key == "job_name") {
      if (auto s = r.string(v, name)) job_name = *s;
    } else {
      r.unknown.push_back(name);
    }
  }
  if (!enabled) return;
  if (output_path.empty())
    r.bad.push_back("tensorboard.output_path: required when tensorboard.enabled is true (the folder of the event files)");
  else if (job_name.empty() || job_name == "." || job_name == ".." || job_name.find('/') != std::string::npos)
    r.bad.push_back("tensorboard.job_name=\"" + async::bounded_echo(job_name) + "\" (expected a folder name, without '/')");
  else
    c.tensorboard_dir = std::filesystem::path(output_path) / job_name;
}

void read_scheduler(Reader& r, const json& section, TrainerConfig& c) {
  if (!r.object(section, "scheduler")) return;
  std::string type;
  if (section.contains("type")) {
    if (auto s = r.string(section["type"], "scheduler.type")) type = *s;
  } else {
    r.bad.push_back("scheduler: no 'type' (expected WarmupLR, WarmupDecayLR or WarmupCosineLR)");
  }
  for (const auto& [key, v] : section.items())
    if (key != "type" && key != "params") r.unknown.push_back("scheduler." + key);
  if (type.empty()) return;
  if (type != "WarmupLR" && type != "WarmupDecayLR" && type != "WarmupCosineLR") {
    r.bad.push_back("scheduler.type=\"" + async::bounded_echo(type) + "\" (expected WarmupLR, WarmupDecayLR or WarmupCosineLR)");
    return;
  }
  const bool cosine = type == "WarmupCosineLR";
  std::optional<double> min_lr, max_lr, min_ratio, cos_ratio;
  std::optional<std::size_t> warmup, total;
  c.warmup_shape = WarmupShape::log;  // DeepSpeed's default warmup_type
  const json params = section.contains("params") ? section["params"] : json::object();
  if (!r.object(params, "scheduler.params")) return;
  for (const auto& [key, v] : params.items()) {
    const std::string name = "scheduler.params." + key;
    if (key == "warmup_num_steps") warmup = r.count(v, name);
    else if (key == "total_num_steps" && type != "WarmupLR") total = r.count(v, name);
    else if (key == "warmup_min_lr" && !cosine) min_lr = r.number(v, name);
    else if (key == "warmup_max_lr" && !cosine) max_lr = r.number(v, name);
    else if (key == "warmup_min_ratio" && cosine) min_ratio = r.number(v, name);
    else if (key == "cos_min_ratio" && cosine) cos_ratio = r.number(v, name);
    else if (key == "last_batch_iteration") r.notes.push_back(name + ": no effect (a resumed run continues its schedule from its step)");
    else if (key == "warmup_type") {
      if (auto s = r.string(v, name)) {
        if (*s == "linear") c.warmup_shape = WarmupShape::linear;
        else if (*s == "log") c.warmup_shape = WarmupShape::log;
        else r.bad.push_back(name + "=\"" + async::bounded_echo(*s) + "\" (expected log or linear)");
      }
    } else r.unknown.push_back(name);
  }
  c.warmup_steps = static_cast<std::int64_t>(warmup.value_or(1000));  // DeepSpeed's default
  if (max_lr) c.lr = static_cast<float>(*max_lr);
  if (cosine) {
    c.warmup_min_lr = static_cast<float>(min_ratio.value_or(0.0) * c.lr);
    c.min_lr = static_cast<float>(cos_ratio.value_or(0.0001) * c.lr);
  } else {
    c.warmup_min_lr = static_cast<float>(min_lr.value_or(0.0));
    c.min_lr = c.warmup_min_lr;
  }
  if (type == "WarmupLR") {
    c.decay = LrDecay::none;
  } else if (!total) {
    r.bad.push_back("scheduler.params.total_num_steps: required by " + type);
  } else {
    c.decay = cosine ? LrDecay::cosine : LrDecay::linear;
    c.decay_steps = static_cast<std::int64_t>(*total);
  }
}

}  // namespace

Result<TrainerConfig> TrainerConfig::from_json(std::string_view text, const TrainerConfig& base,
                                               std::vector<std::string>* notes) {
  if (auto nested = async::check_json_nesting(text, "config"); !nested) return fail(std::move(nested).error());
  json doc = json::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false, /*ignore_comments=*/true);
  if (doc.is_discarded()) return fail(ErrorCode::invalid_argument, "config: not valid JSON");
  if (!doc.is_object()) return fail(ErrorCode::invalid_argument, "config: expected a JSON object, got ", doc.type_name());

  TrainerConfig c = base;
  Reader r;
  // A bare zero_optimization section, or a whole DeepSpeed config.
  const bool whole = !doc.contains("stage") && !doc.contains("stage3_prefetch_bucket_size");
  json zero = whole ? (doc.contains("zero_optimization") ? doc["zero_optimization"] : json::object()) : doc;

  // The compute dtype first: it converts DeepSpeed's element counts into bytes.
  if (whole) {
    std::vector<std::string> enabled_sections;
    for (const char* section : {"fp16", "bf16"}) {
      if (!doc.contains(section)) continue;
      const json& s = doc[section];
      if (!r.object(s, section)) continue;
      bool enabled = false;
      for (const auto& [key, v] : s.items()) {
        const std::string name = std::string(section) + "." + key;
        if (key == "enabled") {
          if (auto b = r.boolean(v, name)) enabled = *b;
        } else if (std::string_view(section) == "fp16" && key == "initial_scale_power") {
          if (auto n = r.count(v, name)) {
            if (*n > 62) r.bad.push_back(name + "=" + std::to_string(*n) + " (expected 0..62)");
            else c.initial_loss_scale = std::ldexp(1.0f, static_cast<int>(*n));
          }
        } else if (std::string_view(section) == "fp16" && key == "loss_scale") {
          if (auto d = r.number(v, name)) {
            if (*d == 0) c.loss_scaling = modules::LossScaling::dynamic;
            else if (*d > 0) {
              c.loss_scaling = modules::LossScaling::fixed;
              c.initial_loss_scale = static_cast<float>(*d);
            } else r.bad.push_back(name + " (expected 0 for dynamic, or > 0)");
          }
        } else if (std::string_view(section) == "fp16" &&
                   (key == "loss_scale_window" || key == "hysteresis" || key == "min_loss_scale" ||
                    key == "consecutive_hysteresis" || key == "auto_cast")) {
          r.notes.push_back(name + ": accepted, no effect in coshard (dynamic scaling uses growth_interval)");
        } else {
          r.unknown.push_back(name);
        }
      }
      if (enabled) {
        c.set_compute_dtype(std::string_view(section) == "fp16" ? DataType::f16 : DataType::bf16);
        enabled_sections.push_back(section);
      }
    }
    // DeepSpeed refuses this too; picking one silently trains in a precision nobody asked for.
    if (enabled_sections.size() > 1)
      r.bad.push_back("fp16.enabled=true and bf16.enabled=true (expected at most one of them)");
  }
  const std::size_t element = collectives::size_of(c.dtype);
  // (the table's DeepSpeed sizes are counts of these; Reader::setting turns them into bytes)

  if (whole) {
    for (const auto& [key, v] : doc.items()) {
      if (key == "zero_optimization" || key == "fp16" || key == "bf16") continue;
      // adaptive_prefetch after every other key: a prefetch_bucket_bytes given beside it is its cap
      // (alone, a fixed depth), whichever the file names first.
      if (key == "adaptive_prefetch") continue;
      // Lists of globs: the parameters that do not train (--freeze), the linear layers LoRA adapts
      // (--lora-targets).
      if (key == "freeze" || key == "lora_targets") {
        if (!v.is_array() || v.size() > 4096) {
          r.bad.push_back(key + "=" + async::bounded_echo(v.dump(), 64) + " (expected a list of at most 4096 globs)");
          continue;
        }
        std::vector<std::string> patterns;
        for (const auto& pattern : v)
          if (auto text = r.string(pattern, key + "[]")) patterns.push_back(*text);
        (key == "freeze" ? c.freeze : c.lora_targets) = std::move(patterns);
        continue;
      }
      // DeepSpeed's sections are objects; coshard's settings of the same name ("optimizer":
      // "sgd", "activation_checkpointing": "full") are not.
      const Setting* own = v.is_object() ? nullptr : setting_named(key);
      if (const Setting* setting = own ? own : setting_for_deepspeed(key)) {
        r.setting(*setting, v, key, c, element, !own && setting->deepspeed_elements);
      } else if (key == "optimizer") {
        if (!r.object(v, key)) continue;
        for (const auto& [okey, ov] : v.items()) {
          const std::string name = "optimizer." + okey;
          if (okey == "type") {
            if (auto s = r.string(ov, name)) {
              const auto t = lower(*s);
              if (t == "adamw" || t == "adam") c.optimizer = OptimizerKind::adamw;
              else if (t == "sgd") c.optimizer = OptimizerKind::sgd;
              else r.bad.push_back(name + "=\"" + async::bounded_echo(*s) + "\" (expected AdamW, Adam or SGD)");
            }
          } else if (okey == "params") {
            if (!r.object(ov, name)) continue;
            for (const auto& [pkey, pv] : ov.items()) {
              const std::string pname = name + "." + pkey;
              if (const Setting* setting = setting_for_deepspeed(pname)) {
                r.setting(*setting, pv, pname, c, element, false);
              } else if (pkey == "betas") {
                if (!pv.is_array() || pv.size() != 2) {
                  r.bad.push_back(pname + "=" + async::bounded_echo(pv.dump()) + " (expected [beta1, beta2])");
                } else {
                  auto b1 = r.number(pv[0], pname + "[0]");
                  auto b2 = r.number(pv[1], pname + "[1]");
                  if (b1 && b2) {
                    c.beta1 = static_cast<float>(*b1);
                    c.beta2 = static_cast<float>(*b2);
                  }
                }
              } else {
                r.unknown.push_back(pname);
              }
            }
          } else {
            r.unknown.push_back(name);
          }
        }
      } else if (key == "scheduler") {
        read_scheduler(r, v, c);
      } else if (key == "tensorboard") {
        read_tensorboard(r, v, c);
      } else if (key == "activation_checkpointing") {
        read_activation_checkpointing(r, v, c);
      } else if (key == "tensor_parallel") {  // DeepSpeed's AutoTP section: its size
        if (!r.object(v, key)) continue;
        for (const auto& [tkey, tv] : v.items()) {
          const std::string name = "tensor_parallel." + tkey;
          if (const Setting* setting = setting_for_deepspeed(name)) r.setting(*setting, tv, name, c, element, false);
          else r.unknown.push_back(name);
        }
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

  if (!zero.is_object()) {
    r.bad.push_back("zero_optimization=" + async::bounded_echo(zero.dump()) + " (expected an object)");
  } else {
    const std::string z = whole ? "zero_optimization." : "";
    for (const auto& [key, v] : zero.items()) {
      const std::string name = z + key;
      if (const Setting* setting = setting_for_deepspeed("zero_optimization." + key)) {
        r.setting(*setting, v, name, c, element, setting->deepspeed_elements);
      } else if (key == "mics_shard_size") {
        // MiCS: parameters sharded within groups of this many ranks, replicated across them
        // (-1, DeepSpeed's default: off, the whole world).
        if (v.is_number_integer() && v.get<std::int64_t>() == -1) {
          c.shard_group_size = 0;
          c.shard_group_local = false;
        } else {
          r.setting(*setting_named("shard_group_size"), v, name, c, element, false);
        }
      } else if (key == "zero_hpz_partition_size") {
        // hpZ's secondary copy within the node is not built: only its default (1, off) is taken.
        if (auto n = r.count(v, name); n && *n != 1)
          r.bad.push_back(name + "=" + std::to_string(*n) + " (hpZ's node-local secondary partition is not built in "
                                                           "coshard; expected 1; mics_shard_size gives hybrid sharding)");
      } else if (key == "mics_hierarchical_params_gather") {
        if (r.boolean(v, name))
          r.notes.push_back(name + ": accepted, no effect (a shard group's gather is one collective within the group)");
      } else if (key == "stage3_use_all_reduce_for_fetch_params") {
        if (auto b = r.boolean(v, name)) c.fetch_mode = *b ? zero::FetchMode::all_reduce : zero::FetchMode::all_gather;
      } else if (key == "offload_optimizer") {
        read_offload(r, v, name, c.offload_optimizer);
      } else if (key == "offload_param") {
        read_offload(r, v, name, c.offload_params);
      } else if (key == "reduce_bucket_size" || key == "allgather_bucket_size") {
        if (r.count(v, name))
          r.notes.push_back(name + ": accepted, no effect (gradients are reduce-scattered per fetch unit, parameters "
                                   "gathered per unit; a unit is one bucket)");
      } else if (key == "overlap_comm" || key == "contiguous_gradients" || key == "reduce_scatter" ||
                 key == "allgather_partitions") {
        if (auto b = r.boolean(v, name)) {
          if (!*b)
            r.bad.push_back(name + "=false (coshard always " +
                            std::string(key == "overlap_comm" ? "overlaps communication with compute"
                                        : key == "contiguous_gradients" ? "keeps gradients contiguous per unit"
                                        : key == "reduce_scatter" ? "reduce-scatters gradients"
                                                                 : "all-gathers partitions") +
                            "; expected true)");
        }
      } else if (key == "stage3_gather_16bit_weights_on_model_save" ||
                 key == "round_robin_gradients" || key == "memory_efficient_linear") {
        r.notes.push_back(name + ": accepted, no effect in coshard");
      } else {
        r.unknown.push_back(name);
      }
    }
  }

  if (whole && doc.contains("adaptive_prefetch"))
    r.setting(*setting_named("adaptive_prefetch"), doc["adaptive_prefetch"], "adaptive_prefetch", c, element, false);

  if (!r.unknown.empty() || !r.bad.empty()) {
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
    return fail(ErrorCode::invalid_argument, msg);
  }
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
