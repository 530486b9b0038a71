// Enough of CUDA to run coshard's kernel files on the CPU, for tests of their logic on machines
// without a GPU (CI among them). translate.py rewrites a .cu file's launches (kernel<<<...>>>(...))
// and dynamic shared memory into calls of this header; include/ holds the toolkit's header names.
//
// What is emulated: a grid runs one block at a time, each block's threads as std::threads, with
// __syncthreads and __syncwarp as barriers and __shfl_xor_sync through the warp's slots; a
// kernel's static __shared__ arrays are statics (one block at a time shares them correctly);
// f16 and bf16 storage rounds to nearest even like the hardware's conversions; mma16816
// (modules/src/kernels/cuda/mma.cuh, PTX's mma.m16n8k16) exchanges the warp's registers through slots as
// the shuffles do, each lane computing its own accumulators from the register layouts PTX fixes.
// What is not: timing, memory-model subtleties beyond barriers, special-function precision
// (__expf is expf), and the order of atomics (one lock; blocks run in order, so sums that the GPU
// adds in any order come out in one).
#pragma once

// Kernel files choose their emulated forms of inline PTX by this (modules/src/kernels/cuda/mma.cuh).
#define COSHARD_CUDA_EMU 1

#include <barrier>
#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <math.h>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

struct dim3 {
  unsigned x = 1, y = 1, z = 1;
  dim3(unsigned x_ = 1, unsigned y_ = 1, unsigned z_ = 1) : x(x_), y(y_), z(z_) {}
};
struct alignas(16) uint4 {
  unsigned x, y, z, w;
};
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

inline thread_local dim3 threadIdx{0, 0, 0};  // NOLINT: CUDA's names
inline thread_local dim3 blockIdx{0, 0, 0};
inline dim3 blockDim;
inline dim3 gridDim;

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __align__(n) alignas(n)
#define __shared__ static
#define __restrict__ __restrict

enum cudaError_t { cudaSuccess = 0, cudaErrorInvalidValue = 1 };
using cudaStream_t = void*;
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize };
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
template <class Kernel>
cudaError_t cudaFuncSetAttribute(Kernel, cudaFuncAttribute, int) {
  return cudaSuccess;
}

// ---- f16 and bf16 storage ----

struct __half {
  std::uint16_t bits;
};
struct __nv_bfloat16 {
  std::uint16_t bits;
};

inline __half __float2half_rn(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  const auto sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  const std::uint32_t exp = (x >> 23) & 0xffu, mant = x & 0x7fffffu;
  if (exp == 0xffu) return {static_cast<std::uint16_t>(sign | 0x7c00u | (mant ? 0x200u : 0u))};
  const int e = static_cast<int>(exp) - 127 + 15;
  if (e >= 31) return {static_cast<std::uint16_t>(sign | 0x7c00u)};
  if (e <= 0) {  // a subnormal half, or zero
    if (e < -10) return {sign};
    const std::uint32_t m = mant | 0x800000u;
    const int shift = 14 - e;
    std::uint32_t h = m >> shift;
    const std::uint32_t rem = m & ((1u << shift) - 1), halfway = 1u << (shift - 1);
    if (rem > halfway || (rem == halfway && (h & 1u))) ++h;
    return {static_cast<std::uint16_t>(sign | h)};
  }
  std::uint32_t h = (static_cast<std::uint32_t>(e) << 10) | (mant >> 13);
  const std::uint32_t rem = mant & 0x1fffu;
  if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;  // a carry into the exponent is right
  return {static_cast<std::uint16_t>(sign | h)};
}
inline float __half2float(__half h) {
  const std::uint32_t sign = (h.bits & 0x8000u) << 16, exp = (h.bits >> 10) & 0x1fu, mant = h.bits & 0x3ffu;
  if (exp == 0) {
    const float v = std::ldexp(static_cast<float>(mant), -24);
    return sign ? -v : v;
  }
  if (exp == 31) return std::bit_cast<float>(sign | 0x7f800000u | (mant << 13));
  return std::bit_cast<float>(sign | ((exp + 112) << 23) | (mant << 13));
}
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const std::uint32_t x = std::bit_cast<std::uint32_t>(f);
  if (std::isnan(f)) return {static_cast<std::uint16_t>(((x >> 16) & 0x8000u) | 0x7fc0u)};
  return {static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16)};
}
inline float __bfloat162float(__nv_bfloat16 b) {
  return std::bit_cast<float>(static_cast<std::uint32_t>(b.bits) << 16);
}

