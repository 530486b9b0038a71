// Stepping during backward, and the swapper's pass beside it (step_in_backward.hpp).
#include "placement/step_in_backward.hpp"

#include "coshard/async/runtime.hpp"

namespace coshard::zero::detail {

using namespace modules;

Result<void> step_in_backward_saw_non_finite(const OptimizerWiring& w) {
  std::size_t stepped = 0;
  for (const auto& u : w.units) stepped += u->stepped_early ? 1 : 0;
  if (!w.mode.stepping_in_backward)  // (more than one micro-batch: stepped after backward, through the swapper's pass)
    return fail(ErrorCode::unsupported, "Engine::step: a non-finite gradient with step_in_backward and the optimizer ",
                "on nvme: each unit was stepped as its gradient came through the swapper, before the sum over the ranks ",
                "was known, and cannot be skipped, so the parameters are no longer trustworthy. Restore the last ",
                "checkpoint; without step_in_backward, such a step is skipped");
  return fail(ErrorCode::unsupported, "Engine::step: a non-finite gradient with step_in_backward: ", stepped,
              " of ", w.units.size(), " units on this rank were stepped during backward and cannot be skipped, so ",
              "the parameters are no longer trustworthy. Restore the last checkpoint; without step_in_backward, ",
              "such a step is skipped");
}

namespace {

// step_in_backward: the unit's last gradient shard of the step is on its way to pinned memory;
// the host stream steps it once the copy has passed (its share of the norm and overflow flag
// first, so that they are complete for the step's report). A coalesced unit steps before the
// ranks could agree on which of its modules got gradients, so this rank's modules decide (a module
// skipped on some ranks only steps there alone: the ranks' blocks then step by different rules).
Result<void> step_on_host(const OptimizerWiring& w, OptimizerPlacement& placement, FetchUnit& u) {
  COSHARD_TRY(w.settings.skip_modules_unused_here(u));
  COSHARD_TRY_ASSIGN(auto out, w.comm().stream().record());
  COSHARD_TRY(w.host.stream->wait(out));
  if (!w.grads_through_pass()) COSHARD_TRY(w.optimizer.add_grad_stats(*w.host.ctx, w.settings.first_group + u.index));
  COSHARD_TRY(placement.step_in_backward(w, u));
  u.stepped_early = true;
  u.secondary_holds = false;  // (its shard is about to change: a later gather reads the new one)
  ++w.stats.stepped_in_backward;
  return {};
}

// Tells a backward waiting in wait_before_backward to look again (one pending tick is enough).
void tick(async::Sender<char>& ticks) {
  char t = 't';
  (void)ticks.try_send(t);
}

}  // namespace

Result<void> shard_reduced(const OptimizerWiring& w, OptimizerPlacement& placement, FetchUnit& u) {
  auto& cs = w.comm().stream();
  // (a unit with two backward passes is copied again: the last copy wins; through a pass of the
  // swapper, the shard stays on the device until the pass steps it or swaps it out)
  const bool copied_out = !w.grads_wait_for_a_pass();
  if (copied_out) {
    COSHARD_TRY(cs.copy(u.host_grad.data(), u.grad_shard.data(), u.grad_shard.bytes()));
    w.stats.swap_bytes += u.grad_shard.bytes();
  }
  u.grads_out = true;
  const bool last = u.backwards_this_step == u.forward_uses;
  if (w.mode.stepping_in_backward && last) COSHARD_TRY(step_on_host(w, placement, u));
  if (w.grads_to_nvme() && last) COSHARD_TRY(w.pass.hand_over(w, u));  // to the pass writing it out
  if (copied_out && last) {  // its last of the step: back once the copy has passed
    COSHARD_TRY_ASSIGN(auto out, cs.record());
    u.grad_shard_block.reset_after(out);
    u.grad_shard = {};
  }
  return {};
}

Result<void> SwapPass::hand_over(const OptimizerWiring& w, FetchUnit& u) {
  if (w.grads_through_pass()) COSHARD_TRY(w.settings.skip_modules_unused_here(u));
  std::size_t index = u.index;
  if (w.grads_wait_for_a_pass() && !u.grad_pending) {
    u.grad_pending = true;
    pending_bytes_ += static_cast<std::size_t>(u.info.shard) * sizeof(float);
  }
  if (!ready_) return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " handed to no swapped step");
  auto sent = ready_->try_send(index);
  if (!sent && sent.error().code() != ErrorCode::closed)
    return fail(std::move(sent).error().with_context("stepping unit " + u.info.name + " in backward"));
  handed_order_.push_back(index);
  return {};
}

