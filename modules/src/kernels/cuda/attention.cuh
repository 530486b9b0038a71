// Fused causal attention for CUDA (flash-style: tiles of queries and keys in shared memory, an
// online softmax, tensor-core products through PTX mma.m16n8k16 with f32 accumulation), so no T x T matrix
// exists in device memory. Forward keeps one f32 per query row (the log-sum-exp of its scaled
// scores); backward recomputes the probabilities tile by tile from it.
//
// Layout as Kernels::attention_forward: qkv [B, T, (H + 2 KVH) * hd] (query heads, then key
// heads, then value heads), out [B, T, H * hd]; query head h reads key/value head h / (H / KVH).
// Backward is deterministic (no atomics): one kernel gives each key/value tile its dK and dV,
// summing over the group's query heads in order, another gives each query tile its dQ.
// Launchers return the cudaError_t of the launch as an int; `dt` as in kernels.cuh.
#pragma once

#include <cstdint>

namespace coshard::modules::cuda {

// Whether the fused kernels serve this dtype and head size (bf16/f16; hd 32, 64, 96 or 128).
bool flash_attention_supported(int dt, std::int64_t hd);

// lse [B, H, T] f32.
int flash_attention_forward(void* stream, int dt, const void* qkv, void* out, float* lse, std::int64_t B,
                            std::int64_t T, std::int64_t H, std::int64_t KVH, std::int64_t hd);
// Overwrites dqkv; `delta` is scratch of B * H * T f32 (rowsum(dout * out) per query row).
int flash_attention_backward(void* stream, int dt, const void* dout, const void* qkv, const void* out,
                             const float* lse, void* dqkv, float* delta, std::int64_t B, std::int64_t T,
                             std::int64_t H, std::int64_t KVH, std::int64_t hd);

}  // namespace coshard::modules::cuda
