// The loop: begin_step, the micro-batches' forward and backward, finish_step (reductions, the
// optimizer, the loss over ranks, gathers of full copies, trace bookkeeping), abandon_step, and
// the inference pass; step and evaluate are that loop.
#include "engine/state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

namespace {

// Collective launches so far, the shard groups' included.
// (with tensor parallelism, the tensor group's too: the layers' sums and the norm's)
std::uint64_t launches_so_far(const Engine::State& s) {
  return s.comm->launches() + s.shard_groups->launches() + (s.o.tensor_parallel ? s.o.tensor_parallel->launches() : 0);
}

StepClock::Sources clock_sources(const Engine::State& s) {
  return {&s.ctx->stream(), s.host.stream.get(), s.swap.store.get()};
}

}  // namespace

// A pass's start and end (its trace chosen, then recorded), and the ranks' agreement on the
// adaptive prefetch's measurements (gather_scheduler.cpp uses them).
void Engine::State::begin_pass(std::string_view name) {
  reset_coalesced(name == "train");
  gathers->begin_pass(name);
  stats = {};
  timeline.begin_pass();
}

Result<void> Engine::State::end_pass() {
  COSHARD_TRY(residence->end_pass(residence_wiring()));
  if (gathers->end_pass()) stats.trace_changed = true;
  return {};
}

async::Task<Result<void>> Engine::State::agree_on_measurements() {
  if (!o.adaptive_prefetch) co_return Result<void>{};
  auto& positions = timeline.compute_ms[gathers->trace().phase()];
  std::vector<double> mine(timeline.gather_ms);
  mine.insert(mine.end(), positions.begin(), positions.end());
  COSHARD_CO_TRY_ASSIGN(auto agreed, co_await ranks_agree.all_reduce_values(mine, ReduceOp::avg, "the prefetch's measurements"));
  std::copy(agreed.begin(), agreed.begin() + static_cast<std::ptrdiff_t>(timeline.gather_ms.size()), timeline.gather_ms.begin());
  std::copy(agreed.begin() + static_cast<std::ptrdiff_t>(timeline.gather_ms.size()), agreed.end(), positions.begin());
  co_return Result<void>{};
}

async::Task<Result<EngineStepStats>> Engine::step(Loss& loss, std::span<const Batch> micro_batches,
                                                  float lr) {
  State& s = *s_;
  if (micro_batches.empty()) co_return fail(ErrorCode::invalid_argument, "Engine::step: no micro-batches");
  COSHARD_CO_TRY(co_await begin_step(static_cast<int>(micro_batches.size()), lr));
  for (const auto& mb : micro_batches) {
    auto value = co_await forward_backward(*s.ctx, *s.model, loss, mb.inputs, mb.targets, backward_seed());
    if (!value) {
      co_await abandon_step();
      co_return fail(std::move(value).error());
    }
    COSHARD_CO_TRY(add_loss(*value));
  }
  co_return co_await finish_step();
}

std::int64_t Engine::steps_done() const noexcept { return s_->steps_done; }

