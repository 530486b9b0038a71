// The Trainer's state, shared by its sources (trainer.cpp: the step, the builder; validation.cpp:
// the validation loss).
#pragma once

#include <chrono>
#include <memory>
#include <optional>
#include <span>
#include <utility>

#include "coshard/modules/fused_cross_entropy.hpp"
#include "coshard/modules/moe.hpp"
#include "coshard/trainer/tensorboard.hpp"
#include "coshard/trainer/trainer.hpp"

namespace coshard::trainer {

struct Trainer::Impl {
  TrainerConfig config;
  collectives::Communicator* comm = nullptr;
  // The tensor ranks the model is split over (a mesh's; null: none): sampling gathers the
  // logits' columns over them.
  collectives::Communicator* tensor = nullptr;
  int world_rank = 0;
  modules::Module* model = nullptr;
  std::unique_ptr<async::Stream> stream;
  std::unique_ptr<async::CachingAllocator> allocator;
  std::unique_ptr<modules::Context> ctx;
  std::unique_ptr<modules::Optimizer> optimizer;
  std::unique_ptr<zero::Engine> engine;
  modules::CrossEntropyLoss own_loss;      // the default
  std::unique_ptr<modules::Loss> own_split_loss;  // the default over a mesh with tensor parallelism
  std::unique_ptr<modules::FusedCrossEntropyLoss> own_chunked_loss;  // cross_entropy chunked (or auto on CUDA)
  std::unique_ptr<modules::RouterAuxLoss> own_aux_loss;  // a mixture of experts' load balancing around it
  modules::Loss* loss = &own_loss;         // or the builder's
  int skipped_in_a_row = 0;  // steps skipped for inf/NaN gradients, up to this one
  std::optional<TensorBoardWriter> tensorboard;  // rank 0, with config.tensorboard_dir
  // The process's blocking waits once the engine was made (its setup may split the communicator
  // for shard groups, a counted wait): the steps report those since.
  std::uint64_t blocking_waits_at_start = 0;

  // The trainer's own loss where the builder gave none and there is no tensor parallelism:
  // config.cross_entropy chunked (refused by name where the output layer cannot take it), or
  // automatic on CUDA (the whole logits' loss where it cannot). After LoRA: adapters on the
  // output layer leave it whole.
  Result<void> choose_loss(modules::Module& model, bool builders_loss, int tensor_size) {
    const std::int64_t chunk_bytes = config.chunked_cross_entropy_bytes(ctx->device());
    if (builders_loss || tensor_size > 1 || chunk_bytes == 0) return {};
    auto chunked = std::make_unique<modules::FusedCrossEntropyLoss>(
        modules::FusedCrossEntropyOptions{.chunk_bytes = chunk_bytes});
    if (auto attached = chunked->attach(model); !attached) {
      if (config.cross_entropy == CrossEntropyKind::chunked)
        return fail(std::move(attached).error().with_context("cross_entropy=chunked"));
      return {};
    }
    own_chunked_loss = std::move(chunked);
    loss = own_chunked_loss.get();
    return {};
  }

  // A model with mixture-of-experts layers trains with their load-balancing loss added (as
  // transformers' MoE models add it to theirs), unless the loss given already adds it.
  void add_router_aux_loss(modules::Module& model) {
    auto balance = modules::find_router_balance(model);
    if (!balance || dynamic_cast<modules::RouterAuxLoss*>(loss)) return;
    own_aux_loss = std::make_unique<modules::RouterAuxLoss>(*loss, std::move(balance));
    loss = own_aux_loss.get();
    // The metrics name each MoE layer by its block ("h2" of "h2.mlp.moe"), in the order they run.
    model.for_each_module([&](const std::string& path, modules::Module& m) {
      if (dynamic_cast<modules::SparseMoe*>(&m)) moe_layer_names.push_back(path.substr(0, path.find('.')));
    });
  }
  std::vector<std::string> moe_layer_names;

  ~Impl() {
    engine.reset();  // a checkpoint write in flight runs on; it owns its data
    optimizer.reset();
    if (stream) (void)stream->synchronize();  // teardown: the blocks below go back to a quiet stream
  }
  // What a checkpoint records of this run and compares on resume.
  zero::CheckpointOptions checkpoint_options() const {
    // (LoRA: the adapters and their state alone; the base comes from the seed or the base weights,
    // which the run's identity names)
    return {.run = config.identity(), .keep = config.keep_checkpoints, .frozen_units = config.lora_rank == 0};
  }
  // One optimizer step over `micro` (this rank's micro-batches, on the device); `counted` is the
  // global batch's tokens or samples for the statistics. eval_shape: the global batch's (rows,
  // seq), for the validation loss every eval_every steps (absent: a batch not of tokens).
  async::Task<Result<StepStats>> step(std::span<const modules::Batch> micro, std::int64_t counted,
                                      std::chrono::steady_clock::time_point start,
                                      std::optional<std::pair<std::int64_t, std::int64_t>> eval_shape);
  const TokenSource* validation = nullptr;  // the builder's, or none
  bool validation_requested = false;         // request_validation: after the next step
  async::Task<Result<double>> validation_loss(std::int64_t global_rows, std::int64_t seq);
  async::Task<Result<std::vector<std::int32_t>>> generate(std::span<const std::int32_t> prompt,
                                                          const SampleOptions& options);
};

// This rank's rows as k micro-batches on the device (token ids and targets, i32).
Result<std::vector<modules::Batch>> upload_micro_batches(modules::Context& ctx, const HostBatch& rows, int k);

}  // namespace coshard::trainer
