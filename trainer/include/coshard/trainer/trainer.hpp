// The Trainer: one rank's training loop over the ZeRO engine, configured through TrainerBuilder.
//
//   auto trainer = TrainerBuilder{}.communicator(comm).zero_stage(3).max_live_bytes(1ull << 30)
//                      .build(model);                       // Result<Trainer>
//   auto stats = co_await trainer->step(batch.rank_rows(rank, world));
//
// Each rank (a thread with the Local backend, a process with NCCL) builds its own Trainer over
// the same model definition; the trainer owns its compute stream, allocator, optimizer and
// engine, on the communicator's device. The model must outlive the trainer.
//
// Checkpoints are the engine's (coshard/zero/checkpoint.hpp): sharded, written behind training,
// published atomically, loadable at any world size; the trainer adds the run's identity
// (TrainerConfig::identity) and keep_checkpoints.
#pragma once

#include <charconv>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/mesh.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/trainer/config.hpp"
#include "coshard/trainer/data.hpp"
#include "coshard/trainer/sampling.hpp"

namespace coshard::trainer {

// A step as the engine saw it (zero::EngineStepStats: loss, bytes gathered, reduced and
// swapped, peaks, exposed communication, the timeline, the optimizer's grad norm, loss scale and
// skip) and what the trainer adds. The metrics file and TensorBoard take their values from one
// list (step_metrics.hpp), not from copies.
struct StepStats : zero::EngineStepStats {
  std::int64_t step = 0;               // 1-based: the number of optimizer steps taken, this one included
  double step_ms = 0;                  // host wall time from the call to the loss being known
  std::int64_t tokens = 0;             // tokens in the global batch (a modules::Batch of float inputs: its rows)
  double tokens_per_s = 0;
  float lr = 0;
  std::uint64_t peak_memory_bytes = 0;  // the trainer's device allocator: most bytes in use at once so far
  std::uint64_t blocking_waits = 0;     // the runtime's counter, process-wide, since the engine was made
  // The validation loss after this step (TrainerConfig::eval_every): absent on other steps.
  std::optional<double> val_loss;
  // A mixture of experts' (absent, empty for a dense model): the load-balancing loss (without its
  // weight), the mean over ranks and micro-batches; per MoE layer, the experts any rank routed a
  // token to in the step, and the largest expert's share of the step's choices.
  std::optional<double> aux_loss;
  std::vector<std::string> moe_layers;  // each MoE layer's block ("h2"), the order of the lists
  std::vector<std::int64_t> experts_used;
  std::vector<double> largest_expert_share;
};

// One JSON object (one line, no newline) with the keys of StepStats (not the timeline).
std::string to_json_line(const StepStats& s);

class Trainer {
 public:
  Trainer(Trainer&&) noexcept;
  Trainer& operator=(Trainer&&) noexcept;
  ~Trainer();

  // One optimizer step on this rank's rows of the global batch (split into
  // gradient_accumulation_steps micro-batches). Every rank calls it with its own rows.
  async::Task<Result<StepStats>> step(const HostBatch& rows);
  // The same for a batch of any model and loss already on the trainer's device: this rank's
  // rows (first dimension) of inputs and targets, split along it into the micro-batches.
  async::Task<Result<StepStats>> step(const modules::Batch& rows);
  // The mean loss over ranks of a forward pass (no update).
  async::Task<Result<double>> evaluate(const HostBatch& rows);
  async::Task<Result<double>> evaluate(const modules::Batch& rows);
  // The validation loss: the mean over config().eval_batches global batches of the builder's
  // validation data (batches 0, 1, ... of it: the same ones every time), each `global_rows`
  // sequences of `seq` tokens, split over the ranks and into gradient_accumulation_steps
  // forward passes; no gradient, no optimizer state touched, the same at any world size and
  // stage. Every rank calls it. step(HostBatch) calls it every eval_every steps by itself.
  async::Task<Result<double>> validation_loss(std::int64_t global_rows, std::int64_t seq);
  bool has_validation() const noexcept;
  // Continues `prompt` (token ids) by options.tokens tokens sampled from the model (sampling.hpp:
  // greedy, or temperature and top-k, seeded), with a key/value cache per attention layer: the
  // prompt in one forward, then one forward over each new token alone, each an inference pass
  // (no gradient, no optimizer state touched; at stage 3 the units are gathered for it). Every
  // rank calls it with the same prompt and options, between steps; every rank gets rank 0's
  // tokens. A GPT's learned positions bound prompt + tokens by its max_seq (named).
  async::Task<Result<std::vector<std::int32_t>>> generate(std::span<const std::int32_t> prompt,
                                                          const SampleOptions& options);
  // The next step(HostBatch) takes the validation loss too, whatever eval_every says (the last
  // step of a run, say); every rank asks alike.
  void request_validation() noexcept;