async::Task<Result<void>> Engine::begin_step(int micro_batches, float lr) {
  State& s = *s_;
  if (s.loop.open != State::Open::none)
    co_return fail(ErrorCode::invalid_argument, "Engine::begin_step: ",
                   s.loop.open == State::Open::step ? "a step" : "an inference pass", " is open (finish it first)");
  if (micro_batches < 1)
    co_return fail(ErrorCode::invalid_argument, "Engine::begin_step(micro_batches=", micro_batches, "): expected >= 1");
  COSHARD_CO_TRY(s.settings().check_trainability());
  s.settings().clear_gradients_missed();
  // A checkpoint saved before the last step is published now, its file written behind that step.
  if (s.checkpoint.pending && --s.checkpoint.pending->steps_left <= 0) COSHARD_CO_TRY(co_await s.publish_checkpoint());
  Context& ctx = *s.ctx;
  auto& compute = ctx.stream();
  auto& cs = s.comm->stream();
  s.loop.launches_before = launches_so_far(s);
  s.step_clock.start(clock_sources(s));
  s.begin_pass("train");
  s.loop.open = State::Open::step;
  ctx.reset_activation_peak();
  s.loop.declared_micro_batches = micro_batches;
  s.loop.model_forwards = s.loop.model_backwards = s.loop.losses_added = 0;

  // The communication stream goes after the last step's optimizer (it reads the shards).
  COSHARD_CO_TRY(order(compute, cs));
  s.mode.grads_out_in_backward = s.offloaded() && s.reduction->complete_per_unit() && micro_batches == 1;
  s.mode.stepping_in_backward = s.o.step_in_backward && s.mode.grads_out_in_backward;
  s.mode.lr = lr;
  if (s.mode.stepping_in_backward && !(lr >= 0)) {
    co_await abandon_step();
    co_return fail(ErrorCode::invalid_argument, "lr=", lr, ": expected >= 0");
  }
  const auto settings = s.settings();
  for (auto& u : s.units) {
    u->grads_this_step = 0;
    u->grads_out = false;
    u->forward_uses = 0;
    u->uses_pending = 0;
    u->backwards_this_step = 0;
    u->stepped_early = false;
    for (auto& p : u->params) p.left_out = false;
    COSHARD_CO_TRY(s.reduction->begin_step(s.gradient_wiring(), *u));
    if (u->coalesced()) COSHARD_CO_TRY(settings.skip_unused_modules(*u, {}));
    const auto group = settings.group_of(*u);
    COSHARD_CO_TRY(group.optimizer.set_group_skipped(group.index, false));
  }
  {
    const OptimizerWiring wiring = s.optimizer_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
    COSHARD_CO_TRY(co_await s.optimizer_placement->begin_step(wiring));
  }
  COSHARD_CO_TRY_ASSIGN(s.loop.loss_sum, ctx.zeros(Shape{1}, DataType::f32));
  co_return Result<void>{};
}

async::Task<void> Engine::end_swap_pass() { co_await s_->pass.abandon(); }

Tensor Engine::backward_seed() const {
  return s_->host.offloaded() ? s_->host.device_loss_scale : s_->optimizer->loss_scale();
}

Result<void> Engine::add_loss(const Tensor& loss) {
  State& s = *s_;
  if (s.loop.open != State::Open::step) return fail(ErrorCode::invalid_argument, "Engine::add_loss outside a step");
  if (!loss || loss.numel() != 1 || loss.dtype() != DataType::f32 || !(loss.device() == s.ctx->device()))
    return fail(ErrorCode::invalid_argument, "Engine::add_loss: ", loss ? loss.describe() : "empty",
                ", expected one f32 on ", s.ctx->device().to_string(), " (a loss's forward)");
  ++s.loop.losses_added;
  return s.ctx->kernels().add(s.ctx->stream(), DataType::f32, s.loop.loss_sum.data(), loss.data(), s.loop.loss_sum.data(), 1);
}

async::Task<void> Engine::abandon_step() {
  State& s = *s_;
  if (s.loop.open != State::Open::step) co_return;
  co_await end_swap_pass();
  s.model->clear_saved_recursive();
  (void)s.end_pass();
  s.loop.open = State::Open::none;
}

async::Task<Result<EngineStepStats>> Engine::finish_step() {
  State& s = *s_;
  if (s.loop.open != State::Open::step)
    co_return fail(ErrorCode::invalid_argument, "Engine::finish_step without begin_step");
  if (s.loop.model_backwards < s.loop.declared_micro_batches || s.loop.model_forwards != s.loop.model_backwards) {
    const int forwards = s.loop.model_forwards, backwards = s.loop.model_backwards, declared = s.loop.declared_micro_batches;
    co_await abandon_step();
    co_return fail(ErrorCode::invalid_argument, "Engine::finish_step: ", backwards == 0 ? "no backward in this step: " : "",
                   forwards, " forward and ", backwards, " backward passes of the model in a step begun with ", declared,
                   " micro-batches (each needs one of each); the step is abandoned, nothing updated");
  }
  if (auto clean = s.settings().check_no_gradient_missed(); !clean) {
    co_await abandon_step();
    co_return fail(std::move(clean).error());
  }
  auto finished = co_await finish_open_step(s.mode.lr);
  co_await end_swap_pass();
  s.loop.open = State::Open::none;
  if (finished) {
    ++s.steps_done;
    finished->time_split = s.step_clock.lap(clock_sources(s));
    if (s.swap.store) s.timeline.add_nvme_spans(*finished, s.swap.store->take_spans());
  }
  co_return finished;
}

