// Causal self-attention on bf16/f16 operands where the CPU multiplies them natively (private):
// the four products of a head through oneDNN (half_gemm, the batch's matrices in one call), the
// softmax and its backward in f32 on a head's scores at a time. No f32 copy of the whole
// activations and no OpenBLAS call, whose idle workers would otherwise spin beside oneDNN's.
#pragma once

#include <cstdint>

#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

// Whether attention runs here for dt: bf16 where its products are native. (f16's, native only
// with AMX, would take f16 operands into f32 results, which no machine here has shown oneDNN
// to have kernels for: f16 attention stays on the f32 copies.)
bool native_half_attention(DataType dt) noexcept;

// As attention_fwd (attention.hpp): qkv rows of W = (H + 2 KVH) hd, out B x T x H hd, probs
// B x H x T x T (the softmax rounded once to dt, what the product with V reads and the backward
// keeps). Only where native_half_products(dt).
Result<void> attention_fwd_half(DataType dt, const void* qkv, void* out, void* probs, std::int64_t B, std::int64_t T,
                                std::int64_t H, std::int64_t KVH, std::int64_t hd) noexcept;

// As attention_bwd: dqkv wholly written (dQ rounded once; each key/value head's dK and dV summed
// over its query heads in f32 and rounded once), scratch (B x H x T x T of dt) holding dS.
Result<void> attention_bwd_half(DataType dt, const void* dout, const void* qkv, const void* probs, void* dqkv,
                                void* scratch, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH,
                                std::int64_t hd) noexcept;

}  // namespace coshard::modules::detail
