// Stepping during backward (step_in_backward): with the optimizer offloaded, each unit is stepped
// on the host as soon as its last gradient shard of the step is out, while backward goes on
// (nvme: through one pass of the swapper beside forward and backward, which also takes each
// piece's gradient from the device shard: grads_through_pass).
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

Result<void> Engine::State::step_in_backward_saw_non_finite() const {
  std::size_t stepped = 0;
  for (const auto& u : units) stepped += u->stepped_early ? 1 : 0;
  if (!stepping_in_backward)  // (more than one micro-batch: stepped after backward, through the swapper's pass)
    return fail(ErrorCode::unsupported, "Engine::step: a non-finite gradient with step_in_backward and the optimizer ",
                "on nvme: each unit was stepped as its gradient came through the swapper, before the sum over the ranks ",
                "was known, and cannot be skipped, so the parameters are no longer trustworthy. Restore the last ",
                "checkpoint; without step_in_backward, such a step is skipped");
  return fail(ErrorCode::unsupported, "Engine::step: a non-finite gradient with step_in_backward: ", stepped,
              " of ", units.size(), " units on this rank were stepped during backward and cannot be skipped, so ",
              "the parameters are no longer trustworthy. Restore the last checkpoint; without step_in_backward, ",
              "such a step is skipped");
}

// step_in_backward: a coalesced unit steps before the ranks could agree on which of its modules
// got gradients, so this rank's modules decide (a module skipped on some ranks only steps there
// alone: the ranks' blocks then step by different rules).
Result<void> Engine::State::skip_modules_unused_here(FetchUnit& u) {
  if (!u.coalesced()) return {};
  std::vector<double> used;
  for (const auto& run : u.module_runs) used.push_back(run.used ? 1.0 : 0.0);
  return skip_unused_modules(u, used);
}

Result<void> Engine::State::step_on_host(FetchUnit& u) {
  COSHARD_TRY(skip_modules_unused_here(u));
  COSHARD_TRY_ASSIGN(auto out, comm->stream().record());
  COSHARD_TRY(host_stream->wait(out));
  if (!grads_through_pass()) COSHARD_TRY(optimizer->add_grad_stats(*host_ctx, first_group + u.index));
  COSHARD_TRY(optimizer_placement->step_in_backward(*this, u));
  u.stepped_early = true;
  ++stats.stepped_in_backward;
  return {};
}

Result<void> Engine::State::hand_to_swap_step(FetchUnit& u) {
  if (grads_through_pass()) COSHARD_TRY(skip_modules_unused_here(u));
  std::size_t index = u.index;
  if (grads_wait_for_a_pass() && !u.grad_pending) {
    u.grad_pending = true;
    grads_pending_bytes += static_cast<std::size_t>(u.info.shard) * sizeof(float);
  }
  if (!grads_ready) return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " handed to no swapped step");
  auto sent = grads_ready->try_send(index);
  if (!sent && sent.error().code() != ErrorCode::closed)
    return fail(std::move(sent).error().with_context("stepping unit " + u.info.name + " in backward"));
  handed_order.push_back(index);
  return {};
}

async::Task<Result<void>> Engine::State::wait_for_the_pass(const FetchUnit& u) {
  if (!pass_ticks || !grads_wait_for_a_pass() || u.info.frozen) co_return Result<void>{};
  const std::size_t bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);
  while (grads_pending_bytes > 0 && grads_pending_bytes + bytes > grads_pending_limit && !pass_awaits_arrival) {
    auto tick = co_await pass_ticks->recv();
    if (!tick) break;  // the pass has ended (its error, if any, comes with the step)
  }
  co_return Result<void>{};
}

std::vector<std::size_t> Engine::State::pieces_in_expected_order() const {
  std::vector<std::size_t> trained;
  for (std::size_t k = 0; k < units.size(); ++k)
    if (!units[k]->info.frozen) trained.push_back(k);
  std::vector<std::size_t> order = backward_order;
  if (order.size() != trained.size()) order.assign(trained.rbegin(), trained.rend());  // no step yet: backward goes roughly in reverse
  std::vector<std::size_t> pieces;  // each unit's sub-groups in turn
  for (std::size_t k : order)
    for (std::size_t i = first_piece[k]; i < first_piece[k + 1]; ++i) pieces.push_back(i);
  return pieces;
}

