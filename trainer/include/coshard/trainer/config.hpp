// TrainerConfig: every knob of a training run as plain data, validated in one place, and read
// from a DeepSpeed JSON config so DeepSpeed users can bring theirs.
//
// Sizes are bytes here. DeepSpeed counts most of its ZeRO sizes in parameter elements
// (stage3_prefetch_bucket_size, stage3_max_live_parameters, ...): from_json converts them with
// the element size of the compute dtype the same config selects (fp16/bf16 sections; fp32
// otherwise), and keeps stage3_max_reuse_distance in elements (the engine supports both).
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/zero/engine.hpp"
#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/lora.hpp"
#include "coshard/modules/optimizer.hpp"

namespace coshard::trainer {

// Where offloaded state lives: the engine's own enum (none, cpu, nvme) and options (the folder
// and buffers of nvme). Offloaded memory is always pinned (every host<->device copy needs it, and
// the budget is host_memory_budget), and a swap buffer is the size of the largest sub-group
// (sub_group_size): DeepSpeed's pin_memory and buffer_size are read and reported as notes.
using OffloadDevice = zero::OffloadTarget;
using OffloadOptions = zero::OffloadOptions;
using zero::to_string;

enum class OptimizerKind : std::uint8_t { adamw, sgd };

// The trainer's own cross-entropy against the model's output layer: chunked (a
// FusedCrossEntropyLoss attached to the layer: the logits never held whole), whole (a
// CrossEntropyLoss over the whole logits), or automatic: chunked on CUDA where the model's output
// layer takes it, else whole (the CPU keeps the same bits as before).
enum class CrossEntropyKind : std::uint8_t { automatic, chunked, whole };

// The learning rate after warm-up: constant, or decaying to min_lr by decay_steps.
enum class LrDecay : std::uint8_t { none, linear, cosine };
enum class WarmupShape : std::uint8_t { linear, log };  // log: DeepSpeed's default warm-up
std::string_view to_string(LrDecay d) noexcept;
std::string_view to_string(OptimizerKind k) noexcept;

// The engine's options (zero::EngineOptions: the stage, the fetch and prefetch budgets, the
// compute dtype, offload, timing, ...) with the trainer's own beside them. Each scalar setting is
// declared once, in settings.hpp's table, which the command line, the JSON config, the builder
// and validate() are made from.
struct TrainerConfig : zero::EngineOptions {
  // The trainer's defaults where they differ from a bare engine's: a 1 GiB budget of gathered
  // parameters, 64 MiB gathered ahead of use, and device-timestamp timing on.
  TrainerConfig() noexcept {
    max_live_bytes = 1ull << 30;
    prefetch_bucket_bytes = 64ull << 20;
    timing = true;
  }

  // The budget follows the model: where max_live_bytes cannot hold the largest fetch unit (an
  // 8B's 128,256-wide head alone is 2 GiB in f32), the engine gets twice that unit instead (one
  // gathered, one prefetched), so a model's defaults always run. Setting max_live_bytes (the
  // builder, --max-live, DeepSpeed's stage3_max_live_parameters) clears it: that budget is then
  // exact, and refused if too small.
  bool max_live_follows_model = true;
  // shard_group_size "local": the ranks of one node (the launcher's local size; all of them when
  // the ranks are threads of one process), resolved by shard_group_size_for.
  bool shard_group_local = false;
  // secondary_partition_ranks "local": the same, for the secondary partition (ZeRO++'s hpZ).
  bool secondary_partition_local = false;
  // Tensor parallelism beside ZeRO: the model split over this many consecutive ranks (a data x
  // tensor mesh, collectives/mesh.hpp; the trainer is then built over the mesh, and ZeRO shards
  // over each data group). 1: none.
  int tensor_parallel_size = 1;
  // Expert parallelism: a mixture of experts' experts partitioned over this many data ranks (at a
  // stride: collectives::MeshShape::expert; the model is built with
  // modules::make_llama_expert_parallel over the mesh's expert group). 1: none.
  int expert_parallel_size = 1;

  // Precision: parameters, activations and gradients in `dtype` (EngineOptions; fp32 masters in
  // the optimizer); gradients are reduced in `reduce_dtype`, which must be `dtype` for now.
  modules::DataType reduce_dtype = modules::DataType::f32;
  modules::LossScaling loss_scaling = modules::LossScaling::none;  // dynamic is the usual for f16
  float initial_loss_scale = 65536.0f;

