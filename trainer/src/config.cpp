#include "coshard/trainer/config.hpp"
#include "coshard/trainer/settings.hpp"

#include "coshard/async/files.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/zero/memory_estimate.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cstdio>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

namespace coshard::trainer {

using modules::DataType;
using json = nlohmann::json;

std::string_view to_string(OptimizerKind k) noexcept { return k == OptimizerKind::adamw ? "adamw" : "sgd"; }

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

Result<void> check_offload(const OffloadOptions& o, std::string_view what, bool needs_path) {
  if (o.device == OffloadDevice::none) return {};
  if (o.device == OffloadDevice::nvme && o.nvme_path.empty() && needs_path)
    return fail(ErrorCode::invalid_argument, what, "=nvme: needs a path (nvme:/path/to/folder)");
  if (o.buffer_count < 1)
    return fail(ErrorCode::invalid_argument, what, ".buffer_count=", o.buffer_count, ": expected >= 1");
  return {};
}

}  // namespace

Result<void> TrainerConfig::validate() const {
  // Each setting's own range (settings.hpp), then what holds between settings.
  for (const auto& s : settings()) COSHARD_TRY(s.validate(*this));
  if (reduce_dtype != dtype)
    return fail(ErrorCode::unsupported, "reduce_dtype=", collectives::to_string(reduce_dtype),
                ": gradients are reduced in the compute dtype (expected ", collectives::to_string(dtype), ")");
  if (zero_stage == 3 && max_live_bytes == 0)
    return fail(ErrorCode::invalid_argument, "max_live_bytes=0: expected at least the largest fetch unit");
  if (!(warmup_min_lr <= lr))
    return fail(ErrorCode::invalid_argument, "warmup_min_lr=", warmup_min_lr, ": expected in [0, lr=", lr, "]");
  if (decay != LrDecay::none) {
    if (decay_steps <= warmup_steps)
      return fail(ErrorCode::invalid_argument, "decay_steps=", decay_steps, " with lr decay ", to_string(decay),
                  ": expected more than warmup_steps=", warmup_steps, " (the step the decay reaches min_lr)");
    if (!(min_lr <= lr))
      return fail(ErrorCode::invalid_argument, "min_lr=", min_lr, ": expected in [0, lr=", lr, "]");
  }
  if (tensor_parallel_size > 1 && expert_parallel_size > 1)
    return fail(ErrorCode::unsupported, "expert_parallel_size=", expert_parallel_size, " with tensor_parallel_size=",
                tensor_parallel_size, ": expert and tensor parallelism are not combined yet (a mixture of experts is "
                "not split over tensor ranks: use tensor_parallel_size 1)");
  if (tensor_parallel_size > 1 && cross_entropy == CrossEntropyKind::chunked)
    return fail(ErrorCode::unsupported, "cross_entropy=chunked with tensor_parallel_size=", tensor_parallel_size,
                ": the output layer is split over the tensor ranks, whose vocabulary-parallel loss keeps only their "
                "columns (expected cross_entropy auto or whole)");
  COSHARD_TRY(check_offload(offload_optimizer, "offload_optimizer", true));
  // (offload_params=nvme keeps its shards in the optimizer's swap files: its own path is optional)
  COSHARD_TRY(check_offload(offload_params, "offload_params", false));
  COSHARD_TRY(zero::check_offload_placement(engine_options()));
  COSHARD_TRY(zero::check_step_in_backward(engine_options(), step_control()));
  COSHARD_TRY(zero::check_swap_gradients(engine_options()));
  COSHARD_TRY(zero::check_quantized_gathers(engine_options()));
  COSHARD_TRY(zero::check_secondary_partition(engine_options(), 0));  // (the world's rules when it is known)
  if (secondary_partition_local && zero_stage != 3)
    return fail(ErrorCode::invalid_argument, "secondary_partition_ranks=local with zero_stage=", zero_stage,
                ": stages 0-2 keep whole copies and gather no weights within a step (expected zero_stage 3)");
  return {};
}

std::optional<modules::LoraOptions> TrainerConfig::lora() const {
  if (lora_rank == 0) return std::nullopt;
  modules::LoraOptions o;
  o.targets = lora_targets;
  o.rank = lora_rank;
  o.alpha = lora_alpha;
  o.dropout = lora_dropout;
  o.seed = seed;
  return o;
}

Result<std::vector<modules::LoraAdapterInfo>> apply_lora(const TrainerConfig& c, modules::Module& model,
                                                         collectives::Communicator* tensor_group) {
  auto options = c.lora();
  if (!options) return std::vector<modules::LoraAdapterInfo>{};
  options->tensor_group = tensor_group;
  if (options->targets.empty()) {
    options->targets = modules::default_lora_targets(model);
    if (options->targets.empty())
      return fail(ErrorCode::invalid_argument, "lora_rank=", c.lora_rank, ": the model has no default LoRA targets (a ",
                  model.type_name(), " that is neither make_llama's nor make_gpt's): name them (--lora-targets)");
  }
  return modules::apply_lora(model, *options);  // (its errors name LoRA and the value already)
}

