// The kernels behind the layers and optimizers, one implementation per device kind.
//
// Every function enqueues on `stream` and returns: pointers are device pointers (host memory
// for the CPU backend), valid until the stream passes this point. Matrices are row-major.
// Parameter gradients accumulate (+=); activation gradients are overwritten. The CPU backend
// serves f32 and f64 (f64 for gradient checks), and bf16 and f16: matrix products on the
// half-precision operands with f32 accumulation where the CPU has the instructions (oneDNN),
// everything else computed in f32 on copies with each output rounded once; CUDA serves f32, bf16 and f16
// with f32 accumulation. "Stats" (LayerNorm mean/rstd, the loss) are f64 for f64 models, else f32.
#pragma once

#include <cstdint>
#include <span>

#include "coshard/async/result.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/modules/tensor.hpp"
#include "kernels/kernel_args.hpp"

namespace coshard::modules::detail {

inline DataType stat_dtype(DataType dt) noexcept { return dt == DataType::f64 ? DataType::f64 : DataType::f32; }

// C = alpha * op(A) * op(B) + beta * C, op(X) = X or X^T; `batch` products at fixed strides.
// C is in the product's dtype, or in its stat dtype (f32 for bf16/f16) with c_in_stat_dtype: a
// sum of products kept unrounded across calls (beta 1), rounded once by a cast at the end.
struct GemmArgs {
  bool trans_a = false;
  bool trans_b = false;
  std::int64_t m = 0, n = 0, k = 0;
  const void* a = nullptr;
  std::int64_t lda = 0;
  const void* b = nullptr;
  std::int64_t ldb = 0;
  void* c = nullptr;
  std::int64_t ldc = 0;
  float alpha = 1.0f;
  float beta = 0.0f;
  std::int64_t batch = 1;
  std::int64_t stride_a = 0, stride_b = 0, stride_c = 0;  // elements
  bool c_in_stat_dtype = false;
};

// What causal attention keeps from its forward for its backward, and the scratch its backward
// needs, as a backend chooses for a shape: the probabilities [B, H, T, T] in the activation dtype
// and a scratch of that size (the materialized form), or one f32 log-sum-exp per query row
// [B, H, T] and a scratch of that size, the backward recomputing from the output (the fused form).
struct AttentionBuffers {
  Shape saved;
  DataType saved_dtype = DataType::f32;
  Shape scratch;
  DataType scratch_dtype = DataType::f32;
  bool backward_reads_output = false;
};

class Kernels {
 public:
  virtual ~Kernels() = default;
  virtual bool supports(DataType dt) const noexcept = 0;

  virtual Result<void> gemm(async::Stream& s, DataType dt, const GemmArgs& g) const = 0;
  // The product, then bias [n] added to each of C's m rows (batch 1, ldc = n). The default is
  // gemm then bias_add (the CPU's, so its bits do not change); CUDA fuses the bias into the
  // product's epilogue where cuBLASLt can.
  virtual Result<void> gemm_bias(async::Stream& s, DataType dt, const GemmArgs& g, const void* bias) const;

  // out[b,t,:] = wte[tokens[b,t] - first,:] + wpe[t,:] (wpe null: no position term, and dwpe
  // null in backward). wte holds rows [first, first + rows) of a table of `vocab` (all of it:
  // first 0, rows vocab; a part: a vocabulary-parallel embedding, whose tokens outside its rows
  // give zeros forward and nothing backward). Tokens outside [0, vocab) fail a CPU stream (NaN
  // rows on CUDA).
  virtual Result<void> embedding_forward(async::Stream& s, DataType dt, const std::int32_t* tokens, const void* wte,
                                         const void* wpe, void* out, std::int64_t B, std::int64_t T,
                                         std::int64_t C, std::int64_t vocab, std::int64_t first,
                                         std::int64_t rows) const = 0;
  virtual Result<void> embedding_backward(async::Stream& s, DataType dt, const std::int32_t* tokens,
                                          const void* dout, void* dwte, void* dwpe, std::int64_t B, std::int64_t T,
                                          std::int64_t C, std::int64_t first, std::int64_t rows) const = 0;

  virtual Result<void> layernorm_forward(async::Stream& s, DataType dt, const void* x, const void* w, const void* b,
                                         void* out, void* mean, void* rstd, std::int64_t N, std::int64_t C,
                                         float eps) const = 0;
  // `scratch`: norm_backward_scratch(dt, N, C, true) f32 elements (null where that is 0).
  virtual Result<void> layernorm_backward(async::Stream& s, DataType dt, const void* dout, const void* x,
                                          const void* w, const void* mean, const void* rstd, void* dx, void* dw,
                                          void* db, void* scratch, std::int64_t N, std::int64_t C) const = 0;

