// Causal self-attention on native bf16/f16 products (attention_half.hpp). A head at a time, its
// B matrices in one oneDNN call each: the scores in f32, the softmax in f32 rounded once into
// probs, the product with V written in dt. The backward sums each key/value head's dK and dV over
// its query heads in f32 buffers (in head order, as the f32 kernel) and rounds them once.
#include "kernels/cpu/attention_half.hpp"

#include <algorithm>
#include <cmath>
#include <new>

#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/exp_approx.hpp"
#include "kernels/cpu/half_products.hpp"
#include "kernels/cpu/operands.hpp"
#include "kernels/cpu/parallel.hpp"
#include "kernels/half_convert.hpp"

namespace coshard::modules::detail {
namespace {

using Half = std::uint16_t;

// An f32 buffer of the calling thread's copies (operands.hpp), given back when it goes.
class F32Buffer {
 public:
  explicit F32Buffer(std::int64_t n) : buffer_(CopyBuffers::mine().take(static_cast<std::size_t>(std::max<std::int64_t>(n, 1)))) {}
  F32Buffer(const F32Buffer&) = delete;
  F32Buffer& operator=(const F32Buffer&) = delete;
  ~F32Buffer() { CopyBuffers::mine().give(std::move(buffer_)); }
  float* data() noexcept { return buffer_.values.get(); }

 private:
  CopyBuffers::Buffer buffer_;
};

Result<void> out_of_memory(const char* what, std::int64_t B, std::int64_t T, std::int64_t H) {
  return fail(ErrorCode::out_of_memory, "attention ", what, " (batch ", B, ", sequence ", T, ", ", H,
              " heads): out of host memory for its f32 buffers");
}

}  // namespace

bool native_half_attention(DataType dt) noexcept { return dt == DataType::bf16 && native_half_products(dt); }

Result<void> attention_fwd_half(DataType dt, const void* qkv_, void* out_, void* probs_, std::int64_t B, std::int64_t T,
                                std::int64_t H, std::int64_t KVH, std::int64_t hd) noexcept {
  const auto* qkv = static_cast<const Half*>(qkv_);
  auto* out = static_cast<Half*>(out_);
  auto* probs = static_cast<Half*>(probs_);
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, group = H / KVH, TT = T * T;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  try {
    F32Buffer scores(B * TT);
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t kv = C + (h / group) * hd;
      // S = scale Q K^T of this head in every batch row (f32).
      const GemmArgs s{.trans_b = true, .m = T, .n = T, .k = hd, .a = qkv + h * hd, .lda = W, .b = qkv + kv, .ldb = W,
                       .c = scores.data(), .ldc = T, .alpha = scale, .batch = B, .stride_a = T * W, .stride_b = T * W,
                       .stride_c = TT, .c_in_stat_dtype = true};
      COSHARD_TRY(half_gemm(dt, s));
      // Row i keeps columns 0..i: the softmax in f32 as the f32 kernel computes it, rounded once.
      float* sc = scores.data();
      parallel_rows(B * T, 2 * T, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t r = begin; r < end; ++r) {
          const std::int64_t b = r / T, i = r % T;
          float* row = sc + r * T;
          causal_softmax_row(row, i, T, [](float x) { return exp_approx(x); });
          narrow_half(dt, row, probs + (b * H + h) * TT + i * T, static_cast<std::size_t>(T));
        }
      });
      // O = P V into the head's columns of out.
      const GemmArgs o{.m = T, .n = hd, .k = T, .a = probs + h * TT, .lda = T, .b = qkv + kv + KVH * hd, .ldb = W,
                       .c = out + h * hd, .ldc = C, .batch = B, .stride_a = H * TT, .stride_b = T * W,
                       .stride_c = T * C};
      COSHARD_TRY(half_gemm(dt, o));
    }
    return {};
  } catch (const std::bad_alloc&) {
    return out_of_memory("forward", B, T, H);
  }
}