modules::StepControlOptions TrainerConfig::step_control() const {
  modules::StepControlOptions control;
  control.max_grad_norm = max_grad_norm;
  control.loss_scaling = loss_scaling;
  control.initial_loss_scale = initial_loss_scale;
  return control;
}

namespace {

// Whether a secondary partition of n ranks (`local`: as resolved) divides the data ranks, in the
// trainer's words: with tensor parallelism the data ranks are named with the world they come from.
Result<void> check_secondary_divides(int n, bool local, int data_ranks, int tensor) {
  if (n <= 1 || data_ranks % n == 0) return {};
  if (tensor > 1)
    return fail(ErrorCode::invalid_argument, "secondary_partition_ranks=", n, local ? " (local)" : "",
                ": expected a divisor of the data ranks ", data_ranks, " (world ", data_ranks * tensor, " / tensor ",
                tensor, ")");
  return fail(ErrorCode::invalid_argument, "secondary_partition_ranks=", n, local ? " (local)" : "",
              ": expected a divisor of the world size ", data_ranks);
}

}  // namespace

Result<zero::EngineOptions> TrainerConfig::engine_options_for(modules::Module& model, int world_size) const {
  zero::EngineOptions o = engine_options();
  o.expected_micro_batches = gradient_accumulation_steps;
  COSHARD_TRY_ASSIGN(o.shard_group_size, shard_group_size_for(world_size));
  COSHARD_TRY_ASSIGN(o.secondary_partition_ranks, secondary_partition_ranks_for(world_size));
  COSHARD_TRY(check_secondary_divides(o.secondary_partition_ranks, secondary_partition_local, world_size,
                                      tensor_parallel_size));
  COSHARD_TRY(zero::check_secondary_partition(o, world_size));
  if (!max_live_follows_model || zero_stage != 3) return o;
  zero::EngineOptions unbounded = o;
  unbounded.max_live_bytes = std::numeric_limits<std::size_t>::max();
  COSHARD_TRY_ASSIGN(const auto units, zero::plan_units(model, world_size, unbounded));
  std::size_t largest = 0;
  for (const auto& u : units) largest = std::max(largest, u.padded_bytes);
  if (largest > std::numeric_limits<std::size_t>::max() / 2) return o;  // let the engine name it
  if (o.max_live_bytes < largest) o.max_live_bytes = 2 * largest;
  return o;
}

namespace {

// The data ranks of one node: under a launcher its count of ranks on this machine; ranks as
// threads share one machine. (With tensor parallelism a node holds its ranks over the tensor size
// of data ranks.)
Result<int> data_ranks_per_node(int data_ranks, int tensor_parallel_size) {
  COSHARD_TRY_ASSIGN(const auto env, collectives::read_launch_env());
  return env.launcher == collectives::Launcher::none ? data_ranks : std::max(1, env.local_size / tensor_parallel_size);
}

}  // namespace

Result<int> TrainerConfig::shard_group_size_for(int data_ranks) const {
  if (!shard_group_local) return shard_group_size;
  return data_ranks_per_node(data_ranks, tensor_parallel_size);
}


Result<void> TrainerConfig::validate_for_world(int world) const {
  if (world < 1 || tensor_parallel_size < 1 || world % tensor_parallel_size != 0) return {};  // (named elsewhere)
  if (secondary_partition_local) return {};  // (resolved when the engine's options are made)
  return check_secondary_divides(secondary_partition_ranks, false, world / tensor_parallel_size, tensor_parallel_size);
}

Result<int> TrainerConfig::secondary_partition_ranks_for(int data_ranks) const {
  if (!secondary_partition_local) return secondary_partition_ranks;
  return data_ranks_per_node(data_ranks, tensor_parallel_size);
}

void TrainerConfig::set_compute_dtype(DataType compute) noexcept {
  dtype = compute;
  reduce_dtype = compute;
  if (compute == DataType::f16 && loss_scaling == modules::LossScaling::none) loss_scaling = modules::LossScaling::dynamic;
}

std::string_view to_string(LrDecay d) noexcept {
  switch (d) {
    case LrDecay::none: return "none";
    case LrDecay::linear: return "linear";
    case LrDecay::cosine: return "cosine";
  }
  return "?";
}

float TrainerConfig::lr_at(std::int64_t step) const noexcept {
  if (step < warmup_steps) {
    const double progress = warmup_shape == WarmupShape::log
                                ? std::log(static_cast<double>(step + 1)) / std::log(static_cast<double>(std::max<std::int64_t>(warmup_steps, 2)))
                                : static_cast<double>(step + 1) / static_cast<double>(warmup_steps);
    return static_cast<float>(warmup_min_lr + (lr - warmup_min_lr) * progress);
  }
  if (decay == LrDecay::none) return lr;
  const double span = static_cast<double>(std::max<std::int64_t>(1, decay_steps - warmup_steps));
  const double progress = std::clamp(static_cast<double>(step - warmup_steps) / span, 0.0, 1.0);
  const double factor = decay == LrDecay::linear ? 1.0 - progress : 0.5 * (1.0 + std::cos(3.14159265358979323846 * progress));
  return static_cast<float>(min_lr + (lr - min_lr) * factor);
}

