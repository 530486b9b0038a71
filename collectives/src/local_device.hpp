// The Local backend's device half (private): ranks that share one GPU. local.cpp does the host
// rendezvous; this enqueues the kernels that do every rank's part of a collective at once.
// Defined by local_device.cpp (CUDA builds) or no_local_device.cpp.
#pragma once

#include <span>

#include "coshard/async/device.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/collectives/communicator.hpp"

namespace coshard::collectives::detail {

// Whether `world_size` ranks can share `device` (a visible CUDA device, a supported size).
Result<void> check_local_device(async::Device device, int world_size);

// Whether the device can reach `bytes` at `p` (device, managed or pinned host memory): the
// message names the buffer, its rank and the collective. Pageable host memory would fault the
// kernel and poison the whole context, so it is refused before anything is enqueued.
Result<void> check_device_buffer(async::Device device, const void* p, std::size_t bytes, std::string_view what,
                                 int rank, const CollectiveOp& op);

// Enqueues on `stream` the collective whose per-rank ops (element q is rank q's) are given: one
// kernel for every rank's part. The streams of the ranks must already be ordered before it.
Result<void> enqueue_on_device(async::Stream& stream, std::span<const CollectiveOp* const> per_rank);

}  // namespace coshard::collectives::detail