async::Task<Result<void>> SwapPass::wait_before_backward(const OptimizerWiring& w, const FetchUnit& u) {
  if (!ticks_ || !w.grads_wait_for_a_pass() || u.info.frozen) co_return Result<void>{};
  const std::size_t bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);
  while (pending_bytes_ > 0 && pending_bytes_ + bytes > pending_limit && !awaits_arrival_) {
    auto tick = co_await ticks_->recv();
    if (!tick) break;  // the pass has ended (its error, if any, comes with the step)
  }
  co_return Result<void>{};
}

std::vector<std::size_t> SwapPass::pieces_in_expected_order(const OptimizerWiring& w) const {
  std::vector<std::size_t> trained;
  for (std::size_t k = 0; k < w.units.size(); ++k)
    if (!w.units[k]->info.frozen) trained.push_back(k);
  std::vector<std::size_t> order = last_order_;
  if (order.size() != trained.size()) order.assign(trained.rbegin(), trained.rend());  // no step yet: backward goes roughly in reverse
  std::vector<std::size_t> pieces;  // each unit's sub-groups in turn
  for (std::size_t k : order)
    for (std::size_t i = w.swap.first_piece[k]; i < w.swap.first_piece[k + 1]; ++i) pieces.push_back(i);
  return pieces;
}

async::Task<Result<void>> SwapPass::await_arrival(const OptimizerWiring& w, std::size_t k, async::Receiver<std::size_t>& ready,
                                                  std::vector<bool>& arrived, async::Sender<char>& ticks) {
  if (!arrived[k]) {
    awaits_arrival_ = true;
    tick(ticks);
  }
  while (!arrived[k]) {
    auto next = co_await ready.recv();
    if (!next) {
      awaits_arrival_ = false;
      co_return fail(ErrorCode::closed, "the step ended before the gradient of unit ", w.units[k]->info.name,
                     " came to the swapper's pass");
    }
    arrived.at(*next) = true;
  }
  awaits_arrival_ = false;
  co_return Result<void>{};
}

Result<void> SwapPass::take_gradient_piece(const OptimizerWiring& w, FetchUnit& u, const SwapPiece& p, const Tensor& piece) {
  auto& cs = w.comm().stream();
  COSHARD_TRY(cs.copy(piece.data(), u.grad_shard.slice(p.begin, Shape{p.count}).data(), piece.bytes()));
  COSHARD_TRY_ASSIGN(auto copied, cs.record());
  COSHARD_TRY(w.host.stream->wait(copied));
  w.stats.swap_bytes += piece.bytes();
  if (p.begin + p.count == u.info.shard && w.reduction.complete_per_unit()) {  // its last piece: the shard goes
    u.grad_shard_block.reset_after(copied);
    u.grad_shard = {};
    if (u.grad_pending) pending_bytes_ -= static_cast<std::size_t>(u.info.shard) * sizeof(float);
    u.grad_pending = false;
  }
  return w.optimizer.add_grad_stats(*w.host.ctx, w.settings.first_group + p.unit, piece);
}

Result<void> SwapPass::start(OptimizerWiring w, float lr) {
  async::Runtime* rt = async::Runtime::current();
  if (!rt) return fail(ErrorCode::invalid_argument, "Engine::step: must be awaited on a coshard Runtime");
  COSHARD_TRY_ASSIGN(auto channel, async::make_channel<std::size_t>(w.units.size() + 1));
  ready_.emplace(std::move(channel.first));
  COSHARD_TRY_ASSIGN(auto ticks, async::make_channel<char>(1));
  ticks_.emplace(std::move(ticks.second));
  pending_bytes_ = 0;
  awaits_arrival_ = false;
  handed_order_.clear();
  for (auto& u : w.units) u->grad_pending = false;
  if (w.mode.stepping_in_backward)
    pass_ = rt->spawn(step_as_units_arrive(w, std::move(channel.second), lr, std::move(ticks.first)));
  else
    pass_ = rt->spawn(write_gradients_out(w, std::move(channel.second), std::move(ticks.first)));
  return {};
}