  // RMSNorm (Llama): out = x * rstd * w, rstd = 1 / sqrt(mean(x^2) + eps) per row (stat dtype).
  virtual Result<void> rmsnorm_forward(async::Stream& s, DataType dt, const void* x, const void* w, void* out,
                                       void* rstd, std::int64_t N, std::int64_t C, float eps) const = 0;
  // `scratch`: norm_backward_scratch(dt, N, C, false) f32 elements (null where that is 0).
  virtual Result<void> rmsnorm_backward(async::Stream& s, DataType dt, const void* dout, const void* x, const void* w,
                                        const void* rstd, void* dx, void* dw, void* scratch, std::int64_t N,
                                        std::int64_t C) const = 0;
  // The f32 scratch elements a norm's backward takes for N rows of C (LayerNorm with_bias); the
  // default 0: none (the CPU). CUDA's fused backward keeps per-block partial sums there.
  virtual std::int64_t norm_backward_scratch(DataType dt, std::int64_t N, std::int64_t C, bool with_bias) const;

  virtual Result<void> gelu_forward(async::Stream& s, DataType dt, const void* x, void* out, std::int64_t n) const = 0;
  virtual Result<void> gelu_backward(async::Stream& s, DataType dt, const void* x, const void* dout, void* dx,
                                     std::int64_t n) const = 0;

  // SwiGLU (Llama's MLP): gate_up [N, 2I] holds gate | up per row; out [N, I] = silu(gate) * up,
  // silu(g) = g * sigmoid(g). Backward overwrites dgate_up [N, 2I].
  virtual Result<void> swiglu_forward(async::Stream& s, DataType dt, const void* gate_up, void* out, std::int64_t N,
                                      std::int64_t I) const = 0;
  virtual Result<void> swiglu_backward(async::Stream& s, DataType dt, const void* gate_up, const void* dout,
                                       void* dgate_up, std::int64_t N, std::int64_t I) const = 0;

  // Rotary position embeddings in transformers' Llama convention (dimension i of a head pairs with
  // i + hd/2): in x [B, T, heads * hd], the first `rotated` heads of row t (position first + t)
  // turn by the angles (first + t) * inv_freq[i] (inv_freq: hd/2 f32, on the device); the other
  // heads are copied. `inverse` turns the other way (the backward pass). out must not alias x.
  virtual Result<void> rope(async::Stream& s, DataType dt, const void* x, void* out, const float* inv_freq,
                            std::int64_t B, std::int64_t T, std::int64_t heads, std::int64_t rotated, std::int64_t hd,
                            bool inverse, std::int64_t first) const = 0;

  // out = a + b (out may alias a or b).
  virtual Result<void> add(async::Stream& s, DataType dt, const void* a, const void* b, void* out,
                           std::int64_t n) const = 0;
  // out = a * b, element by element (out may alias a or b).
  virtual Result<void> mul(async::Stream& s, DataType dt, const void* a, const void* b, void* out,
                           std::int64_t n) const = 0;
  // x *= factor.
  virtual Result<void> scale(async::Stream& s, DataType dt, void* x, float factor, std::int64_t n) const = 0;
  // out[i,:] += bias; dbias += column sums of dout.
  virtual Result<void> bias_add(async::Stream& s, DataType dt, void* out, const void* bias, std::int64_t N,
                                std::int64_t C) const = 0;
  virtual Result<void> bias_grad(async::Stream& s, DataType dt, const void* dout, void* dbias, std::int64_t N,
                                 std::int64_t C) const = 0;