Result<std::int64_t> TrainerConfig::check_batch(int world_size, std::int64_t global_batch) const {
  // (tensor parallelism: the batch splits over the data ranks; a tensor group reads the same rows)
  const bool split = tensor_parallel_size > 1 && world_size % tensor_parallel_size == 0;
  const int world = split ? world_size / tensor_parallel_size : world_size;
  const std::int64_t per_step = static_cast<std::int64_t>(world) * gradient_accumulation_steps;
  std::int64_t batch = global_batch;
  auto named = [&] {
    return "train_batch_size=" + std::to_string(train_batch_size) + ", train_micro_batch_size_per_gpu=" +
           std::to_string(train_micro_batch_size_per_gpu) + ", gradient_accumulation_steps=" +
           std::to_string(gradient_accumulation_steps) + ", world size " + std::to_string(world) +
           (global_batch > 0 ? ", --batch " + std::to_string(global_batch) : std::string());
  };
  if (train_batch_size > 0 && train_micro_batch_size_per_gpu > 0 &&
      train_batch_size != train_micro_batch_size_per_gpu * per_step)
    return fail(ErrorCode::invalid_argument, named(), ": expected train_batch_size = micro batch x accumulation x world = ",
                train_micro_batch_size_per_gpu * per_step);
  const std::int64_t from_config =
      train_batch_size > 0 ? train_batch_size : train_micro_batch_size_per_gpu > 0 ? train_micro_batch_size_per_gpu * per_step : 0;
  if (from_config > 0 && batch > 0 && from_config != batch)
    return fail(ErrorCode::invalid_argument, named(), ": the config's global batch is ", from_config, ", not ", batch);
  if (batch <= 0) batch = from_config;
  if (batch <= 0) return fail(ErrorCode::invalid_argument, named(), ": no batch size given");
  if (batch % per_step != 0)
    return fail(ErrorCode::invalid_argument, "--batch ", batch, " does not split evenly over ", world, split ? " data" : "",
                " rank(s) x ",
                gradient_accumulation_steps, " micro-batch(es)");
  return batch;
}

std::map<std::string, std::string> TrainerConfig::identity() const {
  auto out = run_identity;
  out["seed"] = std::to_string(seed);
  // LoRA's scale: the adapters' values mean another product under another alpha (a resume with
  // another --lora-alpha would train on without a word). Rank and targets are the units' shapes.
  if (lora_rank > 0) {
    char alpha[32];
    std::snprintf(alpha, sizeof alpha, "%.9g", static_cast<double>(lora_alpha));
    out["LoRA alpha"] = alpha;
  }
  return out;
}

Result<std::size_t> parse_size(std::string_view text) {
  const std::string t = lower(text);
  std::size_t i = 0;
  while (i < t.size() && (std::isdigit(static_cast<unsigned char>(t[i])) || t[i] == '.' || t[i] == 'e' ||
                          (i > 0 && t[i - 1] == 'e' && (t[i] == '+' || t[i] == '-'))))
    ++i;
  double value = 0;
  const auto [end, ec] = std::from_chars(t.data(), t.data() + i, value);
  if (i == 0 || ec != std::errc{} || end != t.data() + i || !(value >= 0))
    return fail(ErrorCode::invalid_argument, "size '", text, "': expected a number with an optional unit (64MiB, 1GB, 4096)");
  std::string unit = t.substr(i);
  while (!unit.empty() && unit.front() == ' ') unit.erase(0, 1);
  static constexpr std::pair<std::string_view, double> kUnits[] = {
      {"", 1},          {"b", 1},           {"k", 1024},        {"kib", 1024},      {"kb", 1e3},
      {"m", 1 << 20},   {"mib", 1 << 20},   {"mb", 1e6},        {"g", 1ull << 30},  {"gib", 1ull << 30},
      {"gb", 1e9},      {"t", 1ull << 40},  {"tib", 1ull << 40}, {"tb", 1e12}};
  for (const auto& [name, scale] : kUnits) {
    if (unit != name) continue;
    const double bytes = value * scale;
    if (bytes > 1.8e19)
      return fail(ErrorCode::out_of_range, "size '", text, "': more than 2^64 bytes");
    if (bytes != std::floor(bytes))
      return fail(ErrorCode::invalid_argument, "size '", text, "': not a whole number of bytes");
    return static_cast<std::size_t>(bytes);
  }
  return fail(ErrorCode::invalid_argument, "size '", text, "': unknown unit '", unit,
              "' (expected B, KiB, MiB, GiB, TiB, KB, MB, GB or TB)");
}

Result<OffloadOptions> parse_offload(std::string_view text) {
  OffloadOptions o;
  if (text == "none") return o;
  if (text == "cpu") {
    o.device = OffloadDevice::cpu;
    return o;
  }
  if (text == "nvme" || text.starts_with("nvme:")) {
    o.device = OffloadDevice::nvme;
    if (text.size() > 5) o.nvme_path = std::string(text.substr(5));
    return o;
  }
  return fail(ErrorCode::invalid_argument, "offload '", text, "': expected none, cpu or nvme:PATH");
}

}  // namespace coshard::trainer
