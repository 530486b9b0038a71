// The table of the trainer's settings (settings.hpp): one entry each, in --help's order, made by
// topic (the parallelism, the compute, the step, its schedule, ...) and concatenated in that order,
// which coshard-train --help and --print-config show. The settings with a form of their own
// ("auto", "local", "none, full or N", a device and its folder) have a function each.
#include <cstdint>
#include <limits>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/trainer/config.hpp"
#include "coshard/trainer/settings.hpp"
#include "setting_kinds.hpp"

namespace coshard::trainer {

namespace {

using detail::boolean;
using detail::bytes;
using detail::choice;
using detail::get_value;
using detail::integer;
using detail::no_check;
using detail::parse_number;
using detail::ranks_or_local_setting;
using detail::real;

constexpr std::string_view kFetchModes[] = {"all_gather", "all_reduce"};
constexpr std::string_view kDtypes[] = {"f32", "bf16", "f16"};
constexpr std::string_view kLossScaling[] = {"none", "fixed", "dynamic"};
constexpr std::string_view kAttention[] = {"fused", "materialized", "cudnn"};
constexpr std::string_view kOptimizers[] = {"adamw", "sgd"};
constexpr std::string_view kCrossEntropy[] = {"auto", "chunked", "whole"};
constexpr std::string_view kWarmupShapes[] = {"linear", "log"};
constexpr std::string_view kDecays[] = {"none", "linear", "cosine"};

constexpr long double kCountMax = 4611686018427387904.0L;  // 2^62: room to multiply by an element size

using T = TrainerConfig;

// A size, or auto: the depth measured from gather and compute times, not hand-set.
Setting prefetch_bucket_setting() {
  Setting s = bytes<&T::prefetch_bucket_bytes>(
      {.name = "prefetch_bucket_bytes", .flag = "--prefetch-bucket",
       .deepspeed = "zero_optimization.stage3_prefetch_bucket_size",
       .help = "bytes gathered ahead of use (64MiB), or auto: measured from gather and compute times",
       .expected = "a size or auto", .deepspeed_elements = true});
  s.get = [](const Setting&, const TrainerConfig& c) {
    return c.adaptive_prefetch && c.prefetch_bucket_bytes == 0 ? std::string("auto") : std::to_string(c.prefetch_bucket_bytes);
  };
  s.parse = [](const Setting&, TrainerConfig& c, std::string_view text) -> Result<void> {
    if (text == "auto") {  // measured, not hand-set
      c.adaptive_prefetch = true;
      c.prefetch_bucket_bytes = 0;
      return {};
    }
    COSHARD_TRY_ASSIGN(c.prefetch_bucket_bytes, parse_size(text));
    c.adaptive_prefetch = false;
    return {};
  };
  return s;
}

// A size, exact, or auto: the default, which follows the model.
Setting max_live_setting() {
  Setting s = bytes<&T::max_live_bytes>(
      {.name = "max_live_bytes", .flag = "--max-live", .deepspeed = "zero_optimization.stage3_max_live_parameters",
       .help = "budget of gathered parameter bytes, exact (default: 1GiB, or twice the largest fetch unit where 1GiB "
               "cannot hold it)",
       .expected = "a size", .deepspeed_elements = true});
  // "auto": the default, which follows the model (1GiB, or twice the largest unit where 1GiB
  // cannot hold it); what --print-config writes for it, so that its output reads back the same.
  s.get = [](const Setting&, const TrainerConfig& c) {
    return c.max_live_follows_model ? std::string("auto") : std::to_string(c.max_live_bytes);
  };
  s.parse = [](const Setting&, TrainerConfig& c, std::string_view text) -> Result<void> {
    if (text == "auto") {
      c.max_live_follows_model = true;
      c.max_live_bytes = TrainerConfig{}.max_live_bytes;
      return {};
    }
    COSHARD_TRY_ASSIGN(c.max_live_bytes, parse_size(text));
    c.max_live_follows_model = false;  // a budget given is exact
    return {};
  };
  return s;
}

Setting shard_group_setting() {
  return ranks_or_local_setting<&T::shard_group_size, &T::shard_group_local, 0>(
      {.name = "shard_group_size", .flag = "--shard-group-size",
       .help = "hybrid sharding (HSDP, MiCS): shard each unit over groups of N consecutive ranks and replicate "
               "across the groups; local: the ranks of one node; 0: the whole world (full sharding)",
       .expected = "a whole number that divides the world size, 0 (the whole world) or local"},
      0);
}

// f32, bf16 or f16, through set_compute_dtype (f16 turns on dynamic loss scaling unless it is set).
Setting dtype_setting() {
  Setting s{.name = "dtype", .flag = "--dtype",
            .help = "compute dtype (bf16/f16 on the CPU: matrix products and attention through oneDNN where the CPU "
                    "has AMX, and bf16's on AMD's AVX512-BF16, else on f32 copies; the other kernels read and write "
                    "bf16/f16 with f32 math; the run header names the products; COSHARD_CPU_ISA caps oneDNN's "
                    "instructions); f16 turns on dynamic loss scaling",
            .expected = "f32, bf16 or f16", .kind = SettingKind::choice, .choices = kDtypes};
  s.get = [](const Setting&, const TrainerConfig& c) { return std::string(to_string(c.dtype)); };
  s.parse = [](const Setting&, TrainerConfig& c, std::string_view text) -> Result<void> {
    if (text == "f32") c.set_compute_dtype(modules::DataType::f32);
    else if (text == "bf16") c.set_compute_dtype(modules::DataType::bf16);
    else if (text == "f16") c.set_compute_dtype(modules::DataType::f16);
    else return fail(ErrorCode::invalid_argument, "expected f32, bf16 or f16");
    return {};
  };
  s.check = [](const Setting& self, const TrainerConfig& c, std::string_view label) -> Result<void> {
    if (c.dtype == modules::DataType::f32 || c.dtype == modules::DataType::bf16 || c.dtype == modules::DataType::f16)
      return {};
    return fail(ErrorCode::invalid_argument, label, "=", to_string(c.dtype), ": expected ", self.expected);
  };
  return s;
}

// none, full or N (every N-th block), as modules::ActivationCheckpointing reads it.
Setting activation_checkpointing_setting() {
  Setting s{.name = "activation_checkpointing", .flag = "--activation-checkpointing",
            .help = "recompute blocks' activations in backward instead of keeping them: none, full (every block) or "
                    "N (every N-th block); the same losses, less activation memory",
            .expected = "none, full, or N", .kind = SettingKind::choice};
  s.get = [](const Setting&, const TrainerConfig& c) {
    return c.activation_checkpointing.every == 0   ? std::string("none")
           : c.activation_checkpointing.every == 1 ? std::string("full")
                                                   : std::to_string(c.activation_checkpointing.every);
  };
  s.parse = [](const Setting&, TrainerConfig& c, std::string_view text) -> Result<void> {
    COSHARD_TRY_ASSIGN(c.activation_checkpointing, modules::ActivationCheckpointing::parse(text));
    return {};
  };
  s.check = [](const Setting&, const TrainerConfig& c, std::string_view label) -> Result<void> {
    if (c.activation_checkpointing.every >= 0) return {};
    return fail(ErrorCode::invalid_argument, label, ".every=", c.activation_checkpointing.every,
                ": expected 0 (none), 1 (every block) or N (every N-th block)");
  };
  return s;
}

// --offload-optimizer and --offload-params: a device and its folder.
Setting offload_setting(bool params) {
  Setting s{.name = params ? "offload_params" : "offload_optimizer",
            .flag = params ? "--offload-params" : "--offload-optimizer",
            .help = params ? "none, cpu or nvme (stage 3, with --offload-optimizer; nvme: its folder)" : "none, cpu or nvme:PATH",
            .expected = "none, cpu or nvme:PATH", .kind = SettingKind::choice};
  s.get = params ? +[](const Setting&, const TrainerConfig& c) {
    return std::string(to_string(c.offload_params.device)) +
           (c.offload_params.nvme_path.empty() ? "" : ":" + c.offload_params.nvme_path.string());
  } : +[](const Setting&, const TrainerConfig& c) {
    return std::string(to_string(c.offload_optimizer.device)) +
           (c.offload_optimizer.nvme_path.empty() ? "" : ":" + c.offload_optimizer.nvme_path.string());
  };
  s.parse = params ? +[](const Setting&, TrainerConfig& c, std::string_view text) -> Result<void> {
    COSHARD_TRY_ASSIGN(c.offload_params, parse_offload(text));
    return {};
  } : +[](const Setting&, TrainerConfig& c, std::string_view text) -> Result<void> {
    COSHARD_TRY_ASSIGN(c.offload_optimizer, parse_offload(text));
    return {};
  };
  s.check = no_check;  // (TrainerConfig::validate checks the placement)
  s.per_rank = true;   // (the folder may differ by machine: rank agreement compares the device)
  return s;
}

// ZeRO: its stage, the fetches and their budgets, hybrid sharding; tensor parallelism.
void add_parallelism_settings(std::vector<Setting>& t) {
  t.push_back(integer<&T::zero_stage>(
      {.name = "zero_stage", .flag = "--zero-stage", .deepspeed = "zero_optimization.stage",
       .help = "0 (plain data parallelism: everything whole on every rank, gradients all-reduced), 1, 2 or 3 (ZeRO: "
               "optimizer state, + gradients, + parameters sharded)",
       .expected = "0, 1, 2 or 3"},
      0, 3));
  t.push_back(choice<&T::fetch_mode>({.name = "fetch_mode", .flag = "--fetch-mode", .help = "stage-3 fetch collective",
                                      .expected = "all_gather or all_reduce"},
                                     kFetchModes));
  detail::add_less_on_the_wire_settings(t);
  t.push_back(prefetch_bucket_setting());
  t.push_back(boolean<&T::adaptive_prefetch>(
      {.name = "adaptive_prefetch",
       .help = "prefetch depth from measured gather and compute times (prefetch_bucket_bytes, when set, caps it)"}));
  t.push_back(max_live_setting());
  t.push_back(boolean<&T::keep_frozen_gathered>(
      {.name = "keep_frozen_gathered", .flag = "--regather-frozen",
       .help = "stage 3: gather a frozen unit (a fine-tuned base) again for each use, instead of keeping it gathered "
               "for the rest of the step while max_live_bytes has room",
       .switch_sets = false}));
  t.push_back(integer<&T::max_reuse_distance>({.name = "max_reuse_distance", .flag = "--max-reuse-distance",
                                               .help = "keep a unit needed again within N fetches",
                                               .expected = "a whole number from 0 to 2^62"},
                                              0, kCountMax));
  t.push_back(integer<&T::max_reuse_distance_elements>(
      {.name = "max_reuse_distance_elements", .deepspeed = "zero_optimization.stage3_max_reuse_distance",
       .help = "keep a unit needed again before this many parameter elements are fetched",
       .expected = "a whole number from 0 to 2^62"},
      0, kCountMax));
  t.push_back(bytes<&T::persistence_threshold_bytes>(
      {.name = "persistence_threshold_bytes", .flag = "--persistence-threshold",
       .deepspeed = "zero_optimization.stage3_param_persistence_threshold", .help = "smaller units stay gathered",
       .expected = "a size", .deepspeed_elements = true}));
  t.push_back(bytes<&T::module_granularity_bytes>(
      {.name = "module_granularity_bytes", .flag = "--module-granularity",
       .deepspeed = "zero_optimization.zero_module_granularity_threshold", .help = "coalesce smaller leaf modules",
       .expected = "a size", .deepspeed_elements = true}));
  t.push_back(shard_group_setting());
  t.push_back(integer<&T::tensor_parallel_size>(
      {.name = "tensor_parallel_size", .flag = "--tensor-parallel", .deepspeed = "tensor_parallel.autotp_size",
       .help = "split the model over N consecutive ranks (Megatron's tensor parallelism: heads, MLP and vocabulary), "
               "ZeRO over each of the world / N data groups",
       .expected = "a whole number from 1 that divides the world size and the model's heads, key/value heads, MLP "
                   "width and vocabulary"},
      1, 1 << 16));
  t.push_back(integer<&T::expert_parallel_size>(
      {.name = "expert_parallel_size", .flag = "--expert-parallel",
       .help = "partition a mixture of experts' experts over N data ranks (at a stride: the world / N consecutive "
               "ranks holding the same experts shard them; the routed tokens travel by all-to-all)",
       .expected = "a whole number from 1 that divides the data-parallel ranks and the experts"},
      1, 1 << 16));
}

// The compute: precision, loss scaling, activation checkpointing, attention, the loss's kernels.
void add_compute_settings(std::vector<Setting>& t) {
  t.push_back(dtype_setting());
  t.push_back(choice<&T::loss_scaling>({.name = "loss_scaling",
                                        .help = "loss scaling: none, fixed (initial_loss_scale) or dynamic (f16)",
                                        .expected = "none, fixed or dynamic"},
                                       kLossScaling));
  t.push_back(real<&T::initial_loss_scale>(
      {.name = "initial_loss_scale", .help = "the loss scale a run starts from", .expected = "> 0"}, 0, true));
  t.push_back(activation_checkpointing_setting());
  t.push_back(choice<&T::attention>(
      {.name = "attention", .flag = "--attention",
       .help = "attention on CUDA: fused (flash-style kernels for bf16/f16 and head sizes 32/64/96/128: one statistic a "
               "query row kept), materialized (the T x T probabilities kept, as on the CPU), or cudnn (NVIDIA's fused "
               "attention through cuDNN's graph API, opened at run time from COSHARD_CUDNN_LIBRARY or the loader's "
               "path; bf16/f16, head sizes multiples of 8 up to 128; where cuDNN is absent or takes no shape, fused). "
               "Default: fused, except heads of 128 or more in a run of one process that fits with the probabilities "
               "and a tenth of the device's memory to spare: materialized (faster there today)",
       .expected = "fused, materialized or cudnn"},
      kAttention));
  t.push_back(choice<&T::cross_entropy>(
      {.name = "cross_entropy", .flag = "--cross-entropy",
       .help = "the loss against the model's output layer: chunked (fused with the layer, a chunk of vocabulary "
               "columns at a time: the logits never held whole), whole (over the whole logits), or auto: chunked on "
               "CUDA where the output layer takes it, else whole",
       .expected = "auto, chunked or whole"},
      kCrossEntropy));
  t.push_back(integer<&T::cross_entropy_chunk_mib>(
      {.name = "cross_entropy_chunk_mib", .flag = "--cross-entropy-chunk-mib",
       .help = "the most MiB one chunk of logits takes when the cross-entropy is chunked", .expected = "1 to 65536"},
      1, 65536));
}

// The step: its micro-batches, clipping, the optimizer and its learning rate.
void add_step_settings(std::vector<Setting>& t) {
  t.push_back(integer<&T::gradient_accumulation_steps>(
      {.name = "gradient_accumulation_steps", .flag = "--grad-accum", .deepspeed = "gradient_accumulation_steps",
       .help = "micro-batches per step on each rank", .expected = "1 to 1000000"},
      1, 1'000'000));
  t.push_back(real<&T::max_grad_norm>({.name = "max_grad_norm", .flag = "--clip", .deepspeed = "gradient_clipping",
                                       .help = "global gradient-norm clipping (0: off)", .expected = ">= 0 (0: no clipping)"},
                                      0, false));
  t.push_back(choice<&T::optimizer>({.name = "optimizer", .help = "adamw or sgd", .expected = "adamw or sgd"}, kOptimizers));
  t.push_back(real<&T::lr>({.name = "lr", .flag = "--lr", .deepspeed = "optimizer.params.lr", .help = "learning rate",
                            .expected = "> 0"},
                           0, true, std::numeric_limits<float>::max()));
}

// The learning rate's schedule: a warm-up, then a decay.
void add_schedule_settings(std::vector<Setting>& t) {
  // (warmup_steps's shape is warmup_shape's: linear unless DeepSpeed's scheduler section or the setting says log)
  t.push_back(integer<&T::warmup_steps>({.name = "warmup_steps", .flag = "--warmup",
                                         .help = "linear warm-up steps (from --warmup-min-lr to --lr)",
                                         .expected = "a whole number from 0 to 2^62"},
                                        0, kCountMax));
  t.push_back(real<&T::warmup_min_lr>({.name = "warmup_min_lr", .flag = "--warmup-min-lr",
                                       .help = "the learning rate the warm-up starts from", .expected = "in [0, lr]"},
                                      0, false));
  t.push_back(choice<&T::warmup_shape>(
      {.name = "warmup_shape", .help = "linear, or log: log(step + 1) / log(warmup_steps) as DeepSpeed's WarmupLR",
       .expected = "linear or log"},
      kWarmupShapes));
  t.push_back(choice<&T::decay>({.name = "decay", .flag = "--lr-decay",
                                 .help = "after the warm-up: none, linear or cosine (to --min-lr at --decay-steps)",
                                 .expected = "none, linear or cosine"},
                                kDecays));
  t.push_back(integer<&T::decay_steps>({.name = "decay_steps", .flag = "--decay-steps",
                                        .help = "the step the decay reaches --min-lr (default: --steps)",
                                        .expected = "a whole number from 0 to 2^62"},
                                       0, kCountMax));
  t.push_back(real<&T::min_lr>({.name = "min_lr", .flag = "--min-lr", .help = "the learning rate the decay ends at",
                                .expected = "in [0, lr]"},
                               0, false));
}

// DeepSpeed's batch sizes (coshard-train's --batch is the global one).
void add_batch_settings(std::vector<Setting>& t) {
  t.push_back(integer<&T::train_batch_size>(
      {.name = "train_batch_size", .deepspeed = "train_batch_size",
       .help = "sequences per optimizer step over all ranks (0: not given)", .expected = "a whole number from 0 to 2^62"},
      0, kCountMax));
  t.push_back(integer<&T::train_micro_batch_size_per_gpu>(
      {.name = "train_micro_batch_size_per_gpu", .deepspeed = "train_micro_batch_size_per_gpu",
       .help = "sequences per micro-batch on each rank (0: not given)", .expected = "a whole number from 0 to 2^62"},
      0, kCountMax));
}

// The optimizers' own: AdamW's moments and epsilon, weight decay, SGD's momentum.
void add_optimizer_settings(std::vector<Setting>& t) {
  t.push_back(real<&T::beta1>({.name = "beta1", .help = "AdamW's first-moment decay", .expected = "in [0, 1)"}, 0, false, 1, true));
  t.push_back(real<&T::beta2>({.name = "beta2", .help = "AdamW's second-moment decay", .expected = "in [0, 1)"}, 0, false, 1, true));
  t.push_back(real<&T::eps>({.name = "eps", .deepspeed = "optimizer.params.eps", .help = "AdamW's epsilon",
                             .expected = "> 0 and finite"},
                            0, true, std::numeric_limits<float>::max()));
  t.push_back(real<&T::weight_decay>({.name = "weight_decay", .flag = "--weight-decay",
                                      .deepspeed = "optimizer.params.weight_decay",
                                      .help = "weight decay (default: the optimizer's own, AdamW 0.01 decoupled, SGD 0)",
                                      .expected = ">= 0"},
                                     0, false));
  t.push_back(boolean<&T::no_decay_for_vectors>(
      {.name = "no_decay_for_vectors", .flag = "--no-decay-vectors",
       .help = "no weight decay on parameters of one dimension (biases, norms' gains), as GPT-2's and Llama's recipes"}));
  t.push_back(real<&T::momentum>({.name = "momentum", .deepspeed = "optimizer.params.momentum", .help = "SGD's momentum",
                                  .expected = "in [0, 1)"},
                                 0, false, 1, true));
  t.push_back(boolean<&T::nesterov>({.name = "nesterov", .deepspeed = "optimizer.params.nesterov", .help = "SGD: Nesterov momentum"}));
}

// The run: its seed, when it gives up, the checkpoints it keeps.
void add_run_settings(std::vector<Setting>& t) {
  t.push_back(integer<&T::seed>({.name = "seed", .flag = "--seed", .help = "seed of the initial weights and of the data",
                                 .expected = "a whole number from 0 to 18446744073709551615"},
                                0, static_cast<long double>(std::numeric_limits<std::uint64_t>::max())));
  t.push_back(integer<&T::max_skipped_steps>(
      {.name = "max_skipped_steps", .flag = "--max-skipped-steps",
       .help = "stop after this many steps in a row skipped for inf/NaN gradients (0: never)",
       .expected = "0 to 2^30 (0: never stop)"},
      0, 1 << 30));
  t.push_back(integer<&T::keep_checkpoints>({.name = "keep_checkpoints", .flag = "--keep-checkpoints",
                                             .help = "keep the newest N checkpoints, remove older ones (0: keep all)",
                                             .expected = "0 to 2^30 (0: keep all)", .per_rank = true},
                                            0, 1 << 30));
}

// LoRA fine-tuning.
void add_lora_settings(std::vector<Setting>& t) {
  t.push_back(integer<&T::lora_rank>({.name = "lora_rank", .flag = "--lora-rank",
                                      .help = "LoRA: low-rank adapters of this rank on the --lora-targets layers, the rest "
                                              "of the model frozen (0: off, full training)",
                                      .expected = "0 to 65536 (0: off)"},
                                     0, 65536));
  t.push_back(real<&T::lora_alpha>({.name = "lora_alpha", .flag = "--lora-alpha",
                                    .help = "LoRA: the adapters' products are scaled by alpha / rank (PEFT's lora_alpha)",
                                    .expected = "> 0"},
                                   0, true, std::numeric_limits<float>::max()));
  t.push_back(real<&T::lora_dropout>({.name = "lora_dropout", .flag = "--lora-dropout",
                                      .help = "LoRA: dropout on the adapters' input", .expected = "0 to below 1"},
                                     0, false, 1, true));
}

// Validation.
void add_validation_settings(std::vector<Setting>& t) {
  t.push_back(integer<&T::eval_every>(
      {.name = "eval_every", .flag = "--eval-every",
       .help = "the validation loss every N steps (0: after the last step only); needs --val-data",
       .expected = "0 to 2^40 (0: only when asked)"},
      0, static_cast<long double>(std::int64_t{1} << 40)));
  t.push_back(integer<&T::eval_batches>({.name = "eval_batches", .flag = "--eval-batches",
                                         .help = "global batches of --val-data each validation loss is the mean over",
                                         .expected = "1 to 2^30"},
                                        1, static_cast<long double>(std::int64_t{1} << 30)));
}

// Timing.
void add_timing_settings(std::vector<Setting>& t) {
  t.push_back(boolean<&T::timing>({.name = "timing", .flag = "--no-timing",
                                   .help = "no device-timestamp timing (exposed_comm_ms becomes null)",
                                   .switch_sets = false}));
  t.push_back(boolean<&T::record_timeline>({.name = "record_timeline", .help = "a timeline of every step (--trace)"}));
}

// Offload: the placements, their budgets and pieces, and the memory check.
void add_offload_settings(std::vector<Setting>& t) {
  for (const bool params : {false, true}) t.push_back(offload_setting(params));
  t.push_back(integer<&T::sub_group_size>(
      {.name = "sub_group_size", .flag = "--sub-group-size", .deepspeed = "zero_optimization.sub_group_size",
       .help = "with --offload-optimizer nvme: stream each unit's master and state in pieces of at most N elements, "
               "so the pinned swap buffers follow N, not the largest unit (0: whole units)",
       .expected = "a whole number from 0 to 2^62"},
      0, kCountMax));
  t.push_back(bytes<&T::host_memory_budget>({.name = "host_memory_budget", .flag = "--host-memory-budget",
                                             .help = "pinned host memory the offload may use (default: exactly what it needs)",
                                             .expected = "a size", .per_rank = true}));
  t.push_back(bytes<&T::device_memory_budget>(
      {.name = "device_memory_budget", .flag = "--device-memory-budget",
       .help = "with --offload-params cpu or --offload-optimizer cpu: device memory for the engine's state; the parameter "
               "shards of as many units as fit stay on the device, the rest in pinned memory, then (optimizer cpu) the "
               "optimizer state of as many units, stepped on the device (default: everything offloaded)",
       .expected = "a size", .per_rank = true}));
  t.push_back(boolean<&T::step_in_backward>(
      {.name = "step_in_backward", .flag = "--step-in-backward",
       .help = "with --offload-optimizer cpu or nvme: step each unit on the CPU while backward goes on (needs --clip 0)"}));
  t.push_back(boolean<&T::swap_gradients>(
      {.name = "swap_gradients", .flag = "--swap-gradients",
       .help = "with --offload-optimizer nvme: write each gradient shard to its swap file as backward reduces it, "
               "instead of keeping it in pinned memory until the step (gradient clipping and loss scaling as without)"}));
  t.push_back(boolean<&T::check_memory>({.name = "check_memory", .flag = "--skip-memory-check",
                                         .help = "train even when the memory estimate says this machine cannot hold the run",
                                         .switch_sets = false, .per_rank = true}));
}

// In --help's order, which users see: a new topic goes where it belongs, not at the end.
std::vector<Setting> make_table() {
  std::vector<Setting> t;
  add_parallelism_settings(t);
  add_compute_settings(t);
  add_step_settings(t);
  add_schedule_settings(t);
  add_batch_settings(t);
  add_optimizer_settings(t);
  add_run_settings(t);
  add_lora_settings(t);
  add_validation_settings(t);
  add_timing_settings(t);
  add_offload_settings(t);
  return t;
}

}  // namespace

std::span<const Setting> settings() noexcept {
  static const std::vector<Setting> table = make_table();
  return table;
}

}  // namespace coshard::trainer