  // Causal attention over qkv [B, T, (H + 2 KVH) * hd]: H query heads, then KVH key heads, then
  // KVH value heads, hd columns each; query head h attends with key/value head h / (H / KVH)
  // (grouped-query attention; KVH = H is multi-head). out [B, T, H * hd]; `saved` and `scratch`
  // as attention_buffers says for the shape (the default: the materialized form). Backward
  // overwrites dqkv; `out` is forward's output (read where backward_reads_output).
  virtual AttentionBuffers attention_buffers(DataType dt, std::int64_t B, std::int64_t T, std::int64_t H,
                                             std::int64_t KVH, std::int64_t hd) const;
  virtual Result<void> attention_forward(async::Stream& s, DataType dt, const void* qkv, void* out, void* saved,
                                         std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH,
                                         std::int64_t hd) const = 0;
  // Decoding with a key/value cache: cache [B, Tmax, (H + 2 KVH) * hd] holds rows laid out as
  // attention_forward's qkv; rows [first, first + Tn) are the new tokens'. Each new row attends
  // over the rows up to and including itself (causal, at its position first + i): out [B, Tn,
  // H * hd]. scratch: B * Tn * H * (first + Tn) f32.
  virtual Result<void> attention_decode(async::Stream& s, DataType dt, const void* cache, void* out, float* scratch,
                                        std::int64_t B, std::int64_t Tmax, std::int64_t first, std::int64_t Tn,
                                        std::int64_t H, std::int64_t KVH, std::int64_t hd) const = 0;
  virtual Result<void> attention_backward(async::Stream& s, DataType dt, const void* dout, const void* qkv,
                                          const void* out, const void* saved, void* dqkv, void* scratch,
                                          std::int64_t B, std::int64_t T, std::int64_t H, std::int64_t KVH,
                                          std::int64_t hd) const = 0;

  // loss (stat dtype, one element) = mean over rows of -log softmax(logits)[target], summed in
  // a fixed order; `scratch` holds N stat-dtype elements. Targets outside [0, V) fail a CPU
  // stream, and give a NaN loss on CUDA.
  virtual Result<void> cross_entropy_forward(async::Stream& s, DataType dt, const void* logits,
                                             const std::int32_t* targets, void* loss, void* scratch,
                                             std::int64_t N, std::int64_t V) const = 0;
  // dlogits = (softmax - onehot) * seed[0] / N, seed in the stat dtype.
  virtual Result<void> cross_entropy_backward(async::Stream& s, DataType dt, const void* logits,
                                              const std::int32_t* targets, const void* seed, void* dlogits,
                                              std::int64_t N, std::int64_t V) const = 0;

  // Cross-entropy over logits split by columns across ranks (vocabulary-parallel): logits [N, V]
  // are columns [first, first + V) of a vocabulary of `vocab`. Three steps around two sums across
  // the ranks: row_max gives each row's max (stat dtype [N]; then the max across ranks);
  // vocab_ce_sums, given the global max, gives sums [2N] = each row's sum of exp(x - max), then
  // its target's logit where this rank holds that column, else 0 (then the sum across ranks);
  // vocab_ce_loss gives the mean over rows of log(sum) + max - target logit, in a fixed order.
  // Targets outside [0, vocab) fail a CPU stream (a NaN loss on CUDA).
  virtual Result<void> row_max(async::Stream& s, DataType dt, const void* logits, void* max, std::int64_t N,
                               std::int64_t V) const = 0;
  virtual Result<void> vocab_ce_sums(async::Stream& s, DataType dt, const void* logits, const std::int32_t* targets,
                                     const void* max, void* sums, std::int64_t N, std::int64_t V, std::int64_t first,
                                     std::int64_t vocab) const = 0;
  virtual Result<void> vocab_ce_loss(async::Stream& s, DataType dt, const void* max, const void* sums, void* loss,
                                     std::int64_t N) const = 0;
  // dlogits = (exp(x - max) / sum - onehot) * seed[0] / N over this rank's columns (max and sums
  // the global ones, as above). dlogits may be logits (in place).
  virtual Result<void> vocab_ce_backward(async::Stream& s, DataType dt, const void* logits,
                                         const std::int32_t* targets, const void* max, const void* sums,
                                         const void* seed, void* dlogits, std::int64_t N, std::int64_t V,
                                         std::int64_t first) const = 0;

  // The same cross-entropy over logits made a chunk of vocabulary columns at a time (the output
  // layer fused with its loss, FusedCrossEntropyLoss): logits [N, V] are columns [first, first +
  // V) of a vocabulary of `vocab`, and max [N] and sums [2N] (laid out as vocab_ce_sums gives
  // them) carry each row's running state over the chunks seen so far, in order: the chunk at
  // first = 0 starts it. Each row's max rises to the chunk's, its sum of exp(x - max) is rescaled
  // to the new max and the chunk's terms added, and its target's logit is taken where the chunk
  // holds it. After the last chunk, vocab_ce_loss gives the loss and vocab_ce_backward each
  // chunk's gradient. Targets outside [0, vocab) fail a CPU stream (a NaN loss on CUDA).
  virtual Result<void> chunk_ce_sums(async::Stream& s, DataType dt, const void* logits, const std::int32_t* targets,
                                     void* max, void* sums, std::int64_t N, std::int64_t V, std::int64_t first,
                                     std::int64_t vocab) const = 0;