inline unsigned short __half_as_ushort(__half h) { return h.bits; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 b) { return b.bits; }

// A storage type's value as f32, and an f32 rounded to a storage type.
inline float emu_to_float(float v) { return v; }
inline float emu_to_float(__half v) { return __half2float(v); }
inline float emu_to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
template <class T>
T emu_from_float(float v) {
  if constexpr (std::is_same_v<T, __half>)
    return __float2half_rn(v);
  else if constexpr (std::is_same_v<T, __nv_bfloat16>)
    return __float2bfloat16_rn(v);
  else
    return v;
}

inline float __expf(float x) { return std::exp(x); }
inline float __int_as_float(int x) { return std::bit_cast<float>(x); }
// CUDA's explicitly rounded operations (never contracted: std::fma for the fused one).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline float __fsqrt_rn(float a) { return std::sqrt(a); }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline std::int64_t min(std::int64_t a, std::int64_t b) { return a < b ? a : b; }
inline std::int64_t max(std::int64_t a, std::int64_t b) { return a > b ? a : b; }

// ---- blocks, warps and launches ----

namespace emu {

struct Block {
  unsigned threads = 0;
  std::unique_ptr<std::barrier<>> all;
  std::vector<std::unique_ptr<std::barrier<>>> warps;
  std::vector<float> slots;  // two sets of one per thread, for shuffles
  std::vector<std::uint32_t> mma_slots;  // two sets of six per thread (a[4], b[2]), for mma16816
  std::vector<std::byte> dynamic_shared;
};
inline Block* current = nullptr;  // blocks run one at a time
inline thread_local unsigned flat_thread = 0;
inline thread_local unsigned shuffle_set = 0;  // which set of slots the next shuffle uses
inline thread_local unsigned mma_set = 0;      // likewise for mma16816

inline unsigned lane() { return flat_thread % 32; }
inline std::barrier<>& warp_barrier() { return *current->warps[flat_thread / 32]; }

// Runs body in every thread of every block of the grid: one std::thread per thread of a block,
// going through the blocks in order with a barrier between them (so a block's statics and
// shared memory are the next one's only after every thread is done with them).
template <class Body>
void run_grid(dim3 grid, dim3 block, std::size_t shared_bytes, Body& body) {
  gridDim = grid;
  blockDim = block;
  const unsigned n = block.x * block.y * block.z;
  Block b;
  b.threads = n;
  b.all = std::make_unique<std::barrier<>>(static_cast<std::ptrdiff_t>(n));
  for (unsigned w = 0; w * 32 < n; ++w)
    b.warps.push_back(std::make_unique<std::barrier<>>(static_cast<std::ptrdiff_t>(std::min(32u, n - w * 32))));
  b.slots.assign(2 * static_cast<std::size_t>(n), 0.0f);
  b.mma_slots.assign(2 * 6 * static_cast<std::size_t>(n), 0u);
  b.dynamic_shared.assign(shared_bytes + 128, std::byte{0});  // aligned to 128 by emu_dynamic_shared
  current = &b;
  std::vector<std::thread> threads;
  threads.reserve(n);
  for (unsigned t = 0; t < n; ++t)
    threads.emplace_back([&, t] {
      threadIdx = dim3(t % block.x, (t / block.x) % block.y, t / (block.x * block.y));
      flat_thread = t;
      shuffle_set = 0;
      mma_set = 0;
      for (unsigned bz = 0; bz < grid.z; ++bz)
        for (unsigned by = 0; by < grid.y; ++by)
          for (unsigned bx = 0; bx < grid.x; ++bx) {
            blockIdx = dim3(bx, by, bz);
            body();
            b.all->arrive_and_wait();
          }
    });
  for (auto& th : threads) th.join();
  current = nullptr;
}

template <class Kernel>
struct Launch {
  Kernel kernel;
  dim3 grid, block;
  std::size_t shared_bytes;
  template <class... Args>
  void operator()(Args... args) const {
    auto body = [&] { kernel(args...); };
    run_grid(grid, block, shared_bytes, body);
  }
};

template <class Kernel>
Launch<Kernel> launch(Kernel kernel, dim3 grid, dim3 block, std::size_t shared_bytes = 0, void* /*stream*/ = nullptr) {
  return {kernel, grid, block, shared_bytes};
}

}  // namespace emu