namespace {

// Tells a backward waiting in wait_for_the_pass to look again (one pending tick is enough).
void tick(async::Sender<char>& ticks) {
  char t = 't';
  (void)ticks.try_send(t);
}

}  // namespace

async::Task<Result<void>> Engine::State::await_arrival(std::size_t k, async::Receiver<std::size_t>& ready,
                                                       std::vector<bool>& arrived, async::Sender<char>& ticks) {
  if (!arrived[k]) {
    pass_awaits_arrival = true;
    tick(ticks);
  }
  while (!arrived[k]) {
    auto next = co_await ready.recv();
    if (!next) {
      pass_awaits_arrival = false;
      co_return fail(ErrorCode::closed, "the step ended before the gradient of unit ", units[k]->info.name,
                     " came to the swapper's pass");
    }
    arrived.at(*next) = true;
  }
  pass_awaits_arrival = false;
  co_return Result<void>{};
}

Result<void> Engine::State::take_gradient_piece(FetchUnit& u, const SwapPiece& p, const Tensor& piece) {
  auto& cs = comm->stream();
  COSHARD_TRY(cs.copy(piece.data(), u.grad_shard.slice(p.begin, Shape{p.count}).data(), piece.bytes()));
  COSHARD_TRY_ASSIGN(auto copied, cs.record());
  COSHARD_TRY(host_stream->wait(copied));
  stats.swap_bytes += piece.bytes();
  if (p.begin + p.count == u.info.shard && reduction->complete_per_unit()) {  // its last piece: the shard goes
    u.grad_shard_block.reset_after(copied);
    u.grad_shard = {};
    if (u.grad_pending) grads_pending_bytes -= static_cast<std::size_t>(u.info.shard) * sizeof(float);
    u.grad_pending = false;
  }
  return optimizer->add_grad_stats(*host_ctx, first_group + p.unit, piece);
}

Result<void> Engine::State::start_swap_pass(float lr) {
  async::Runtime* rt = async::Runtime::current();
  if (!rt) return fail(ErrorCode::invalid_argument, "Engine::step: must be awaited on a coshard Runtime");
  COSHARD_TRY_ASSIGN(auto channel, async::make_channel<std::size_t>(units.size() + 1));
  grads_ready.emplace(std::move(channel.first));
  COSHARD_TRY_ASSIGN(auto ticks, async::make_channel<char>(1));
  pass_ticks.emplace(std::move(ticks.second));
  grads_pending_bytes = 0;
  pass_awaits_arrival = false;
  handed_order.clear();
  for (auto& u : units) u->grad_pending = false;
  if (stepping_in_backward)
    swap_step = rt->spawn(swapped_step_in_backward(std::move(channel.second), lr, std::move(ticks.first)));
  else
    swap_step = rt->spawn(swap_gradients_out(std::move(channel.second), std::move(ticks.first)));
  return {};
}

async::Task<Result<void>> Engine::State::finish_swap_pass() {
  auto handle = std::move(swap_step);
  auto passed = co_await handle;
  pass_ticks.reset();
  COSHARD_CO_TRY(std::move(passed));
  backward_order = handed_order;  // (the order the next step's pass expects)
  co_return Result<void>{};
}