  // loss (stat dtype, one element) = mean over the n elements of (pred - target)^2, summed in a
  // fixed order; `scratch` holds n stat-dtype elements.
  virtual Result<void> mse_forward(async::Stream& s, DataType dt, const void* pred, const void* target, void* loss,
                                   void* scratch, std::int64_t n) const = 0;
  // dpred = 2 (pred - target) * seed[0] / n, seed in the stat dtype.
  virtual Result<void> mse_backward(async::Stream& s, DataType dt, const void* pred, const void* target,
                                    const void* seed, void* dpred, std::int64_t n) const = 0;

  // dst = src converted (any two of f32/f64/bf16/f16 the backend serves).
  virtual Result<void> cast(async::Stream& s, DataType from, const void* src, DataType to, void* dst,
                            std::int64_t n) const = 0;

  // Mixture-of-experts routing, as transformers' Qwen3-MoE and Mixtral routers compute it: per
  // token t, its router logits[t, 0..experts) (dt) read as f32, the softmax in f32 (the max
  // subtracted, exp, summed in expert order) into probs[t, :] (f32, kept for backward), the k most
  // probable experts (ties to the lower one) into chosen[t, 0..k) in descending order (i32), their
  // probabilities into weights[t, :] (f32), divided by their sum when `renormalize`
  // (norm_topk_prob; Mixtral always). CPU and emulated CUDA give the same bits; a GPU's exp may
  // differ in the last place.
  virtual Result<void> moe_route(async::Stream& s, DataType dt, const void* logits, std::int64_t tokens,
                                 std::int64_t experts, std::int64_t k, bool renormalize, float* probs,
                                 std::int32_t* chosen, float* weights) const = 0;
  // Its backward: dlogits[t, :] (dt) from dweights[t, :] (f32), through the renormalisation onto
  // the chosen probabilities ((dw_j - sum_l dw_l w_l) / their sum), plus dprob_extra[e] (f32, an
  // auxiliary loss's gradient on every token's probability of e; null for none), through the
  // softmax (p_e (g_e - sum_e' p_e' g_e')).
  virtual Result<void> moe_route_backward(async::Stream& s, const float* probs, const std::int32_t* chosen,
                                          const float* weights, const float* dweights, const float* dprob_extra,
                                          std::int64_t tokens, std::int64_t experts, std::int64_t k, bool renormalize,
                                          DataType dt, void* dlogits) const = 0;
  // The slots s = t * k + j of `chosen` ordered by expert, stably: counts[e] (i32), order[pos] = s
  // and inverse[s] = pos (i32 each, `slots` of them): expert e's tokens are order's run from the
  // sum of the counts before e, in token order.
  virtual Result<void> moe_dispatch_plan(async::Stream& s, const std::int32_t* chosen, std::int64_t slots,
                                         std::int64_t experts, std::int32_t* counts, std::int32_t* order,
                                         std::int32_t* inverse) const = 0;
  // Dispatch: out[i, :] = x[order[i] / k, :] for the plan's `rows` places (each token's row once
  // for each of its experts, grouped by expert; dt rows of `width`).
  virtual Result<void> moe_gather_rows(async::Stream& s, DataType dt, const void* x, const std::int32_t* order,
                                       std::int64_t rows, std::int64_t k, std::int64_t width, void* out) const = 0;
  // The combine, and dispatch's backward (weights null): out[t, :] = the sum over token t's k
  // places (inverse[t * k + j]) in ascending place, its experts' order as transformers adds them, of
  // weights[t, j] rounded to dt (or 1) times rows[place, :], in f32, rounded once into dt.
  virtual Result<void> moe_combine_rows(async::Stream& s, DataType dt, const void* rows, const std::int32_t* inverse,
                                        const float* weights, std::int64_t tokens, std::int64_t k, std::int64_t width,
                                        void* out) const = 0;
  // The combine's backward: d_rows[place, :] = weights[t, j] (rounded to dt) * dy[t, :], and
  // dweights[t, j] (f32) = the f32 sum over the width of dy[t, c] * rows[place, c] in c order.
  virtual Result<void> moe_combine_backward(async::Stream& s, DataType dt, const void* dy, const void* rows,
                                            const std::int32_t* inverse, const float* weights, std::int64_t tokens,
                                            std::int64_t k, std::int64_t width, void* d_rows,
                                            float* dweights) const = 0;

