// A layer's collective ordered within the compute stream's work (tensor parallelism's sums and
// gathers, expert parallelism's exchanges): enqueued on the group's stream after what the compute
// stream holds, and the compute stream's next work after its event, through the context's hooks
// (an engine times that wait). The host never waits. Private to the layers.
#pragma once

#include <string>

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/module.hpp"

namespace coshard::modules::detail {

// `launch()` enqueues the collective on `group` and returns its event. `purpose` names it in
// errors, the flight recorder and the timeline, and must outlive the step.
template <class Launch>
Result<void> collective_between(Context& ctx, collectives::Communicator& group, const std::string& purpose,
                                Launch launch) {
  COSHARD_TRY_ASSIGN(const auto ready, ctx.stream().record());
  COSHARD_TRY(group.stream().wait(ready));
  COSHARD_TRY_ASSIGN(const auto done, launch());
  if (ModuleHooks* hooks = ctx.hooks()) return hooks->wait_for_collective(ctx, done, purpose);
  return ctx.stream().wait(done);
}

}  // namespace coshard::modules::detail