  // Sharded checkpoints under `dir` (every rank the same dir, at the same step): Engine's
  // save_checkpoint, finish_checkpoint and load_checkpoint with this run's identity.
  async::Task<Result<void>> save_checkpoint(const std::filesystem::path& dir);
  // Finishes a pending save: waits for the files, publishes, and returns once it is visible.
  async::Task<Result<void>> finish_checkpoint();
  // Loads `dir/latest` (or `dir` itself when it is one checkpoint folder). Every check (manifest,
  // sizes, CRCs, units, dtype, optimizer) passes on every rank before any state changes.
  async::Task<Result<void>> load_checkpoint(const std::filesystem::path& dir);
  // The whole model, consolidated by all-gather, written by rank 0 as safetensors (parameter
  // names as in the model). Every rank calls it.
  async::Task<Result<void>> export_safetensors(const std::filesystem::path& path);
  // Initial weights from a safetensors file with every parameter (any float dtype; converted).
  async::Task<Result<void>> load_safetensors(const std::filesystem::path& path);

  // Timeline spans count from this timed event (Stream::record_timed on the trainer's device);
  // ranks that share a clock (CPU) can share one so their timelines line up.
  Result<void> set_timeline_epoch(async::Event epoch);

  std::int64_t steps_done() const noexcept;
  const TrainerConfig& config() const noexcept;
  // This rank in its data group, and the group's size (the world without a mesh).
  int rank() const noexcept;
  int world_size() const noexcept;
  // This rank in the whole world (a mesh's, else rank()): 0 is the one that reports.
  int world_rank() const noexcept;
  zero::Engine& engine() noexcept;
  modules::Context& context() noexcept;
  // The loss each step runs (the builder's, or the trainer's own: config().cross_entropy), and
  // whether it is the trainer's own cross-entropy fused with the output layer (chunked).
  modules::Loss& loss() noexcept;
  bool cross_entropy_chunked() const noexcept;

  struct Impl;

 private:
  friend class TrainerBuilder;
  explicit Trainer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

class TrainerBuilder {
 public:
  TrainerBuilder() = default;
  explicit TrainerBuilder(TrainerConfig config) : c_(std::move(config)) {}