async::Task<Result<EngineStepStats>> Engine::finish_open_step(float lr) {
  State& s = *s_;
  Context& ctx = *s.ctx;
  auto& compute = ctx.stream();
  auto& cs = s.comm->stream();
  const auto& k = ctx.kernels();
  Tensor loss_sum = s.loop.loss_sum;
  const auto micro_batches = static_cast<std::size_t>(s.loop.declared_micro_batches);
  // nvme parameters: no read may be left over when the optimizer rewrites the swap files.
  {
    const ShardWiring wiring = s.shard_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
    COSHARD_CO_TRY(co_await s.shard_placement->settle(wiring));
  }
  COSHARD_CO_TRY(co_await s.finish_gradients(micro_batches));
  COSHARD_CO_TRY(co_await skip_units_without_gradients(s.settings(), s.ranks_agree, s.reduction->reduces_every_unit(),
                                                      s.comm->size()));
  COSHARD_CO_TRY_ASSIGN(auto optimizer_started, s.timeline.mark(compute));
  {
    const OptimizerWiring wiring = s.optimizer_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
    COSHARD_CO_TRY(co_await s.optimizer_placement->step(wiring, lr));
  }
  COSHARD_CO_TRY_ASSIGN(auto optimizer_finished, s.timeline.mark(compute));
  s.timeline.span(true, "optimizer", kOptimizer, std::move(optimizer_started), std::move(optimizer_finished));

  // The loss, averaged over micro-batches and ranks.
  // (the losses the loop added: when it added fewer than its micro-batches, their mean still)
  const float added = static_cast<float>(std::max(s.loop.losses_added, 1));
  if (added > 1) COSHARD_CO_TRY(k.scale(compute, DataType::f32, loss_sum.data(), 1.0f / added, 1));
  COSHARD_CO_TRY(order(compute, cs));
  COSHARD_CO_TRY(s.comm->all_reduce(loss_sum.data(), loss_sum.data(), 1, DataType::f32, ReduceOp::avg, "the step's loss"));

  // The whole copies follow the stepped shards (stages 1-2: one all-gather).
  COSHARD_CO_TRY(s.residence->after_step(s.residence_wiring()));
  COSHARD_CO_TRY(s.timeline.wait_for(compute, cs, kParameters));
  COSHARD_CO_TRY(s.end_pass());

  const std::uint64_t launches = launches_so_far(s) - s.loop.launches_before;
  COSHARD_CO_TRY_ASSIGN(auto host_loss, co_await ctx.read(loss_sum));
  COSHARD_CO_TRY_ASSIGN(auto optimizer_stats, co_await s.optimizer->read_stats((s.host.offloaded() ? *s.host.ctx : *s.ctx)));
  if ((s.mode.stepping_in_backward || s.optimizer_wiring().grads_through_pass()) && optimizer_stats.last_skipped) {
    auto refused = step_in_backward_saw_non_finite(s.optimizer_wiring());
    co_return fail(std::move(refused).error());
  }
  // A step that counted: the parameters left out of it missed one (PyTorch's step per parameter).
  if (!optimizer_stats.last_skipped) COSHARD_CO_TRY(s.settings().count_steps_missed());
  // Every event of the step has passed now (the reads came after all of it): read the timings.
  s.timeline.collect(s.stats, s.gathers->trace().phase(), s.gathers->trace().recorded());
  COSHARD_CO_TRY(co_await s.agree_on_measurements());
  EngineStepStats stats = std::move(s.stats);
  s.stats = {};
  stats.collective_launches = launches;
  stats.loss = host_loss[0];
  stats.optimizer = optimizer_stats;
  stats.peak_activation_bytes = ctx.activation_memory().peak_bytes;
  co_return stats;
}