  // Block quantization, int8 or int4 (kernel_args.hpp: the formats and QuantSegment): each of
  // `segments` (in memory the kernels read: the device's, or the host's for the CPU) quantizes its
  // values of x (dt) into its place in `packed`; dequantize_blocks turns each segment's packed
  // values back into its values of out (dt). `blocks` is the segments' blocks together (the last
  // one's first_block plus its own). Every backend gives the same bits for the same input.
  virtual Result<void> quantize_blocks(async::Stream& s, BlockBits bits, DataType dt, const void* x, void* packed,
                                       const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                       std::int64_t block) const = 0;
  virtual Result<void> dequantize_blocks(async::Stream& s, BlockBits bits, const void* packed, DataType dt, void* out,
                                         const QuantSegment* segments, std::int64_t segment_count, std::int64_t blocks,
                                         std::int64_t block) const = 0;
  // The quantized reduction's end (ZeRO++'s quantized gradients): `pieces` packed pieces `stride`
  // bytes apart, each holding the same segments (one rank's quantization of this rank's block),
  // dequantized and summed in f32 in piece order, times `factor`, rounded once into out (dt).
  virtual Result<void> dequantize_sum_blocks(async::Stream& s, BlockBits bits, const void* packed, std::int64_t pieces,
                                             std::int64_t stride, DataType dt, void* out, const QuantSegment* segments,
                                             std::int64_t segment_count, std::int64_t blocks, std::int64_t block,
                                             float factor) const = 0;

  // Optimizer kernels: fp32 master weights and state; grads in `gdt`; `param_out` (in `pdt`) gets
  // the updated weights cast down, or is null when the parameters are the master weights.
  virtual Result<void> step_begin(async::Stream& s, StepState* state) const = 0;
  virtual Result<void> grad_stats(async::Stream& s, DataType gdt, const void* grad, std::int64_t n,
                                  StepState* state) const = 0;
  virtual Result<void> adamw(async::Stream& s, float* master, DataType gdt, const void* grad, float* m, float* v,
                             DataType pdt, void* param_out, std::int64_t n, const AdamArgs& args,
                             const StepState* state) const = 0;
  // Multi-tensor forms of grad_stats and adamw: the same arithmetic per element over a list of
  // tensors, in as few launches as the backend can (CUDA: one per 32 tensors or 20 Mi elements).
  // The defaults call the one-tensor forms in order (the CPU's, so its bits do not change).
  virtual Result<void> grad_stats_multi(async::Stream& s, std::span<const OptimizerTensor> tensors,
                                        StepState* state) const;
  virtual Result<void> adamw_multi(async::Stream& s, std::span<const OptimizerTensor> tensors, const AdamArgs& args,
                                   const StepState* state) const;
  virtual Result<void> sgd(async::Stream& s, float* master, DataType gdt, const void* grad, float* momentum_buf,
                           DataType pdt, void* param_out, std::int64_t n, const SgdArgs& args,
                           const StepState* state) const = 0;
  virtual Result<void> step_end(async::Stream& s, StepState* state, const LossScaleArgs& args) const = 0;
};

const Kernels& cpu_kernels() noexcept;
// Null when this build has no CUDA backend.
const Kernels* cuda_kernels() noexcept;
// The CUDA backend with attention always in the materialized form (the fused kernels' reference
// in tests); null without CUDA.
const Kernels* cuda_kernels_materialized_attention() noexcept;
// The CUDA backend with cuDNN's fused attention where it serves the shape, else the fused kernels
// (AttentionKernels::cudnn); null without CUDA.
const Kernels* cuda_kernels_cudnn_attention() noexcept;
// "cuDNN 9.19.0 (path)", or why cuDNN's attention cannot run in this process.
Result<std::string> cudnn_attention_library();

// The routing kernels' sizes: tokens >= 0, 1 <= k <= experts, experts < 2^31, tokens * k < 2^31
// (i32 slots), named.
Result<void> check_moe_routing(std::int64_t tokens, std::int64_t experts, std::int64_t k);
// The dispatch and combine kernels' sizes: rows (tokens x k) >= 0 and < 2^31, k >= 1, width >= 0.
Result<void> check_moe_rows(std::int64_t rows, std::int64_t k, std::int64_t width);
// The block kernels' sizes: counts >= 0, blocks of block >= 1 (int4: an even count, so no byte holds
// two blocks' values).
Result<void> check_quant_blocks(BlockBits bits, std::int64_t segment_count, std::int64_t blocks, std::int64_t block);

// "f32 is not served by the cuda kernels" style check used by every layer.
Result<void> check_supported(const Kernels& k, DataType dt, async::Device device, std::string_view what);

}  // namespace coshard::modules::detail
