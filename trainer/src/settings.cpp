// The table of the trainer's settings (settings.hpp): one entry each, in --help's order.
#include "coshard/trainer/settings.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <limits>
#include <optional>
#include <sstream>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "coshard/async/json_limits.hpp"
#include "coshard/trainer/config.hpp"

namespace coshard::trainer {

namespace {

template <class T>
struct Unwrapped {
  using type = T;
  static constexpr bool optional = false;
};
template <class T>
struct Unwrapped<std::optional<T>> {
  using type = T;
  static constexpr bool optional = true;
};
template <auto Member>
using Field = std::remove_cvref_t<decltype(std::declval<TrainerConfig&>().*Member)>;

// Numbers as written back: integers in full, reals as the shortest text that reads back the same.
template <class T>
std::string format_value(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_floating_point_v<T>) {
    char text[64];  // the shortest text that reads back as the same value
    const auto end = std::to_chars(text, text + sizeof text, v).ptr;
    return std::string(text, end);
  } else {
    std::ostringstream out;
    out << v;
    return out.str();
  }
}

template <auto Member>
std::string get_value(const Setting&, const TrainerConfig& c) {
  const auto& v = c.*Member;
  if constexpr (Unwrapped<Field<Member>>::optional) return v ? format_value(*v) : std::string();
  else return format_value(v);
}

Result<void> in_range(const Setting& s, long double v, std::string_view label, const std::string& shown) {
  const bool above = s.min_open ? v > s.min : v >= s.min;
  const bool below = s.max_open ? v < s.max : v <= s.max;
  if (above && below) return {};  // (NaN is neither)
  return fail(ErrorCode::invalid_argument, label, "=", shown, ": expected ", s.expected);
}

template <auto Member>
Result<void> check_number(const Setting& s, const TrainerConfig& c, std::string_view label) {
  const auto& v = c.*Member;
  if constexpr (Unwrapped<Field<Member>>::optional) {
    if (!v) return {};
    return in_range(s, static_cast<long double>(*v), label, format_value(*v));
  } else {
    return in_range(s, static_cast<long double>(v), label, format_value(v));
  }
}

template <auto Member>
Result<void> parse_number(const Setting& s, TrainerConfig& c, std::string_view text) {
  using T = typename Unwrapped<Field<Member>>::type;
  const char* const end = text.data() + text.size();
  if constexpr (std::is_integral_v<T>) {
    T v{};
    const auto [stop, ec] = std::from_chars(text.data(), end, v);
    if (text.empty() || ec != std::errc{} || stop != end) return fail(ErrorCode::invalid_argument, "expected ", s.expected);
    c.*Member = v;
  } else {
    double v = 0;
    const auto [stop, ec] = std::from_chars(text.data(), end, v);
    if (text.empty() || ec != std::errc{} || stop != end)
      return fail(ErrorCode::invalid_argument, "expected a number (", s.expected, ")");
    // Named as written, not as converted: 1e39 is no float (it would read as inf), and 1e-50 one
    // that rounds to 0.
    if constexpr (std::is_same_v<T, float>) {
      if (std::isfinite(v) && std::abs(v) > static_cast<double>(std::numeric_limits<float>::max()))
        return fail(ErrorCode::invalid_argument, "expected ", s.expected, ", within a float's range (at most 3.4e38)");
      if (v != 0 && static_cast<float>(v) == 0.0f)
        return fail(ErrorCode::invalid_argument, "expected ", s.expected, "; it rounds to 0 as a float (below 1.4e-45)");
    }
    c.*Member = static_cast<T>(v);
  }
  return {};
}

template <auto Member>
Result<void> parse_bytes(const Setting&, TrainerConfig& c, std::string_view text) {
  COSHARD_TRY_ASSIGN(c.*Member, parse_size(text));
  return {};
}

template <auto Member>
Result<void> parse_boolean(const Setting&, TrainerConfig& c, std::string_view text) {
  if (text == "true" || text == "1") c.*Member = true;
  else if (text == "false" || text == "0") c.*Member = false;
  else return fail(ErrorCode::invalid_argument, "expected true or false");
  return {};
}

Result<void> no_check(const Setting&, const TrainerConfig&, std::string_view) { return {}; }

// An enum whose values are 0, 1, ... in the order of `choices`.
template <auto Member>
std::string get_choice(const Setting& s, const TrainerConfig& c) {
  const auto i = static_cast<std::size_t>(c.*Member);
  return i < s.choices.size() ? std::string(s.choices[i]) : std::to_string(i);
}
template <auto Member>
Result<void> parse_choice(const Setting& s, TrainerConfig& c, std::string_view text) {
  const auto at = std::find(s.choices.begin(), s.choices.end(), text);
  if (at == s.choices.end()) return fail(ErrorCode::invalid_argument, "expected ", s.expected);
  c.*Member = static_cast<Field<Member>>(at - s.choices.begin());
  return {};
}
template <auto Member>
Result<void> check_choice(const Setting& s, const TrainerConfig& c, std::string_view label) {
  if (static_cast<std::size_t>(c.*Member) < s.choices.size()) return {};
  return fail(ErrorCode::invalid_argument, label, "=", get_choice<Member>(s, c), ": expected ", s.expected);
}

// The helpers fill in the kind, the accessors and the range of an entry.
template <auto Member>
Setting ranged(Setting s, SettingKind kind, long double min, bool min_open, long double max, bool max_open) {
  s.kind = kind;
  s.min = min;
  s.min_open = min_open;
  s.max = max;
  s.max_open = max_open;
  s.get = get_value<Member>;
  s.parse = parse_number<Member>;
  s.check = check_number<Member>;
  return s;
}
template <auto Member>
Setting integer(Setting s, long double min, long double max) {
  return ranged<Member>(s, SettingKind::integer, min, false, max, false);
}
// A size of at most 2^62 bytes, the range a JSON config reads too (so --print-config's output of
// any value the command line takes reads back).
template <auto Member>
Result<void> check_bytes(const Setting& s, const TrainerConfig& c, std::string_view label) {
  constexpr std::size_t kMax = std::size_t{1} << 62;
  const auto& v = c.*Member;
  if constexpr (Unwrapped<Field<Member>>::optional) {
    if (!v || *v <= kMax) return {};
    return fail(ErrorCode::invalid_argument, label, "=", *v, ": expected ", s.expected, " of at most 2^62 bytes");
  } else {
    if (v <= kMax) return {};
    return fail(ErrorCode::invalid_argument, label, "=", v, ": expected ", s.expected, " of at most 2^62 bytes");
  }
}
template <auto Member>
Setting bytes(Setting s) {
  s.kind = SettingKind::bytes;
  s.min = 0;
  s.max = static_cast<long double>(std::size_t{1} << 62);
  s.get = get_value<Member>;
  s.parse = parse_bytes<Member>;
  s.check = check_bytes<Member>;
  return s;
}
// (no upper bound by default: an infinite max_grad_norm or weight_decay is the user's to try)
template <auto Member>
Setting real(Setting s, long double min, bool min_open, long double max = std::numeric_limits<long double>::infinity(),
             bool max_open = false) {
  return ranged<Member>(s, SettingKind::real, min, min_open, max, max_open);
}
template <auto Member>
Setting boolean(Setting s) {
  s.kind = SettingKind::boolean;
  s.get = get_value<Member>;
  s.parse = parse_boolean<Member>;
  s.check = no_check;
  return s;
}
template <auto Member>
Setting choice(Setting s, std::span<const std::string_view> choices) {
  s.kind = SettingKind::choice;
  s.choices = choices;
  s.get = get_choice<Member>;
  s.parse = parse_choice<Member>;
  s.check = check_choice<Member>;
  return s;
}

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

std::vector<Setting> make_table() {
  std::vector<Setting> t;
  // ZeRO
  t.push_back(integer<&T::zero_stage>(
      {.name = "zero_stage", .flag = "--zero-stage", .deepspeed = "zero_optimization.stage",
       .help = "0 (plain data parallelism: everything whole on every rank, gradients all-reduced), 1, 2 or 3 (ZeRO: "
               "optimizer state, + gradients, + parameters sharded)",
       .expected = "0, 1, 2 or 3"},
      0, 3));
  t.push_back(choice<&T::fetch_mode>({.name = "fetch_mode", .flag = "--fetch-mode", .help = "stage-3 fetch collective",
                                      .expected = "all_gather or all_reduce"},
                                     kFetchModes));
  {
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
    t.push_back(s);
  }
  t.push_back(boolean<&T::adaptive_prefetch>(
      {.name = "adaptive_prefetch",
       .help = "prefetch depth from measured gather and compute times (prefetch_bucket_bytes, when set, caps it)"}));
  {
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
    t.push_back(s);
  }
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
  {
    Setting s = integer<&T::shard_group_size>(
        {.name = "shard_group_size", .flag = "--shard-group-size",
         .help = "hybrid sharding (HSDP, MiCS): shard each unit over groups of N consecutive ranks and replicate "
                 "across the groups; local: the ranks of one node; 0: the whole world (full sharding)",
         .expected = "a whole number that divides the world size, 0 (the whole world) or local"},
        0, 1 << 24);
    s.get = [](const Setting& self, const TrainerConfig& c) {
      return c.shard_group_local ? std::string("local") : get_value<&T::shard_group_size>(self, c);
    };
    s.parse = [](const Setting& self, TrainerConfig& c, std::string_view text) -> Result<void> {
      if (text == "local") {  // the launcher's ranks per node, known when the engine is made
        c.shard_group_local = true;
        c.shard_group_size = 0;
        return {};
      }
      COSHARD_TRY(parse_number<&T::shard_group_size>(self, c, text));  // (a negative one is refused by the range)
      c.shard_group_local = false;
      return {};
    };
    t.push_back(s);
  }
  t.push_back(integer<&T::tensor_parallel_size>(
      {.name = "tensor_parallel_size", .flag = "--tensor-parallel", .deepspeed = "tensor_parallel.autotp_size",
       .help = "split the model over N consecutive ranks (Megatron's tensor parallelism: heads, MLP and vocabulary), "
               "ZeRO over each of the world / N data groups",
       .expected = "a whole number from 1 that divides the world size and the model's heads, key/value heads, MLP "
                   "width and vocabulary"},
      1, 1 << 16));
  // Precision
  {
    Setting s{.name = "dtype", .flag = "--dtype",
              .help = "compute dtype (bf16/f16 on the CPU compute in f32 on copies: slower than f32, for trying a "
                      "setup); f16 turns on dynamic loss scaling",
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
    t.push_back(s);
  }
  t.push_back(choice<&T::loss_scaling>({.name = "loss_scaling",
                                        .help = "loss scaling: none, fixed (initial_loss_scale) or dynamic (f16)",
                                        .expected = "none, fixed or dynamic"},
                                       kLossScaling));
  t.push_back(real<&T::initial_loss_scale>(
      {.name = "initial_loss_scale", .help = "the loss scale a run starts from", .expected = "> 0"}, 0, true));
  {
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
    t.push_back(s);
  }
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
  // The step
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
  {
    Setting s = integer<&T::warmup_steps>({.name = "warmup_steps", .flag = "--warmup",
                                           .help = "linear warm-up steps (from --warmup-min-lr to --lr)",
                                           .expected = "a whole number from 0 to 2^62"},
                                          0, kCountMax);
    t.push_back(s);  // (its shape is warmup_shape's: linear unless DeepSpeed's scheduler section or the setting says log)
  }
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
  t.push_back(integer<&T::train_batch_size>(
      {.name = "train_batch_size", .deepspeed = "train_batch_size",
       .help = "sequences per optimizer step over all ranks (0: not given)", .expected = "a whole number from 0 to 2^62"},
      0, kCountMax));
  t.push_back(integer<&T::train_micro_batch_size_per_gpu>(
      {.name = "train_micro_batch_size_per_gpu", .deepspeed = "train_micro_batch_size_per_gpu",
       .help = "sequences per micro-batch on each rank (0: not given)", .expected = "a whole number from 0 to 2^62"},
      0, kCountMax));
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
  // LoRA fine-tuning
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
  // Validation
  t.push_back(integer<&T::eval_every>(
      {.name = "eval_every", .flag = "--eval-every",
       .help = "the validation loss every N steps (0: after the last step only); needs --val-data",
       .expected = "0 to 2^40 (0: only when asked)"},
      0, static_cast<long double>(std::int64_t{1} << 40)));
  t.push_back(integer<&T::eval_batches>({.name = "eval_batches", .flag = "--eval-batches",
                                         .help = "global batches of --val-data each validation loss is the mean over",
                                         .expected = "1 to 2^30"},
                                        1, static_cast<long double>(std::int64_t{1} << 30)));
  // Timing
  t.push_back(boolean<&T::timing>({.name = "timing", .flag = "--no-timing",
                                   .help = "no device-timestamp timing (exposed_comm_ms becomes null)",
                                   .switch_sets = false}));
  t.push_back(boolean<&T::record_timeline>({.name = "record_timeline", .help = "a timeline of every step (--trace)"}));
  // Offload
  for (const bool params : {false, true}) {
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
    t.push_back(s);
  }
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
  return t;
}

}  // namespace

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

std::span<const Setting> settings() noexcept {
  static const std::vector<Setting> table = make_table();
  return table;
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