Result<void> Engine::begin_inference() {
  State& s = *s_;
  if (s.loop.open != State::Open::none)
    return fail(ErrorCode::invalid_argument, "Engine::begin_inference: ",
                s.loop.open == State::Open::step ? "a step" : "an inference pass", " is open (finish it first)");
  s.begin_pass("eval");
  s.settings().clear_gradients_missed();  // (and reads of unbound values: explain_failure names this pass's)
  s.loop.open = State::Open::inference;
  return order(s.ctx->stream(), s.comm->stream());
}

async::Task<Result<void>> Engine::end_inference() {
  State& s = *s_;
  if (s.loop.open != State::Open::inference)
    co_return fail(ErrorCode::invalid_argument, "Engine::end_inference without begin_inference");
  s.loop.open = State::Open::none;
  s.model->clear_saved_recursive();
  COSHARD_CO_TRY(s.end_pass());
  {
    const ShardWiring wiring = s.shard_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
    COSHARD_CO_TRY(co_await s.shard_placement->settle(wiring));
  }
  co_return Result<void>{};
}

async::Task<Result<double>> Engine::evaluate(Loss& loss, const Batch& batch) {
  State& s = *s_;
  Context& ctx = *s.ctx;
  COSHARD_CO_TRY(begin_inference());
  // The forward and the mean over ranks; the pass ends whether they worked or not.
  auto value = co_await [&]() -> async::Task<Result<Tensor>> {
    loss.set_targets(batch.targets);  // before the model's forward (a fused output layer takes them there)
    COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(*s.model, batch.inputs));
    COSHARD_CO_TRY_ASSIGN(Tensor v, co_await ctx.forward(loss, std::move(logits)));
    COSHARD_CO_TRY(order(ctx.stream(), s.comm->stream()));
    COSHARD_CO_TRY(s.comm->all_reduce(v.data(), v.data(), 1, DataType::f32, ReduceOp::avg, "the evaluated loss"));
    COSHARD_CO_TRY(order(s.comm->stream(), ctx.stream()));
    co_return v;
  }();
  loss.clear_saved();
  auto ended = co_await end_inference();
  if (!value) co_return fail(std::move(value).error());
  COSHARD_CO_TRY(ended);
  COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx.read(*value));
  s.timeline.collect(s.stats, s.gathers->trace().phase(), s.gathers->trace().recorded());  // the eval trace's measurements, for adaptive prefetch
  s.stats = {};
  COSHARD_CO_TRY(co_await s.agree_on_measurements());
  co_return host[0];
}

Result<void> Engine::set_timeline_epoch(async::Event epoch) {
  if (!epoch.timed() || !(epoch.device() == s_->ctx->device()))
    return fail(ErrorCode::invalid_argument, "set_timeline_epoch: expected a timed event (Stream::record_timed) on ",
                s_->ctx->device().to_string());
  return s_->timeline.set_epoch(std::move(epoch), s_->ctx->stream(), s_->comm->stream());
}

// After the last micro-batch: what is left reduced, the shards scaled by the micro-batch count,
// and the compute stream waits for them.
async::Task<Result<void>> Engine::State::finish_gradients(std::size_t micro_batches) {
  auto& cs = comm->stream();
  COSHARD_CO_TRY(order(ctx->stream(), cs));
  const GradientWiring wiring = gradient_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
  COSHARD_CO_TRY(co_await reduction->finish(wiring));
  const auto K = static_cast<float>(micro_batches);
  if (micro_batches > 1)
    for (auto& u : units)
      if (!u->info.frozen) COSHARD_CO_TRY(ctx->kernels().scale(cs, DataType::f32, u->grad_shard.data(), 1.0f / K, u->info.shard));
  COSHARD_CO_TRY(timeline.wait_for(ctx->stream(), cs, kGradients));
  co_return Result<void>{};
}

std::size_t Engine::units_in_flight() const noexcept {
  std::size_t n = 0;
  for (const auto& u : s_->units) n += u->gather == Gather::in_flight ? 1 : 0;
  return n;
}

}  // namespace coshard::zero
