// Kernels of the Local backend on device memory (rules in local_kernels.cuh).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "local_kernels.cuh"

namespace coshard::collectives::cuda {
namespace {

constexpr int kThreads = 256;
// Enough blocks in flight to fill any current GPU; the loops stride over the rest.
constexpr unsigned kMaxBlocks = 4096;

enum : int { kF32 = 0, kF64 = 1, kF16 = 2, kBF16 = 3, kI32 = 4, kU8 = 5 };
enum : int { kSum = 0, kAvg = 1, kMax = 2, kMin = 3 };

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

unsigned blocks_for(std::uint64_t items, unsigned share) {
  const std::uint64_t want = (items + kThreads - 1) / kThreads;
  const std::uint64_t cap = share == 0 ? 1 : (kMaxBlocks + share - 1) / share;
  return static_cast<unsigned>(want < 1 ? 1 : (want > cap ? cap : want));
}

// Copies `bytes` with the widest access all three of src, dst and bytes are aligned to.
__device__ __forceinline__ void copy_block(unsigned char* dst, const unsigned char* src, std::uint64_t bytes,
                                           std::uint64_t first, std::uint64_t stride) {
  const auto bits = reinterpret_cast<std::uintptr_t>(dst) | reinterpret_cast<std::uintptr_t>(src) | bytes;
  if ((bits & 15u) == 0) {
    auto* d = reinterpret_cast<uint4*>(dst);
    const auto* s = reinterpret_cast<const uint4*>(src);
    for (std::uint64_t i = first; i < bytes / 16; i += stride) d[i] = s[i];
  } else if ((bits & 3u) == 0) {
    auto* d = reinterpret_cast<unsigned*>(dst);
    const auto* s = reinterpret_cast<const unsigned*>(src);
    for (std::uint64_t i = first; i < bytes / 4; i += stride) d[i] = s[i];
  } else {
    for (std::uint64_t i = first; i < bytes; i += stride) dst[i] = src[i];
  }
}

// blockIdx.y = p * world + q: the block of rank q landing in rank p's output.
__global__ void all_gather_kernel(RankBuffers b, int world, std::uint64_t bytes) {
  const int p = static_cast<int>(blockIdx.y) / world, q = static_cast<int>(blockIdx.y) % world;
  auto* dst = static_cast<unsigned char*>(b.recv[p]) + static_cast<std::uint64_t>(q) * bytes;
  const auto* src = static_cast<const unsigned char*>(b.send[q]);
  if (dst == src) return;
  copy_block(dst, src, bytes, blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x,
             static_cast<std::uint64_t>(blockDim.x) * gridDim.x);
}

// Rank p's block q comes from rank q's block p.
__global__ void all_to_all_kernel(RankBuffers b, int world, std::uint64_t bytes) {
  const int p = static_cast<int>(blockIdx.y) / world, q = static_cast<int>(blockIdx.y) % world;
  auto* dst = static_cast<unsigned char*>(b.recv[p]) + static_cast<std::uint64_t>(q) * bytes;
  const auto* src = static_cast<const unsigned char*>(b.send[q]) + static_cast<std::uint64_t>(p) * bytes;
  copy_block(dst, src, bytes, blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x,
             static_cast<std::uint64_t>(blockDim.x) * gridDim.x);
}

__global__ void broadcast_kernel(RankBuffers b, int root, std::uint64_t bytes) {
  auto* dst = static_cast<unsigned char*>(b.recv[blockIdx.y]);
  const auto* src = static_cast<const unsigned char*>(b.send[root]);
  if (dst == src) return;
  copy_block(dst, src, bytes, blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x,
             static_cast<std::uint64_t>(blockDim.x) * gridDim.x);
}

// Storage type T, accumulator Acc, and the conversions between them.
template <class T, class Acc>
struct Same {
  __device__ static Acc load(T v) { return static_cast<Acc>(v); }
  __device__ static T store(Acc v) { return static_cast<T>(v); }
};
struct Half {
  __device__ static float load(__half v) { return __half2float(v); }
  __device__ static __half store(float v) { return __float2half_rn(v); }
};
struct BFloat {
  __device__ static float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  __device__ static __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};
struct I32 {
  __device__ static long long load(int v) { return v; }
  __device__ static int store(long long v) { return static_cast<int>(static_cast<unsigned>(v)); }
};
struct U8 {
  __device__ static unsigned load(unsigned char v) { return v; }
  __device__ static unsigned char store(unsigned v) { return static_cast<unsigned char>(v); }
};

template <int Op, class Acc>
__device__ __forceinline__ Acc combine(Acc a, Acc b) {
  if constexpr (Op == kMax) return a < b ? b : a;
  else if constexpr (Op == kMin) return b < a ? b : a;
  else return static_cast<Acc>(a + b);
}

// Element `at` of every rank's send buffer, reduced in rank order.
template <class T, class Acc, class Conv, int Op>
__device__ __forceinline__ T reduce_at(const RankBuffers& b, int world, std::uint64_t at) {
  Acc acc = Conv::load(static_cast<const T*>(b.send[0])[at]);
  for (int q = 1; q < world; ++q) acc = combine<Op, Acc>(acc, Conv::load(static_cast<const T*>(b.send[q])[at]));
  if constexpr (Op == kAvg) acc = static_cast<Acc>(acc / static_cast<Acc>(world));
  return Conv::store(acc);
}

// blockIdx.y = p: rank p's block of the reduction.
template <class T, class Acc, class Conv, int Op>
__global__ void reduce_scatter_kernel(RankBuffers b, int world, std::uint64_t count) {
  const int p = static_cast<int>(blockIdx.y);
  T* out = static_cast<T*>(b.recv[p]);
  const std::uint64_t base = static_cast<std::uint64_t>(p) * count;
  for (std::uint64_t j = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; j < count;
       j += static_cast<std::uint64_t>(blockDim.x) * gridDim.x) {
    out[j] = reduce_at<T, Acc, Conv, Op>(b, world, base + j);
  }
}

// Each element is reduced once and written to every rank (in place, send == recv, is safe: the
// thread that reads element j of every rank is the only one that writes it).
template <class T, class Acc, class Conv, int Op>
__global__ void all_reduce_kernel(RankBuffers b, int world, std::uint64_t count) {
  for (std::uint64_t j = blockIdx.x * static_cast<std::uint64_t>(blockDim.x) + threadIdx.x; j < count;
       j += static_cast<std::uint64_t>(blockDim.x) * gridDim.x) {
    const T v = reduce_at<T, Acc, Conv, Op>(b, world, j);
    for (int p = 0; p < world; ++p) static_cast<T*>(b.recv[p])[j] = v;
  }
}

// Runs launch.template operator()<T, Acc, Conv, Op>() for the dtype and op; cudaErrorInvalidValue
// for values outside the enums.
template <class Launch>
int dispatch(int dtype, int op, Launch&& launch) {
  auto with_op = [&]<class T, class Acc, class Conv>() -> int {
    switch (op) {
      case kSum: return launch.template operator()<T, Acc, Conv, kSum>();
      case kAvg: return launch.template operator()<T, Acc, Conv, kAvg>();
      case kMax: return launch.template operator()<T, Acc, Conv, kMax>();
      case kMin: return launch.template operator()<T, Acc, Conv, kMin>();
    }
    return cudaErrorInvalidValue;
  };
  switch (dtype) {
    case kF32: return with_op.template operator()<float, float, Same<float, float>>();
    case kF64: return with_op.template operator()<double, double, Same<double, double>>();
    case kF16: return with_op.template operator()<__half, float, Half>();
    case kBF16: return with_op.template operator()<__nv_bfloat16, float, BFloat>();
    case kI32: return with_op.template operator()<int, long long, I32>();
    case kU8: return with_op.template operator()<unsigned char, unsigned, U8>();
  }
  return cudaErrorInvalidValue;
}

int last_error() { return static_cast<int>(cudaGetLastError()); }

}  // namespace

int all_gather(void* stream, const RankBuffers& b, int world, std::uint64_t bytes) {
  if (bytes == 0) return cudaSuccess;
  const unsigned pairs = static_cast<unsigned>(world * world);
  const dim3 grid(blocks_for(bytes / 16 + 1, pairs), pairs);
  all_gather_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(b, world, bytes);
  return last_error();
}

int all_to_all(void* stream, const RankBuffers& b, int world, std::uint64_t bytes) {
  if (bytes == 0) return cudaSuccess;
  const unsigned pairs = static_cast<unsigned>(world * world);
  const dim3 grid(blocks_for(bytes / 16 + 1, pairs), pairs);
  all_to_all_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(b, world, bytes);
  return last_error();
}

int broadcast(void* stream, const RankBuffers& b, int world, int root, std::uint64_t bytes) {
  if (bytes == 0) return cudaSuccess;
  const dim3 grid(blocks_for(bytes / 16 + 1, static_cast<unsigned>(world)), static_cast<unsigned>(world));
  broadcast_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(b, root, bytes);
  return last_error();
}

int reduce_scatter(void* stream, const RankBuffers& b, int world, int dtype, int op, std::uint64_t count) {
  if (count == 0) return cudaSuccess;
  return dispatch(dtype, op, [&]<class T, class Acc, class Conv, int Op>() -> int {
    const dim3 grid(blocks_for(count, static_cast<unsigned>(world)), static_cast<unsigned>(world));
    reduce_scatter_kernel<T, Acc, Conv, Op><<<grid, kThreads, 0, as_stream(stream)>>>(b, world, count);
    return last_error();
  });
}

int all_reduce(void* stream, const RankBuffers& b, int world, int dtype, int op, std::uint64_t count) {
  if (count == 0) return cudaSuccess;
  return dispatch(dtype, op, [&]<class T, class Acc, class Conv, int Op>() -> int {
    all_reduce_kernel<T, Acc, Conv, Op><<<blocks_for(count, 1), kThreads, 0, as_stream(stream)>>>(b, world, count);
    return last_error();
  });
}

}  // namespace coshard::collectives::cuda