async::Task<Result<void>> Engine::State::swapped_step_in_backward(async::Receiver<std::size_t> ready, float lr,
                                                                  async::Sender<char> ticks) {
  const std::vector<std::size_t> pieces = pieces_in_expected_order();
  std::vector<offload::SubGroup> groups;
  for (std::size_t i : pieces) groups.push_back(subgroups[i]);
  std::vector<bool> arrived(units.size(), false);
  const auto read_before = swapper->stats().bytes_read, written_before = swapper->stats().bytes_written;
  auto step_when_ready = [&](std::size_t j, std::span<std::byte> bytes) -> async::Task<Result<void>> {
    COSHARD_CO_TRY(co_await await_arrival(swap_pieces[pieces[j]].unit, ready, arrived, ticks));
    auto stepped = co_await step_swapped_piece(pieces[j], bytes, lr, comm->stream());
    tick(ticks);
    co_return stepped;
  };
  auto passed = co_await swapper->for_each(groups, step_when_ready, true);
  stats.swap_bytes += (swapper->stats().bytes_read - read_before) + (swapper->stats().bytes_written - written_before);
  co_return passed;
}

async::Task<Result<void>> Engine::State::swap_gradients_out(async::Receiver<std::size_t> ready, async::Sender<char> ticks) {
  const std::vector<std::size_t> pieces = pieces_in_expected_order();
  std::vector<offload::SubGroup> groups;
  for (std::size_t i : pieces) groups.push_back(grad_subgroups[i]);
  std::vector<bool> arrived(units.size(), false);
  const auto written_before = swapper->stats().bytes_written;
  // Each piece from the device shard into the buffer (after the unit's reduction, on the
  // communication stream), its statistics added on the host stream, then written behind.
  auto write_when_ready = [&](std::size_t j, std::span<std::byte> bytes) -> async::Task<Result<void>> {
    const SwapPiece& p = swap_pieces[pieces[j]];
    FetchUnit& u = *units[p.unit];
    COSHARD_CO_TRY(co_await await_arrival(p.unit, ready, arrived, ticks));
    if (!u.grad_shard) co_return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " has no gradient shard to swap out");
    const Tensor piece(bytes.data(), Shape{p.count}, DataType::f32, async::Device::cpu());
    COSHARD_CO_TRY(take_gradient_piece(u, p, piece));
    // (the buffer is written, then reused, only once the statistics have read it)
    COSHARD_CO_TRY_ASSIGN(auto added, host_stream->record());
    COSHARD_CO_TRY(co_await added);
    tick(ticks);
    co_return Result<void>{};
  };
  auto written = co_await swapper->initialize(groups, write_when_ready);
  stats.swap_bytes += swapper->stats().bytes_written - written_before;
  co_return written;
}

async::Task<void> Engine::end_swap_pass() {
  State& s = *s_;
  if (s.swap_step.valid()) {
    // The step failed before the swapper's pass was awaited: with the channel closed, the pass
    // stops at the first unit not handed over, and its transfers finish before the state goes.
    s.grads_ready.reset();
    auto handle = std::move(s.swap_step);
    (void)co_await handle;  // (its error, if any, follows from the step's)
  }
  s.grads_ready.reset();
  s.pass_ticks.reset();
}

// A unit's gradient shard reduced during a step whose shards leave during backward: to pinned
// memory (unless a pass of the swapper takes it from the device), then stepped on the host or
// handed to the pass once its last backward of the step is done.
Result<void> Engine::State::shard_reduced(FetchUnit& u) {
  auto& cs = comm->stream();
  // (a unit with two backward passes is copied again: the last copy wins; through a pass of the
  // swapper, the shard stays on the device until the pass steps it or swaps it out)
  const bool copied_out = !grads_wait_for_a_pass();
  if (copied_out) {
    COSHARD_TRY(cs.copy(u.host_grad.data(), u.grad_shard.data(), u.grad_shard.bytes()));
    stats.swap_bytes += u.grad_shard.bytes();
  }
  u.grads_out = true;
  const bool last = u.backwards_this_step == u.forward_uses;
  if (stepping_in_backward && last) COSHARD_TRY(step_on_host(u));
  if (grads_to_nvme() && last) COSHARD_TRY(hand_to_swap_step(u));  // to the pass writing it out
  if (copied_out && last) {  // its last of the step: back once the copy has passed
    COSHARD_TRY_ASSIGN(auto out, cs.record());
    u.grad_shard_block.reset_after(out);
    u.grad_shard = {};
  }
  return {};
}

}  // namespace coshard::zero
