// One stream after another, on the device: what the engine's parts use to order their streams
// without the host waiting. Private: not installed.
#pragma once

#include "coshard/async/stream.hpp"
#include "coshard/async/task.hpp"

namespace coshard::zero::detail {

// `to` after everything enqueued on `from` so far.
inline Result<void> order(async::Stream& from, async::Stream& to) {
  COSHARD_TRY_ASSIGN(auto ev, from.record());
  return to.wait(ev);
}

// `later` runs after `event` of another stream: device-side when it can wait on it (a CPU stream
// can wait on anything; a CUDA stream only on CUDA events), else the host awaits it.
inline async::Task<Result<void>> after(async::Stream& later, async::Event event) {
  if (later.device().is_cpu() || event.device().is_cuda()) co_return later.wait(event);
  co_return co_await event;
}

}  // namespace coshard::zero::detail
