// The CUDA kernels' launchers, callable from C++23 host code. nvcc compiles C++20 at most, so
// this header (and the .cu files) include nothing of coshard's but the plain kernel_args.hpp.
// Each launcher enqueues on `stream` (a cudaStream_t) and returns the cudaError_t of the launch
// as an int. `dt` is collectives::DataType's value: 0 f32, 1 f64, 2 f16, 3 bf16 (f64 is refused).
// Element math is f32 for every dtype (bf16/f16 load to f32 and round on store).
#pragma once

#include <cstdint>

#include "kernels/kernel_args.hpp"

namespace coshard::modules::cuda {

// The fused norm backward's shape: at most kNormBackwardBlocks blocks (rows split evenly, so the
// partials stay small against the N x C inputs), each summing its rows' parameter-gradient terms
// in kThreads' shared memory: C f32 (RMSNorm) or 2C (LayerNorm, with its bias). A row wider than
// the 48 KiB a block has without opting in keeps the two-kernel form (count 0).
inline constexpr std::int64_t kNormBackwardBlocks = 1024;
inline constexpr std::int64_t kNormBackwardSharedBytes = 48 * 1024;
inline std::int64_t norm_backward_rows_per_block(std::int64_t N) {
  return (N + kNormBackwardBlocks - 1) / kNormBackwardBlocks;
}
inline std::int64_t norm_backward_blocks(std::int64_t N) {
  const std::int64_t rows = norm_backward_rows_per_block(N);
  return (N + rows - 1) / rows;
}
// The f32 elements of a fused backward's partial sums for N rows of C (0: not fused).
inline std::int64_t norm_backward_partials(std::int64_t N, std::int64_t C, bool with_bias) {
  const std::int64_t grads = with_bias ? 2 : 1;
  if (N <= 0 || C <= 0 || C * grads * 4 > kNormBackwardSharedBytes) return 0;
  return norm_backward_blocks(N) * C * grads;
}

// wte holds rows [first, first + rows) of a table of `vocab` (Kernels::embedding_forward).
int embedding_forward(void* stream, int dt, const std::int32_t* tokens, const void* wte, const void* wpe, void* out,
                      std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t vocab, std::int64_t first,
                      std::int64_t rows);
int embedding_backward(void* stream, int dt, const std::int32_t* tokens, const void* dout, void* dwte, void* dwpe,
                       std::int64_t B, std::int64_t T, std::int64_t C, std::int64_t first, std::int64_t rows);
// mean/rstd are f32.
int layernorm_forward(void* stream, int dt, const void* x, const void* w, const void* b, void* out, float* mean,
                      float* rstd, std::int64_t N, std::int64_t C, float eps);
// `partials`: norm_backward_partials(N, C, true) f32 elements on the device for the fused
// backward, or null (the two-kernel form; also where that count is 0).
int layernorm_backward(void* stream, int dt, const void* dout, const void* x, const void* w, const float* mean,
                       const float* rstd, void* dx, void* dw, void* db, float* partials, std::int64_t N,
                       std::int64_t C);
// rstd is f32.
int rmsnorm_forward(void* stream, int dt, const void* x, const void* w, void* out, float* rstd, std::int64_t N,
                    std::int64_t C, float eps);
// `partials`: norm_backward_partials(N, C, false) elements, or null.
int rmsnorm_backward(void* stream, int dt, const void* dout, const void* x, const void* w, const float* rstd, void* dx,
                     void* dw, float* partials, std::int64_t N, std::int64_t C);
int gelu_forward(void* stream, int dt, const void* x, void* out, std::int64_t n);
int rope(void* stream, int dt, const void* x, void* out, const float* inv_freq, std::int64_t B, std::int64_t T,
         std::int64_t heads, std::int64_t rotated, std::int64_t hd, bool inverse, std::int64_t first = 0);
// Kernels::attention_decode: one block per (row, new position, head); scores in `scratch`.
int attention_decode(void* stream, int dt, const void* cache, void* out, float* scratch, std::int64_t B,
                     std::int64_t Tmax, std::int64_t first, std::int64_t Tn, std::int64_t H, std::int64_t KVH,
                     std::int64_t hd);
int swiglu_forward(void* stream, int dt, const void* gate_up, void* out, std::int64_t N, std::int64_t I);
int swiglu_backward(void* stream, int dt, const void* gate_up, const void* dout, void* dgate_up, std::int64_t N,
                    std::int64_t I);
int gelu_backward(void* stream, int dt, const void* x, const void* dout, void* dx, std::int64_t n);
int add(void* stream, int dt, const void* a, const void* b, void* out, std::int64_t n);
int mul(void* stream, int dt, const void* a, const void* b, void* out, std::int64_t n);
int scale(void* stream, int dt, void* x, float factor, std::int64_t n);
int bias_add(void* stream, int dt, void* out, const void* bias, std::int64_t N, std::int64_t C);
int bias_grad(void* stream, int dt, const void* dout, void* dbias, std::int64_t N, std::int64_t C);
// In place over rows of length T: row i of each [T, T] matrix keeps columns 0..i, softmaxed
// after scaling by `scale`; the rest become 0.
int causal_softmax(void* stream, int dt, void* scores, std::int64_t matrices, std::int64_t T, float scale);
// In place: dP <- P * (dP - rowsum(P * dP)) (zero above the diagonal).
int causal_softmax_backward(void* stream, int dt, const void* probs, void* dprobs, std::int64_t matrices,
                            std::int64_t T);
// loss (f32) = mean of per-row losses, summed in a fixed order through row_losses[N] (f32).
int cross_entropy_forward(void* stream, int dt, const void* logits, const std::int32_t* targets, float* loss,
                          float* row_losses, std::int64_t N, std::int64_t V);
int cross_entropy_backward(void* stream, int dt, const void* logits, const std::int32_t* targets, const float* seed,
                           void* dlogits, std::int64_t N, std::int64_t V);
// The vocabulary-parallel cross-entropy's steps (Kernels::row_max and after); max, sums, loss
// and seed are f32.
int row_max(void* stream, int dt, const void* logits, float* max, std::int64_t N, std::int64_t V);
int vocab_ce_sums(void* stream, int dt, const void* logits, const std::int32_t* targets, const float* max, float* sums,
                  std::int64_t N, std::int64_t V, std::int64_t first, std::int64_t vocab);
// Kernels::chunk_ce_sums: one chunk of the fused output layer's columns into the running max and sums.
int chunk_ce_sums(void* stream, int dt, const void* logits, const std::int32_t* targets, float* max, float* sums,
                  std::int64_t N, std::int64_t V, std::int64_t first, std::int64_t vocab);
int vocab_ce_loss(void* stream, const float* max, const float* sums, float* loss, std::int64_t N);
int vocab_ce_backward(void* stream, int dt, const void* logits, const std::int32_t* targets, const float* max,
                      const float* sums, const float* seed, void* dlogits, std::int64_t N, std::int64_t V,
                      std::int64_t first);
// loss (f32) = mean of (pred - target)^2, summed in a fixed order through squares[n] (f32).
int mse_forward(void* stream, int dt, const void* pred, const void* target, float* loss, float* squares, std::int64_t n);
int mse_backward(void* stream, int dt, const void* pred, const void* target, const float* seed, void* dpred,
                 std::int64_t n);
int cast(void* stream, int from, const void* src, int to, void* dst, std::int64_t n);
// Mixture-of-experts routing (kernels.hpp: moe_route and the rest).
int moe_route(void* stream, int dt, const void* logits, std::int64_t tokens, std::int64_t experts, std::int64_t k,
              bool renormalize, float* probs, std::int32_t* chosen, float* weights);
int moe_route_backward(void* stream, const float* probs, const std::int32_t* chosen, const float* weights,
                       const float* dweights, const float* dprob_extra, std::int64_t tokens, std::int64_t experts,
                       std::int64_t k, bool renormalize, int dt, void* dlogits);
int moe_dispatch_plan(void* stream, const std::int32_t* chosen, std::int64_t slots, std::int64_t experts,
                      std::int32_t* counts, std::int32_t* order, std::int32_t* inverse);
int moe_gather_rows(void* stream, int dt, const void* x, const std::int32_t* order, std::int64_t rows, std::int64_t k,
                    std::int64_t width, void* out);
int moe_combine_rows(void* stream, int dt, const void* rows, const std::int32_t* inverse, const float* weights,
                     std::int64_t tokens, std::int64_t k, std::int64_t width, void* out);
int moe_combine_backward(void* stream, int dt, const void* dy, const void* rows, const std::int32_t* inverse,
                         const float* weights, std::int64_t tokens, std::int64_t k, std::int64_t width, void* d_rows,
                         float* dweights);
// Block int8 or int4, `bits` 8 or 4 (kernel_args.hpp: the formats and their segments, in device memory).
int quantize_blocks(void* stream, int bits, int dt, const void* x, void* packed, const detail::QuantSegment* segments,
                    std::int64_t count, std::int64_t blocks, std::int64_t block);
int dequantize_blocks(void* stream, int bits, const void* packed, int dt, void* out, const detail::QuantSegment* segments,
                      std::int64_t count, std::int64_t blocks, std::int64_t block);
int dequantize_sum_blocks(void* stream, int bits, const void* packed, std::int64_t pieces, std::int64_t stride, int dt,
                          void* out, const detail::QuantSegment* segments, std::int64_t count, std::int64_t blocks,
                          std::int64_t block, float factor);

int step_begin(void* stream, detail::StepState* state);
int grad_stats(void* stream, int gdt, const void* grad, std::int64_t n, detail::StepState* state);
int adamw(void* stream, float* master, int gdt, const void* grad, float* m, float* v, int pdt, void* param_out,
          std::int64_t n, detail::AdamArgs args, const detail::StepState* state);
// Multi-tensor forms: one launch per list of up to 32 tensors and 320 chunks of 64 Ki elements.
int grad_stats_multi(void* stream, const detail::OptimizerTensor* tensors, int count, detail::StepState* state);
int adamw_multi(void* stream, const detail::OptimizerTensor* tensors, int count, detail::AdamArgs args,
                const detail::StepState* state);
int sgd(void* stream, float* master, int gdt, const void* grad, float* momentum_buf, int pdt, void* param_out,
        std::int64_t n, detail::SgdArgs args, const detail::StepState* state);
int step_end(void* stream, detail::StepState* state, detail::LossScaleArgs args);

}  // namespace coshard::modules::cuda
