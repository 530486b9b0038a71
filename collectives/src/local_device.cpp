// The Local backend's device half (rules in local_device.hpp): host code against the CUDA runtime.
#include "local_device.hpp"

#include <cuda_runtime.h>

#include <cstddef>
#include <span>
#include <string>

#include "cuda/local_kernels.cuh"

namespace coshard::collectives::detail {
namespace {

Unexpected cuda_error(cudaError_t e, std::string_view what) {
  return fail(ErrorCode::device, what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")");
}

// Every rank's blocks as copies on one stream (the ranks share the GPU): rank r's block from q
// is what q sends to r.
Result<void> all_to_allv_on_device(void* s, std::span<const CollectiveOp* const> per_rank) {
  const std::size_t n = per_rank.size(), es = size_of(per_rank[0]->dtype);
  for (std::size_t r = 0; r < n; ++r) {
    std::size_t at = 0;
    for (std::size_t q = 0; q < n; ++q) {
      const std::size_t from = per_rank[q]->send_offset(r);
      const std::size_t bytes = per_rank[r]->counts[n + q] * es;
      if (bytes > 0) {
        const auto e = cudaMemcpyAsync(static_cast<std::byte*>(per_rank[r]->recv) + at * es,
                                       static_cast<const std::byte*>(per_rank[q]->send) + from * es, bytes,
                                       cudaMemcpyDefault, static_cast<cudaStream_t>(s));
        if (e != cudaSuccess) return cuda_error(e, "cudaMemcpyAsync for " + per_rank[0]->signature());
      }
      at += per_rank[r]->counts[n + q];
    }
  }
  return {};
}

}  // namespace

Result<void> check_local_device(async::Device device, int world_size) {
  if (!device.is_cuda()) return fail(ErrorCode::invalid_argument, device.to_string(), " is not a CUDA device");
  const int visible = async::cuda_device_count();
  if (device.index() < 0 || device.index() >= visible) {
    return fail(ErrorCode::device, "make_local_communicators on ", device.to_string(), ": not a visible CUDA device (",
                visible, " visible)");
  }
  if (world_size > cuda::kMaxRanks) {
    return fail(ErrorCode::invalid_argument, "make_local_communicators(world_size=", world_size, ") on ",
                device.to_string(), ": at most ", cuda::kMaxRanks, " ranks can share one GPU");
  }
  return {};
}

Result<void> check_device_buffer(async::Device device, const void* p, std::size_t bytes, std::string_view what,
                                 int rank, const CollectiveOp& op) {
  if (bytes == 0) return {};
  cudaPointerAttributes attributes{};
  if (auto e = cudaPointerGetAttributes(&attributes, p); e != cudaSuccess) {
    (void)cudaGetLastError();  // not sticky; clear it
    return cuda_error(e, "cudaPointerGetAttributes");
  }
  const bool reachable = attributes.type == cudaMemoryTypeManaged || attributes.type == cudaMemoryTypeHost ||
                         (attributes.type == cudaMemoryTypeDevice && attributes.device == device.index());
  if (reachable) return {};
  const std::string where = attributes.type == cudaMemoryTypeDevice
                                ? "memory of cuda:" + std::to_string(attributes.device)
                                : std::string("pageable host memory");
  return fail(ErrorCode::invalid_argument, "Local backend on ", device.to_string(), ": the ", what, " buffer of ",
              op.signature(), " on rank ", rank, " is ", where, ", which this device cannot use; pass device, ",
              "managed or pinned host memory");
}

Result<void> enqueue_on_device(async::Stream& stream, std::span<const CollectiveOp* const> per_rank) {
  const int world = static_cast<int>(per_rank.size());
  const CollectiveOp& first = *per_rank[0];
  const std::uint64_t es = size_of(first.dtype);
  cuda::RankBuffers buffers{};
  for (int q = 0; q < world; ++q) {
    buffers.send[q] = per_rank[static_cast<std::size_t>(q)]->send;
    buffers.recv[q] = per_rank[static_cast<std::size_t>(q)]->recv;
  }
  if (auto e = cudaSetDevice(stream.device().index()); e != cudaSuccess) return cuda_error(e, "cudaSetDevice");
  void* s = stream.native_handle();
  if (first.kind == CollectiveKind::all_to_allv) return all_to_allv_on_device(s, per_rank);
  int launched = cudaSuccess;
  switch (first.kind) {
    case CollectiveKind::barrier:
    case CollectiveKind::all_to_allv: return {};
    case CollectiveKind::all_gather: launched = cuda::all_gather(s, buffers, world, first.count * es); break;
    case CollectiveKind::all_to_all: launched = cuda::all_to_all(s, buffers, world, first.count * es); break;
    case CollectiveKind::broadcast: launched = cuda::broadcast(s, buffers, world, first.root, first.count * es); break;
    case CollectiveKind::reduce_scatter:
      launched = cuda::reduce_scatter(s, buffers, world, static_cast<int>(first.dtype), static_cast<int>(first.op),
                                      first.count);
      break;
    case CollectiveKind::all_reduce:
      launched = cuda::all_reduce(s, buffers, world, static_cast<int>(first.dtype), static_cast<int>(first.op),
                                  first.count);
      break;
  }
  if (launched != cudaSuccess) {
    return cuda_error(static_cast<cudaError_t>(launched), "Local backend kernel for " + first.signature() + " on '" +
                                                              stream.name() + "'");
  }
  return {};
}

}  // namespace coshard::collectives::detail