  // Activation checkpointing of the model's blocks (modules/checkpointing.hpp): none, every
  // block, or every N-th; applied to the model when the trainer is built. DeepSpeed's
  // activation_checkpointing section turns it on.
  modules::ActivationCheckpointing activation_checkpointing;
  // How causal attention runs on CUDA (modules/module.hpp): the fused kernels where they serve
  // the dtype and head size, or always materialized (to compare, or to rule the kernels out).
  modules::AttentionKernels attention = modules::AttentionKernels::fused;
  // The loss (CrossEntropyKind), and the most MiB one chunk of logits takes when chunked. Not
  // used with a loss of the builder's, nor with tensor parallelism (its own vocabulary-parallel
  // loss).
  CrossEntropyKind cross_entropy = CrossEntropyKind::automatic;
  std::int64_t cross_entropy_chunk_mib = 256;
  // The most bytes a chunk of logits takes where the trainer's own loss is chunked on `device`,
  // else 0 (whole): chunked, or automatic on CUDA, without tensor parallelism. (Where the output
  // layer refuses the fused loss, automatic falls back to whole: LoRA adapters on it.)
  std::int64_t chunked_cross_entropy_bytes(async::Device device) const noexcept {
    if (tensor_parallel_size > 1 || cross_entropy == CrossEntropyKind::whole) return 0;
    if (cross_entropy == CrossEntropyKind::automatic && device.is_cpu()) return 0;
    return cross_entropy_chunk_mib << 20;
  }
  // The step.
  int gradient_accumulation_steps = 1;  // micro-batches per step on each rank
  float max_grad_norm = 1.0f;           // 0: no clipping
  OptimizerKind optimizer = OptimizerKind::adamw;
  float lr = 3e-3f;
  // The schedule (lr_at): warm-up from warmup_min_lr to lr over warmup_steps (linearly, or as
  // log(step + 1) / log(warmup_steps) like DeepSpeed's WarmupLR default), then lr, or a linear
  // or cosine decay that reaches min_lr at step decay_steps (counted from the start, warm-up
  // included) and stays there.
  std::int64_t warmup_steps = 0;
  float warmup_min_lr = 0.0f;
  WarmupShape warmup_shape = WarmupShape::linear;
  LrDecay decay = LrDecay::none;
  std::int64_t decay_steps = 0;
  float min_lr = 0.0f;
  // DeepSpeed's batch sizes, when a config gives them (0: not given): checked against each
  // other and the world size by check_batch.
  std::int64_t train_batch_size = 0;
  std::int64_t train_micro_batch_size_per_gpu = 0;
  // The optimizers' own defaults (modules::AdamWOptions, SgdOptions): one set everywhere, the
  // builder and coshard-train --help included.
  float beta1 = modules::AdamWOptions{}.beta1, beta2 = modules::AdamWOptions{}.beta2, eps = modules::AdamWOptions{}.eps;
  // Unset: the optimizer's default (AdamW: 0.01, decoupled; SGD: 0, L2).
  std::optional<float> weight_decay;
  // Parameter groups: no weight decay on parameters of one dimension (biases, norms' gains: the
  // GPT-2 and Llama recipes), then the rules of `parameter_groups` (the first match wins; see
  // modules::ParameterGroup). Off and empty: one setting for every parameter (the default).
  bool no_decay_for_vectors = false;
  std::vector<modules::ParameterGroup> parameter_groups;
  // Parameters that do not train (fine-tuning): globs over full names, such as
  // "model.embed_tokens.*" or "blocks.0.*", frozen when the trainer is built. Each must match.
  std::vector<std::string> freeze;
  // LoRA fine-tuning (modules/lora.hpp): with lora_rank > 0, low-rank adapters on the linear layers
  // lora_targets names (globs over module paths; with a Llama, Hugging Face's projection names
  // too; none given: PEFT's defaults, q_proj and v_proj for a Llama, every attention's qkv
  // otherwise), the rest of the model frozen; scaled by lora_alpha / lora_rank, with dropout
  // lora_dropout on their input.
  std::int64_t lora_rank = 0;
  float lora_alpha = 8.0f;
  float lora_dropout = 0.0f;
  std::vector<std::string> lora_targets;
  // The adapters' options, or none without LoRA (targets left empty: the model's defaults).
  std::optional<modules::LoraOptions> lora() const;
  float momentum = modules::SgdOptions{}.momentum;  // sgd
  bool nesterov = modules::SgdOptions{}.nesterov;   // sgd
  std::uint64_t seed = 1;               // initial weights
  // Steps skipped in a row for inf/NaN gradients before the run stops with an error (a learning
  // rate that blew up, non-finite data); 0: never stop. Dynamic f16 loss scaling skips a few
  // steps in a row while it finds its scale (at most log2(initial scale) = 16 from 65536).
  int max_skipped_steps = 32;
  // Published checkpoints kept in the checkpoint folder: after each publish the oldest beyond
  // this many are removed (never the one `latest` names); 0 keeps them all.
  int keep_checkpoints = 0;

  // Held-out validation (TrainerBuilder::validation gives the data): every eval_every steps
  // (0: only when asked, Trainer::validation_loss) the mean loss over the same eval_batches
  // global batches of the validation data, each of the training step's shape, split over the
  // ranks and into gradient_accumulation_steps forward passes like a step.
  std::int64_t eval_every = 0;
  std::int64_t eval_batches = 4;

