// The sections of a DeepSpeed config (deepspeed_sections.hpp), each read onto a TrainerConfig:
// every key of a section taken, noted as without effect, refused with its reason, or named unknown.
#include "deepspeed_sections.hpp"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/json_limits.hpp"
#include "coshard/trainer/settings.hpp"

namespace coshard::trainer::detail {

using modules::DataType;
using json = nlohmann::json;

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

// zero_optimization's offload_optimizer or offload_param (`prefix`: its key as named): the device,
// its NVMe folder and the swap buffers' count; DeepSpeed's other knobs noted.
void read_offload(ConfigReader& r, const json& section, const std::string& prefix, OffloadOptions& out) {
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

}  // namespace

// fp16 and bf16: the compute dtype (at most one of them enabled) and fp16's loss scaling.
void read_precision(ConfigReader& r, const json& doc, TrainerConfig& c) {
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

// zero_optimization (`section`: the whole file when it is the bare section, its keys then named
// without the "zero_optimization." prefix): the table's keys, hybrid sharding, the offload sections,
// and DeepSpeed's own knobs, taken where coshard does the same always.
void read_zero_optimization(ConfigReader& r, const json& section, bool whole, TrainerConfig& c,
                            std::size_t element) {
  if (!section.is_object()) {
    r.bad.push_back("zero_optimization=" + async::bounded_echo(section.dump()) + " (expected an object)");
    return;
  }
  const std::string z = whole ? "zero_optimization." : "";
  for (const auto& [key, v] : section.items()) {
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
    } else if (key == "mics_hierarchical_params_gather") {
      if (r.boolean(v, name))
        r.notes.push_back(name + ": accepted, no effect (a shard group's gather is one collective within the group)");
    } else if (key == "zero_quantized_weights" || key == "zero_quantized_nontrainable_weights") {
      // ZeRO++'s qwZ: int8 blocks in the weights' gathers (of every unit, or of frozen ones).
      if (auto b = r.boolean(v, name))
        r.give(*setting_named(key == "zero_quantized_weights" ? "quantize_weights" : "quantize_frozen_weights"), name,
               *b ? "int8" : "none", c);
    } else if (key == "zero_quantized_gradients") {  // ZeRO++'s qgZ: int4 blocks, as DeepSpeed's all-to-all carries
      if (auto b = r.boolean(v, name)) r.give(*setting_named("quantize_gradients"), name, *b ? "int4" : "none", c);
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

// optimizer: its type and params (the table's keys, and betas).
void read_optimizer(ConfigReader& r, const json& section, TrainerConfig& c, std::size_t element) {
  if (!r.object(section, "optimizer")) return;
  for (const auto& [okey, ov] : section.items()) {
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
}

// DeepSpeed's WarmupLR, WarmupDecayLR and WarmupCosineLR, onto the schedule of lr_at:
//   WarmupLR        warmup_min_lr -> warmup_max_lr (= lr) over warmup_num_steps, then constant
//   WarmupDecayLR   the same, then linear to warmup_min_lr at total_num_steps
//   WarmupCosineLR  warmup_min_ratio x lr -> lr over warmup_num_steps, then cosine to
//                   cos_min_ratio x lr at total_num_steps (lr from the optimizer section)
// warmup_type "log" (DeepSpeed's default) or "linear".
void read_scheduler(ConfigReader& r, const json& section, TrainerConfig& c) {
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

// DeepSpeed's monitor section {"enabled": true, "output_path": "runs", "job_name": "gpt"}: event
// files in output_path/job_name (job_name defaults to DeepSpeed's "DeepSpeedJobName").
void read_tensorboard(ConfigReader& r, const json& section, TrainerConfig& c) {
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

// DeepSpeed's activation_checkpointing section: its presence checkpoints every block (as
// transformers' gradient_checkpointing_enable does under DeepSpeed), unless the base config
// already picks every N-th. What only shapes DeepSpeed's own buffers is accepted as a note;
// cpu_checkpointing (inputs kept in host memory) is refused.
void read_activation_checkpointing(ConfigReader& r, const json& section, TrainerConfig& c) {
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

// tensor_parallel, DeepSpeed's AutoTP section: its size.
void read_tensor_parallel(ConfigReader& r, const json& section, TrainerConfig& c, std::size_t element) {
  if (!r.object(section, "tensor_parallel")) return;
  for (const auto& [tkey, tv] : section.items()) {
    const std::string name = "tensor_parallel." + tkey;
    if (const Setting* setting = setting_for_deepspeed(name)) r.setting(*setting, tv, name, c, element, false);
    else r.unknown.push_back(name);
  }
}

}  // namespace coshard::trainer::detail
