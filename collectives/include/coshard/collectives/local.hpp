// The Local backend: the ranks are threads of one process, sharing CPU memory (or one GPU).
//
// Each rank's communicator has its own CPU communication stream. A launched group becomes one
// closure on that stream which
//   1. posts the group's buffers and arrives at the group's rendezvous,
//   2. checks that every rank launched the same group (a mismatch fails every rank at once),
//   3. does this rank's share of the work: all_gather and broadcast pull the blocks this rank
//      receives; reduce_scatter reduces this rank's block; all_reduce reduces a 1/size slice
//      and writes it to every rank. Each element is reduced exactly once, in rank order 0..n-1,
//      so all ranks get bit-identical results whatever the world size,
//   4. waits at the rendezvous again, so nobody reuses its buffers while others still read them.
// A rank that does not arrive within `timeout` breaks the group: every waiting rank fails with
// ErrorCode::timeout naming the missing ranks, and every later collective fails at once.
//
// On a GPU (LocalOptions::device = cuda:N): the ranks share one GPU, their buffers are device,
// managed or pinned host memory, and each communicator's stream is a CUDA stream. launch() is a
// meeting of the ranks' host threads (never a wait for the device): the last rank to launch a
// group checks it and enqueues one kernel per collective that does every rank's part, ordered
// after every rank's stream position at its launch; each rank's stream is ordered after that
// kernel. Reductions combine ranks in order 0..n-1 with the CPU arithmetic, so results are
// bit-identical to the CPU backend's. So each rank must launch from its own thread (as the ranks
// of a real job do); a rank missing for `timeout` makes the others' launch() fail with
// ErrorCode::timeout naming it, and buffers the device cannot read are refused with a message.
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "coshard/async/device.hpp"
#include "coshard/async/result.hpp"
#include "coshard/collectives/communicator.hpp"

namespace coshard::collectives {

struct LocalOptions {
  // Where the ranks' buffers live: the CPU, or one CUDA device that every rank shares.
  async::Device device = async::Device::cpu();
  // How long a rank waits for the others at a rendezvous before the group is broken.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // How long a waiting rank spins before sleeping (each hand-off by futex costs ~25 µs here).
  std::chrono::microseconds spin{std::chrono::microseconds(50)};
};

// The communicators of `world_size` ranks; element r belongs to rank r. Each is used from its
// own thread (or task); their streams run the collectives.
Result<std::vector<std::unique_ptr<Communicator>>> make_local_communicators(int world_size, LocalOptions options = {});

}  // namespace coshard::collectives
