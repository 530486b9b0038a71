// A training loop of your own over the ZeRO engine, the way FSDP2 users write one after
// fully_shard(model): your model (here a small regression MLP), your loss (mean squared error),
// your loop. Two ranks as threads on the CPU, ZeRO-3, two micro-batches a step; each rank fits
// y = sin(x0) + 0.5 x1 on its rows. Exits 1 unless the loss falls.
#include <coshard/coshard.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

namespace {

using namespace coshard;
using modules::DataType;
using modules::Shape;
using modules::Tensor;

constexpr int kWorld = 2, kMicroBatches = 2, kSteps = 60;
constexpr std::int64_t kRows = 16, kFeatures = 2;  // rows per micro-batch

// Micro-batch `m` of rank `rank` at `step`: features in [-2, 2] and their targets.
Result<modules::Batch> micro_batch(modules::Context& ctx, int step, int rank, int m) {
  std::vector<float> x(kRows * kFeatures), y(kRows);
  for (std::int64_t r = 0; r < kRows; ++r) {
    const double seed = 0.618 * static_cast<double>(((step * kWorld + rank) * kMicroBatches + m) * kRows + r);
    const double x0 = 4 * (seed - std::floor(seed)) - 2, x1 = std::sin(3 * seed) * 2;
    x[static_cast<std::size_t>(2 * r)] = static_cast<float>(x0);
    x[static_cast<std::size_t>(2 * r + 1)] = static_cast<float>(x1);
    y[static_cast<std::size_t>(r)] = static_cast<float>(std::sin(x0) + 0.5 * x1);
  }
  COSHARD_TRY_ASSIGN(Tensor inputs, ctx.upload(std::as_bytes(std::span<const float>(x)), Shape{kRows, kFeatures}, DataType::f32));
  COSHARD_TRY_ASSIGN(Tensor targets, ctx.upload(std::as_bytes(std::span<const float>(y)), Shape{kRows, 1}, DataType::f32));
  return modules::Batch{inputs, targets};
}

// One rank's training: run_on_ranks made its stream, memory and context (everything runs in
// their order) and keeps them in place until this returns.
async::Task<Result<void>> train(zero::Rank& rank, std::vector<double>& losses) {
  modules::Context& ctx = rank.ctx;
  collectives::Communicator& comm = rank.comm;

  // Your model.
  modules::Sequential model;
  model.add("fc1", std::make_unique<modules::Linear>(kFeatures, 64));
  model.add("act", std::make_unique<modules::Gelu>());
  model.add("fc2", std::make_unique<modules::Linear>(64, 64));
  model.add("act2", std::make_unique<modules::Gelu>());
  model.add("out", std::make_unique<modules::Linear>(64, 1));

  // Shard it once: ZeRO-3, each rank keeps its shard of every unit and gathers a unit as it runs.
  COSHARD_CO_TRY_ASSIGN(auto optimizer, modules::Optimizer::adamw({.weight_decay = 0}));
  zero::EngineOptions options;
  options.zero_stage = 3;
  options.prefetch_bucket_bytes = 64 << 10;
  COSHARD_CO_TRY_ASSIGN(auto engine, zero::Engine::create(ctx, comm, model, *optimizer, options));
  COSHARD_CO_TRY(co_await engine->initialize(/*seed=*/1));

  // Your loop.
  modules::MeanSquaredErrorLoss loss;
  for (int step = 0; step < kSteps; ++step) {
    COSHARD_CO_TRY(co_await engine->begin_step(kMicroBatches, /*lr=*/3e-3f));
    for (int m = 0; m < kMicroBatches; ++m) {
      COSHARD_CO_TRY_ASSIGN(auto batch, micro_batch(ctx, step, comm.rank(), m));
      loss.set_targets(batch.targets);  // before the model's forward (a FusedCrossEntropyLoss takes them there)
      COSHARD_CO_TRY_ASSIGN(Tensor prediction, co_await ctx.forward(model, batch.inputs));
      COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, prediction));
      COSHARD_CO_TRY_ASSIGN(Tensor grad, co_await ctx.backward(loss, engine->backward_seed()));
      COSHARD_CO_TRY(co_await ctx.backward(model, grad));
      COSHARD_CO_TRY(engine->add_loss(value));
    }
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());  // the mean loss over ranks
    if (rank.rank == 0) losses.push_back(stats.loss);
  }
  // The engine goes first (it refers to the context and the model); run_on_ranks then drains the
  // streams before the context, the memory and the stream go.
  engine.reset();
  co_return Result<void>{};
}

}  // namespace

int main() {
  std::vector<double> losses;  // rank 0's
  auto done = zero::run_on_ranks({.world = kWorld}, [&](zero::Rank& rank) { return train(rank, losses); });
  if (!done) {
    std::fprintf(stderr, "custom_loop: %s\n", done.error().message().c_str());
    return 1;
  }
  for (int step = 0; step < kSteps; step += 10) std::printf("step %2d  mse %.5f\n", step, losses[static_cast<std::size_t>(step)]);
  std::printf("step %2d  mse %.5f\n", kSteps - 1, losses.back());
  return losses.back() < 0.25 * losses.front() ? 0 : 1;
}
