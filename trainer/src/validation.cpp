// The validation loss (Trainer::validation_loss): the mean over eval_batches held-out global
// batches, each split over the ranks and into the step's micro-batches, through the engine's
// inference pass (no gradient, no optimizer state touched).
#include "trainer_impl.hpp"

namespace coshard::trainer {

async::Task<Result<double>> Trainer::Impl::validation_loss(std::int64_t global_rows, std::int64_t seq) {
  if (!validation)
    co_return fail(ErrorCode::invalid_argument, "Trainer::validation_loss: no validation data (TrainerBuilder::validation)");
  const int world = comm->size(), k = config.gradient_accumulation_steps;
  if (global_rows <= 0 || seq <= 0 || global_rows % (static_cast<std::int64_t>(world) * k) != 0)
    co_return fail(ErrorCode::invalid_argument, "validation: a global batch of ", global_rows, " rows of ", seq,
                   " tokens: expected rows that split evenly over ", world, " ranks x gradient_accumulation_steps=", k);
  // Each forward's loss is the mean over its rows, averaged over ranks: every forward has the
  // same number of rows, so the mean of them all is the mean over every row of every batch.
  double sum = 0;
  for (std::int64_t b = 0; b < config.eval_batches; ++b) {
    const HostBatch global = validation->batch(static_cast<std::uint64_t>(b), global_rows, seq);
    COSHARD_CO_TRY_ASSIGN(auto micro, upload_micro_batches(*ctx, global.rank_rows(comm->rank(), world), k));
    for (const auto& m : micro) {
      COSHARD_CO_TRY_ASSIGN(const double v, co_await engine->evaluate(*loss, m));
      sum += v;
    }
  }
  co_return sum / static_cast<double>(config.eval_batches * k);
}

async::Task<Result<double>> Trainer::validation_loss(std::int64_t global_rows, std::int64_t seq) {
  co_return co_await impl_->validation_loss(global_rows, seq);
}

bool Trainer::has_validation() const noexcept { return impl_->validation != nullptr; }
void Trainer::request_validation() noexcept { impl_->validation_requested = true; }

}  // namespace coshard::trainer
