// One warp's tensor-core product through PTX's mma.m16n8k16 (sm_80 and later), with the register
// layouts the PTX ISA fixes, so that a kernel can keep its tiles in registers and turn one
// product's accumulators into the next one's operand without going through shared memory (as
// FlashAttention-2 does). tests/cuda_emu emulates it on the CPU (COSHARD_CUDA_EMU).
//
// D += A B: A 16x16 (row-major), B 16x8 (column-major), D 16x8 in f32; with g = lane / 4 and
// t = lane % 4, each lane holds (every 32-bit register two elements, the lower index in its low
// half):
//   a[0] = A[g][2t, 2t+1]   a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]   b[1] = B[2t+8, 2t+9][g]
//   d[0], d[1] = D[g][2t], D[g][2t+1]                  d[2], d[3] = D[g+8][2t], D[g+8][2t+1]
// So the accumulators of two adjacent 16x8 products are, rounded and paired, the A operand of a
// 16x16 one: {pair(d_j[0], d_j[1]), pair(d_j[2], d_j[3]), pair(d_j+1[0], d_j+1[1]), pair(d_j+1[2], d_j+1[3])}.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace coshard::modules::cuda {

template <class E>
__device__ void mma16816(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]);

#ifdef COSHARD_CUDA_EMU
template <>
inline void mma16816<__nv_bfloat16>(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  emu::mma16816<__nv_bfloat16>(d, a, b);
}
template <>
inline void mma16816<__half>(float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2]) {
  emu::mma16816<__half>(d, a, b);
}
#else
template <>
__device__ __forceinline__ void mma16816<__nv_bfloat16>(float (&d)[4], const std::uint32_t (&a)[4],
                                                        const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <>
__device__ __forceinline__ void mma16816<__half>(float (&d)[4], const std::uint32_t (&a)[4],
                                                 const std::uint32_t (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
#endif

// lo and hi rounded to E (to nearest even) and paired in one register, lo in the low half.
template <class E>
__device__ __forceinline__ std::uint32_t pair(float lo, float hi);
template <>
__device__ __forceinline__ std::uint32_t pair<__nv_bfloat16>(float lo, float hi) {
  return static_cast<std::uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(lo))) |
         (static_cast<std::uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(hi))) << 16);
}
template <>
__device__ __forceinline__ std::uint32_t pair<__half>(float lo, float hi) {
  return static_cast<std::uint32_t>(__half_as_ushort(__float2half_rn(lo))) |
         (static_cast<std::uint32_t>(__half_as_ushort(__float2half_rn(hi))) << 16);
}

// Elements c and c + 1 of row r of a tile with row stride ld (c even, the row 4-byte aligned).
template <class E>
__device__ __forceinline__ std::uint32_t word(const E* tile, int r, int c, int ld) {
  return *reinterpret_cast<const std::uint32_t*>(tile + r * ld + c);
}

}  // namespace coshard::modules::cuda