// The dynamic shared memory of the running block, 128-byte aligned.
inline unsigned char* emu_dynamic_shared() {
  auto p = reinterpret_cast<std::uintptr_t>(emu::current->dynamic_shared.data());
  return reinterpret_cast<unsigned char*>((p + 127) / 128 * 128);
}

inline void __syncthreads() { emu::current->all->arrive_and_wait(); }
inline void __syncwarp(unsigned /*mask*/ = 0xffffffffu) { emu::warp_barrier().arrive_and_wait(); }
// Two sets of slots, used in turn: a lane writes one set while a slower lane may still read the
// other, and the barrier of the shuffle between guarantees every lane is done with a set before
// it is written again. One barrier a shuffle.
inline float __shfl_xor_sync(unsigned /*mask*/, float v, int offset) {
  const unsigned n = emu::current->threads, set = emu::shuffle_set ^= 1u;
  float* slots = emu::current->slots.data() + set * n;
  slots[emu::flat_thread] = v;
  emu::warp_barrier().arrive_and_wait();
  const unsigned base = emu::flat_thread & ~31u;
  return slots[base | ((emu::flat_thread & 31u) ^ static_cast<unsigned>(offset))];
}

// mma.m16n8k16 with f32 accumulators over E (bf16 or f16) operands: every lane posts its a[4] and
// b[2], then computes its own d[0..3] from the whole warp's (the register layouts of mma.cuh).
// Products and sums in f32, in k order (the hardware's order is its own: tests allow rounding).
namespace emu {
template <class E>
void mma16816(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  const unsigned n = current->threads, set = mma_set ^= 1u;
  std::uint32_t* slots = current->mma_slots.data() + static_cast<std::size_t>(set) * 6 * n;
  std::uint32_t* mine = slots + 6 * static_cast<std::size_t>(flat_thread);
  for (int i = 0; i < 4; ++i) mine[i] = a[i];
  mine[4] = b[0];
  mine[5] = b[1];
  warp_barrier().arrive_and_wait();
  const unsigned base = flat_thread & ~31u, lane = flat_thread & 31u, g = lane / 4, t = lane % 4;
  auto half = [&](unsigned from_lane, int reg, int high) {
    const std::uint32_t w = slots[6 * static_cast<std::size_t>(base + from_lane) + static_cast<unsigned>(reg)];
    return emu_to_float(E{static_cast<std::uint16_t>(high ? w >> 16 : w & 0xffffu)});
  };
  auto A = [&](unsigned r, unsigned k) {
    return half((r % 8) * 4 + (k % 8) / 2, (r >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0), static_cast<int>(k % 2));
  };
  auto B = [&](unsigned k, unsigned c) { return half(c * 4 + (k % 8) / 2, 4 + (k >= 8 ? 1 : 0), static_cast<int>(k % 2)); };
  for (unsigned q = 0; q < 4; ++q) {
    const unsigned r = g + (q >= 2 ? 8 : 0), c = 2 * t + q % 2;
    float s = d[q];
    for (unsigned k = 0; k < 16; ++k) s += A(r, k) * B(k, c);
    d[q] = s;
  }
}
}  // namespace emu

// ---- atomics: one lock for all (a block's threads run at once; its blocks, in order) ----

namespace emu {
inline std::mutex atomics;
}
template <class T>
T atomicAdd(T* p, T v) {
  std::lock_guard lock(emu::atomics);
  const T old = *p;
  *p = emu_from_float<T>(emu_to_float(old) + emu_to_float(v));
  return old;
}