  TrainerBuilder& communicator(collectives::Communicator& comm) {
    comm_ = &comm;
    mesh_ = nullptr;
    return *this;
  }
  // A data x tensor mesh instead (collectives/mesh.hpp): the model given to build() is this
  // rank's part of a tensor-parallel model (modules::make_llama with mesh.tensor()), ZeRO shards
  // over the rank's data group, and the default loss is a VocabParallelCrossEntropyLoss over the
  // tensor group. It sets the config's tensor_parallel_size and expert_parallel_size (a model made
  // with modules::make_llama_expert_parallel over mesh.expert(); a config set after it must agree);
  // rank() and world_size() are then the data group's. The mesh must outlive the trainer.
  TrainerBuilder& mesh(const collectives::Mesh& mesh) {
    mesh_ = &mesh;
    comm_ = &mesh.data();
    c_.tensor_parallel_size = mesh.tensor_size();
    c_.expert_parallel_size = mesh.expert_size();
    return *this;
  }
  // The loss of every step (default: a CrossEntropyLoss of the trainer's own); it must outlive
  // the trainer. modules::MeanSquaredErrorLoss, or a Loss of your own.
  TrainerBuilder& loss(modules::Loss& loss) { loss_ = &loss; return *this; }
  TrainerBuilder& config(TrainerConfig c) { c_ = std::move(c); return *this; }
  // Any setting of the table (settings.hpp) by name, in its own form: set("zero_stage", 2),
  // set("max_live_bytes", "512MiB"), set("prefetch_bucket_bytes", "auto"), set("lr", 3e-4). A
  // bad name or value is kept and returned by build(), naming it (the first one given).
  TrainerBuilder& set(std::string_view name, std::string_view value);
  TrainerBuilder& set(std::string_view name, const char* value) { return set(name, std::string_view(value)); }
  template <class Value>
    requires std::is_arithmetic_v<Value>
  TrainerBuilder& set(std::string_view name, Value value) {
    if constexpr (std::is_same_v<Value, bool>) {
      return set(name, std::string_view(value ? "true" : "false"));
    } else {
      char text[64];
      const auto end = std::to_chars(text, text + sizeof text, value).ptr;
      return set(name, std::string_view(text, static_cast<std::size_t>(end - text)));
    }
  }
  TrainerBuilder& zero_stage(int v) { c_.zero_stage = v; return *this; }
  TrainerBuilder& fetch_mode(zero::FetchMode v) { c_.fetch_mode = v; return *this; }
  TrainerBuilder& quantize_weights(zero::Quantization v) { c_.quantize_weights = v; return *this; }
  TrainerBuilder& quantize_frozen_weights(zero::Quantization v) { c_.quantize_frozen_weights = v; return *this; }
  TrainerBuilder& quantize_weights_block(std::int64_t v) { c_.quantize_weights_block = v; return *this; }
  TrainerBuilder& quantize_gradients(zero::Quantization v) { c_.quantize_gradients = v; return *this; }
  TrainerBuilder& quantize_gradients_block(std::int64_t v) { c_.quantize_gradients_block = v; return *this; }
  // ZeRO++'s hpZ (EngineOptions::secondary_partition_ranks): the step's later gathers within groups
  // of `ranks` consecutive ranks; set("secondary_partition_ranks", "local") for a node's ranks.
  TrainerBuilder& secondary_partition(int ranks) {
    c_.secondary_partition_ranks = ranks;
    c_.secondary_partition_local = false;
    return *this;
  }
  TrainerBuilder& prefetch_bucket_bytes(std::size_t v) { c_.prefetch_bucket_bytes = v; return *this; }
  TrainerBuilder& max_live_bytes(std::size_t v) {
    c_.max_live_bytes = v;
    c_.max_live_follows_model = false;
    return *this;
  }
  TrainerBuilder& max_reuse_distance(std::size_t units) { c_.max_reuse_distance = units; return *this; }
  TrainerBuilder& persistence_threshold_bytes(std::size_t v) { c_.persistence_threshold_bytes = v; return *this; }
  TrainerBuilder& module_granularity_bytes(std::size_t v) { c_.module_granularity_bytes = v; return *this; }
  TrainerBuilder& mixed_precision(modules::DataType compute) { c_.set_compute_dtype(compute); return *this; }
  TrainerBuilder& reduce_dtype(modules::DataType v) { c_.reduce_dtype = v; return *this; }
  TrainerBuilder& loss_scaling(modules::LossScaling v, float initial = 65536.0f) {
    c_.loss_scaling = v;
    c_.initial_loss_scale = initial;
    return *this;
  }
  TrainerBuilder& gradient_accumulation_steps(int v) { c_.gradient_accumulation_steps = v; return *this; }
  TrainerBuilder& max_grad_norm(float v) { c_.max_grad_norm = v; return *this; }
  TrainerBuilder& adamw(float lr, float weight_decay = modules::AdamWOptions{}.weight_decay,
                        float beta1 = modules::AdamWOptions{}.beta1, float beta2 = modules::AdamWOptions{}.beta2) {
    c_.optimizer = OptimizerKind::adamw;
    c_.lr = lr;
    c_.weight_decay = weight_decay;
    c_.beta1 = beta1;
    c_.beta2 = beta2;
    return *this;
  }
  TrainerBuilder& sgd(float lr, float momentum = modules::SgdOptions{}.momentum,
                      bool nesterov = modules::SgdOptions{}.nesterov) {
    c_.optimizer = OptimizerKind::sgd;
    c_.lr = lr;
    c_.momentum = momentum;
    c_.nesterov = nesterov;
    return *this;
  }
  TrainerBuilder& warmup_steps(std::int64_t v) { c_.warmup_steps = v; return *this; }
  // Parameters matching the glob `pattern` do not train (TrainerConfig::freeze).
  TrainerBuilder& freeze(std::string pattern) { c_.freeze.push_back(std::move(pattern)); return *this; }
  // No weight decay on parameters of one dimension (TrainerConfig::no_decay_for_vectors).
  TrainerBuilder& no_decay_for_vectors(bool on = true) { c_.no_decay_for_vectors = on; return *this; }
  // A parameter group of your own (weight decay, learning-rate scale), after the ones before.
  TrainerBuilder& parameter_group(modules::ParameterGroup group) {
    c_.parameter_groups.push_back(std::move(group));
    return *this;
  }
  // Held-out data for the validation loss (Trainer::validation_loss), every `every` steps of
  // step(HostBatch) (0: only when asked) over `batches` batches of the training step's shape.
  // `data` must outlive the trainer.
  TrainerBuilder& validation(const TokenSource& data, std::int64_t every = 0, std::int64_t batches = 4) {
    validation_ = &data;
    c_.eval_every = every;
    c_.eval_batches = batches;
    return *this;
  }
  // Rank 0 writes TensorBoard event files into `dir` (every scalar of every step; tensorboard.hpp).
  TrainerBuilder& tensorboard(std::filesystem::path dir) { c_.tensorboard_dir = std::move(dir); return *this; }
  TrainerBuilder& seed(std::uint64_t v) { c_.seed = v; return *this; }
  TrainerBuilder& max_skipped_steps(int v) { c_.max_skipped_steps = v; return *this; }
  TrainerBuilder& keep_checkpoints(int v) { c_.keep_checkpoints = v; return *this; }
  TrainerBuilder& timing(bool on) { c_.timing = on; return *this; }
  TrainerBuilder& record_timeline(bool on) { c_.record_timeline = on; return *this; }
  TrainerBuilder& offload_optimizer(OffloadOptions v) { c_.offload_optimizer = std::move(v); return *this; }
  TrainerBuilder& offload_params(OffloadOptions v) { c_.offload_params = std::move(v); return *this; }
  TrainerBuilder& step_in_backward(bool on) { c_.step_in_backward = on; return *this; }
  TrainerBuilder& swap_gradients(bool on) { c_.swap_gradients = on; return *this; }
  TrainerBuilder& sub_group_size(std::size_t elements) { c_.sub_group_size = elements; return *this; }
  // Checkpoints the model's blocks (the container children of a Sequential model, such as
  // make_gpt's and make_llama's layers): recomputed in backward, same losses, less memory.
  TrainerBuilder& activation_checkpointing(modules::ActivationCheckpointing v) {
    c_.activation_checkpointing = v;
    return *this;
  }
  // Attention on CUDA: fused kernels (the default) or materialized (the CPU ignores it).
  TrainerBuilder& attention(modules::AttentionKernels v) {
    c_.attention = v;
    return *this;
  }
  // One field of the run's identity (TrainerConfig::run_identity): compared on resume.
  TrainerBuilder& run_identity(std::string key, std::string value) {
    c_.run_identity[std::move(key)] = std::move(value);
    return *this;
  }
  // One more thing every rank must agree on (TrainerConfig::ranks_agree_on): checked at build.
  TrainerBuilder& ranks_agree_on(std::string key, std::string value) {
    c_.ranks_agree_on[std::move(key)] = std::move(value);
    return *this;
  }

  const TrainerConfig& config() const noexcept { return c_; }

  // Validates everything, creates this rank's stream, allocator, optimizer and engine on the
  // communicator's device, and initialises the weights from `seed`. Runs on a Runtime (the
  // initial upload awaits the device). `model` must outlive the Trainer.
  async::Task<Result<Trainer>> build(modules::Module& model) const;

 private:
  TrainerConfig c_;
  collectives::Communicator* comm_ = nullptr;
  const collectives::Mesh* mesh_ = nullptr;
  modules::Loss* loss_ = nullptr;
  const TokenSource* validation_ = nullptr;
  std::optional<Error> error_;  // the first bad set()
};

}  // namespace coshard::trainer
