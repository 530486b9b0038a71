// One stream after another, on the device: what the engine's parts use to order their streams
// without the host waiting. Private: not installed.
#pragma once

#include "coshard/async/stream.hpp"

namespace coshard::zero::detail {

// `to` after everything enqueued on `from` so far.
inline Result<void> order(async::Stream& from, async::Stream& to) {
  COSHARD_TRY_ASSIGN(auto ev, from.record());
  return to.wait(ev);
}

}  // namespace coshard::zero::detail