Result<void> attention_bwd_half(DataType dt, const void* dout_, const void* qkv_, const void* probs_, void* dqkv_,
                                void* scratch_, std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH,
                                std::int64_t hd) noexcept {
  const auto* dout = static_cast<const Half*>(dout_);
  const auto* qkv = static_cast<const Half*>(qkv_);
  const auto* probs = static_cast<const Half*>(probs_);
  auto* dqkv = static_cast<Half*>(dqkv_);
  auto* ds = static_cast<Half*>(scratch_);
  const std::int64_t W = (H + 2 * KVH) * hd, C = H * hd, group = H / KVH, TT = T * T;
  const float scale = static_cast<float>(1.0 / std::sqrt(static_cast<double>(hd)));
  try {
    F32Buffer dp(B * TT), dk(B * T * hd), dv(B * T * hd);
    for (std::int64_t j = 0; j < KVH; ++j) {
      const std::int64_t k_col = C + j * hd, v_col = C + KVH * hd + j * hd;
      for (std::int64_t h = j * group; h < (j + 1) * group; ++h) {
        const float first = h == j * group ? 0.0f : 1.0f;  // beta of the group's sums
        // dP = dO V^T (f32); dV (+)= P^T dO (f32).
        const GemmArgs g1{.trans_b = true, .m = T, .n = T, .k = hd, .a = dout + h * hd, .lda = C, .b = qkv + v_col,
                          .ldb = W, .c = dp.data(), .ldc = T, .batch = B, .stride_a = T * C, .stride_b = T * W,
                          .stride_c = TT, .c_in_stat_dtype = true};
        COSHARD_TRY(half_gemm(dt, g1));
        const GemmArgs g2{.trans_a = true, .m = T, .n = hd, .k = T, .a = probs + h * TT, .lda = T, .b = dout + h * hd,
                          .ldb = C, .c = dv.data(), .ldc = hd, .beta = first, .batch = B, .stride_a = H * TT,
                          .stride_b = T * C, .stride_c = T * hd, .c_in_stat_dtype = true};
        COSHARD_TRY(half_gemm(dt, g2));
        // dS = P * (dP - rowsum(P * dP)), zero above the diagonal, rounded once into scratch.
        float* dpp = dp.data();
        rows_with_buffer(B * T, T, 3 * T, [&](std::int64_t r, float* p) {
          const std::int64_t b = r / T, i = r % T;
          const std::int64_t at = (b * H + h) * TT + i * T;
          widen_half(dt, probs + at, p, static_cast<std::size_t>(i + 1));
          float* dr = dpp + r * T;
          causal_softmax_backward_row(p, dr, i, T);
          narrow_half(dt, dr, ds + at, static_cast<std::size_t>(T));
        });
        // dQ = scale dS K (written in dt); dK (+)= scale dS^T Q (f32).
        const GemmArgs g3{.m = T, .n = hd, .k = T, .a = ds + h * TT, .lda = T, .b = qkv + k_col, .ldb = W,
                          .c = dqkv + h * hd, .ldc = W, .alpha = scale, .batch = B, .stride_a = H * TT,
                          .stride_b = T * W, .stride_c = T * W};
        COSHARD_TRY(half_gemm(dt, g3));
        const GemmArgs g4{.trans_a = true, .m = T, .n = hd, .k = T, .a = ds + h * TT, .lda = T, .b = qkv + h * hd,
                          .ldb = W, .c = dk.data(), .ldc = hd, .alpha = scale, .beta = first, .batch = B,
                          .stride_a = H * TT, .stride_b = T * W, .stride_c = T * hd, .c_in_stat_dtype = true};
        COSHARD_TRY(half_gemm(dt, g4));
      }
      // The group's sums rounded once into the head's key and value columns.
      const float* dkp = dk.data();
      const float* dvp = dv.data();
      parallel_rows(B * T, 2 * hd, [&](std::int64_t begin, std::int64_t end) {
        for (std::int64_t r = begin; r < end; ++r) {
          narrow_half(dt, dkp + r * hd, dqkv + r * W + k_col, static_cast<std::size_t>(hd));
          narrow_half(dt, dvp + r * hd, dqkv + r * W + v_col, static_cast<std::size_t>(hd));
        }
      });
    }
    return {};
  } catch (const std::bad_alloc&) {
    return out_of_memory("backward", B, T, H);
  }
}

}  // namespace coshard::modules::detail
