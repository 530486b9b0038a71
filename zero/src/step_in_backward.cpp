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

Result<void> Engine::State::step_on_host(Unit& u) {
  COSHARD_TRY_ASSIGN(auto out, comm->stream().record());
  COSHARD_TRY(host_stream->wait(out));
  if (!grads_through_pass()) COSHARD_TRY(optimizer->add_grad_stats(*host_ctx, first_group + u.index));
  COSHARD_TRY(optimizer_placement->step_in_backward(*this, u));
  u.stepped_early = true;
  ++stats.stepped_in_backward;
  return {};
}

Result<void> Engine::State::hand_to_swap_step(Unit& u) {
  std::size_t index = u.index;
  if (grads_through_pass() && !u.grad_pending) {
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

async::Task<Result<void>> Engine::State::wait_for_the_pass(const Unit& u) {
  if (!stepping_in_backward || !grads_through_pass() || !pass_ticks || u.info.frozen) co_return Result<void>{};
  const std::size_t bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);
  while (grads_pending_bytes > 0 && grads_pending_bytes + bytes > grads_pending_limit && !pass_awaits_arrival) {
    auto tick = co_await pass_ticks->recv();
    if (!tick) break;  // the pass has ended (its error, if any, comes with the step)
  }
  co_return Result<void>{};
}

async::Task<Result<void>> Engine::State::swapped_step_in_backward(async::Receiver<std::size_t> ready, float lr,
                                                                  async::Sender<char> ticks) {
  std::vector<std::size_t> order = backward_order;  // units
  std::vector<std::size_t> trained;
  for (std::size_t k = 0; k < units.size(); ++k)
    if (!units[k]->info.frozen) trained.push_back(k);
  if (order.size() != trained.size()) order.assign(trained.rbegin(), trained.rend());  // no step yet: backward goes roughly in reverse
  std::vector<std::size_t> pieces;  // each unit's sub-groups in turn
  for (std::size_t k : order)
    for (std::size_t i = first_piece[k]; i < first_piece[k + 1]; ++i) pieces.push_back(i);
  std::vector<offload::SubGroup> groups;
  for (std::size_t i : pieces) groups.push_back(subgroups[i]);
  std::vector<bool> arrived(units.size(), false);
  const auto read_before = swapper->stats().bytes_read, written_before = swapper->stats().bytes_written;
  auto step_when_ready = [&](std::size_t j, std::span<std::byte> bytes) -> async::Task<Result<void>> {
    const std::size_t k = swap_pieces[pieces[j]].unit;
    auto tick = [&ticks] {  // (one pending is enough: the waiter looks again)
      char t = 't';
      (void)ticks.try_send(t);
    };
    if (!arrived[k]) {
      pass_awaits_arrival = true;
      tick();
    }
    while (!arrived[k]) {
      auto next = co_await ready.recv();
      if (!next) {
        pass_awaits_arrival = false;
        co_return fail(ErrorCode::closed, "step_in_backward: the step ended before unit ", units[k]->info.name,
                       " was stepped");
      }
      arrived.at(*next) = true;
    }
    pass_awaits_arrival = false;
    auto stepped = co_await step_swapped_piece(pieces[j], bytes, lr, comm->stream());
    tick();
    co_return stepped;
  };
  auto passed = co_await swapper->for_each(groups, step_when_ready, true);
  stats.swap_bytes += (swapper->stats().bytes_read - read_before) + (swapper->stats().bytes_written - written_before);
  co_return passed;
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

}  // namespace coshard::zero