  // Rank 0 writes TensorBoard event files here (tensorboard.hpp), one event per step; empty:
  // none. DeepSpeed's "tensorboard" section sets it to output_path/job_name.
  std::filesystem::path tensorboard_dir;

  // What defines this run beyond the model and these settings (the data, the model's shape where
  // the parameters do not show it, ...), by name: saved in every checkpoint and compared on
  // resume, each difference refused with both values named. The seed is always part of it.
  // Values that may change on resume (lr, batch, world size, offload, ...) do not belong here.
  std::map<std::string, std::string> run_identity;
  // More that every rank of the run must agree on, by name (coshard-train: the batch, the steps,
  // when it checkpoints and exports), checked with the model and the settings above when the
  // trainer is built: ranks that differ fail there, every one naming the difference. Not saved
  // in checkpoints (unlike run_identity).
  std::map<std::string, std::string> ranks_agree_on;
  // The run identity as checkpoints record it: run_identity plus the seed.
  std::map<std::string, std::string> identity() const;

  // Compute (and reduce) in `compute`; f16 turns on dynamic loss scaling unless scaling is set.
  void set_compute_dtype(modules::DataType compute) noexcept;

  // Every value and combination checked; the error names the first bad one and what is allowed.
  Result<void> validate() const;
  // The engine's view of these settings: the EngineOptions this config is.
  const zero::EngineOptions& engine_options() const noexcept { return *this; }
  // engine_options() for this model at world_size ranks: max_live_bytes raised to twice the
  // largest fetch unit where it cannot hold that unit and max_live_follows_model says so (the
  // units planned as the engine will plan them); a "local" shard group size made the ranks per node.
  Result<zero::EngineOptions> engine_options_for(modules::Module& model, int world_size) const;
  // The shard group size over `data_ranks` data ranks: shard_group_size, or for "local" the
  // ranks of one node (under a launcher its local size over the tensor size, at least 1; ranks as
  // threads share one machine: every data rank). What engine_options_for gives the engine, and
  // what a mesh of this config is made with.
  Result<int> shard_group_size_for(int data_ranks) const;
  // The same for the secondary partition: secondary_partition_ranks, or for "local" the ranks of
  // one node by that rule.
  Result<int> secondary_partition_ranks_for(int data_ranks) const;
  // The rules that need the world's size (`world` ranks, tensor parallelism's included), checked
  // before a model is made (--print-config's output is one the run takes): the secondary partition
  // divides the data ranks.
  Result<void> validate_for_world(int world) const;
  // The optimizer's clipping and loss scaling, as the trainer builds it.
  modules::StepControlOptions step_control() const;
  // The learning rate of step `step` (0-based) under the schedule.
  float lr_at(std::int64_t step) const noexcept;
  // The global batch (sequences per optimizer step) for `world` ranks, as DeepSpeed checks it:
  // train_batch_size = micro batch x gradient_accumulation_steps x world, each given value
  // compared with the others and with `global_batch` (0: not given); the error names them all.
  Result<std::int64_t> check_batch(int world, std::int64_t global_batch) const;

  // A DeepSpeed config: the whole file ({"zero_optimization": {...}, "fp16": ..., "bf16": ...,
  // "optimizer": ..., "gradient_clipping": ..., "gradient_accumulation_steps": ...}) or just its
  // zero_optimization object. Starts from `base` (the command line's values, say). Unknown and
  // unsupported keys are all listed in one error; keys accepted without effect (overlap_comm:
  // always on, ...) are listed in `notes`.
  static Result<TrainerConfig> from_json(std::string_view json, const TrainerConfig& base,
                                         std::vector<std::string>* notes = nullptr);
  static Result<TrainerConfig> from_json_file(const std::filesystem::path& path, const TrainerConfig& base,
                                              std::vector<std::string>* notes = nullptr);
};

// "64MiB", "1.5GB", "4096", "1e8": bytes. Binary (KiB, MiB, GiB, TiB) and decimal (KB, MB, GB,
// TB) suffixes, case-insensitive, optional "B". The error names the text.
Result<std::size_t> parse_size(std::string_view text);
// "none", "cpu", "nvme:/path" (or "nvme" with a path given elsewhere).
Result<OffloadOptions> parse_offload(std::string_view text);

// The config's LoRA adapters on `model` (the model's default targets when it names none), or
// nothing without LoRA: what was made, for the log and the exports. A model split for tensor
// parallelism takes its tensor group (its adapters are split with their layers).
Result<std::vector<modules::LoraAdapterInfo>> apply_lora(const TrainerConfig& c, modules::Module& model,
                                                         collectives::Communicator* tensor_group = nullptr);

}  // namespace coshard::trainer