async::Task<Result<void>> SwapPass::finish() {
  auto handle = std::move(pass_);
  auto passed = co_await handle;
  ticks_.reset();
  COSHARD_CO_TRY(std::move(passed));
  last_order_ = handed_order_;  // (the order the next step's pass expects)
  co_return Result<void>{};
}

async::Task<void> SwapPass::abandon() {
  if (pass_.valid()) {
    ready_.reset();
    auto handle = std::move(pass_);
    (void)co_await handle;  // (its error, if any, follows from the step's)
  }
  ready_.reset();
  ticks_.reset();
}

async::Task<Result<void>> SwapPass::step_as_units_arrive(OptimizerWiring w, async::Receiver<std::size_t> ready, float lr,
                                                         async::Sender<char> ticks) {
  const std::vector<std::size_t> pieces = pieces_in_expected_order(w);
  std::vector<offload::SubGroup> groups;
  for (std::size_t i : pieces) groups.push_back(w.swap.subgroups[i]);
  std::vector<bool> arrived(w.units.size(), false);
  auto& swapper = *w.swap.swapper;
  const auto read_before = swapper.stats().bytes_read, written_before = swapper.stats().bytes_written;
  auto step_when_ready = [&](std::size_t j, std::span<std::byte> bytes) -> async::Task<Result<void>> {
    COSHARD_CO_TRY(co_await await_arrival(w, w.swap.pieces[pieces[j]].unit, ready, arrived, ticks));
    auto stepped = co_await step_swapped_piece(w, pieces[j], bytes, lr, w.comm().stream());
    tick(ticks);
    co_return stepped;
  };
  auto passed = co_await swapper.for_each(groups, step_when_ready, true);
  w.stats.swap_bytes += (swapper.stats().bytes_read - read_before) + (swapper.stats().bytes_written - written_before);
  co_return passed;
}

async::Task<Result<void>> SwapPass::write_gradients_out(OptimizerWiring w, async::Receiver<std::size_t> ready,
                                                        async::Sender<char> ticks) {
  const std::vector<std::size_t> pieces = pieces_in_expected_order(w);
  std::vector<offload::SubGroup> groups;
  for (std::size_t i : pieces) groups.push_back(w.swap.grad_subgroups[i]);
  std::vector<bool> arrived(w.units.size(), false);
  auto& swapper = *w.swap.swapper;
  const auto written_before = swapper.stats().bytes_written;
  // Each piece from the device shard into the buffer (after the unit's reduction, on the
  // communication stream), its statistics added on the host stream, then written behind.
  auto write_when_ready = [&](std::size_t j, std::span<std::byte> bytes) -> async::Task<Result<void>> {
    const SwapPiece& p = w.swap.pieces[pieces[j]];
    FetchUnit& u = *w.units[p.unit];
    COSHARD_CO_TRY(co_await await_arrival(w, p.unit, ready, arrived, ticks));
    if (!u.grad_shard) co_return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " has no gradient shard to swap out");
    const Tensor piece(bytes.data(), Shape{p.count}, DataType::f32, async::Device::cpu());
    COSHARD_CO_TRY(take_gradient_piece(w, u, p, piece));
    // (the buffer is written, then reused, only once the statistics have read it)
    COSHARD_CO_TRY_ASSIGN(auto added, w.host.stream->record());
    COSHARD_CO_TRY(co_await added);
    tick(ticks);
    co_return Result<void>{};
  };
  auto written = co_await swapper.initialize(groups, write_when_ready);
  w.stats.swap_bytes += swapper.stats().bytes_written - written_before;
  co_return written;
}

}  // namespace coshard::zero::detail
