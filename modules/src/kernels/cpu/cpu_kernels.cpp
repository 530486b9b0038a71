// CPU kernels: matrix products through OpenBLAS (cblas_sgemm / cblas_dgemm), everything else
// as plain loops the compiler vectorises. Each kernel is one closure on the CPU stream, so it
// runs in stream order on the stream's worker; the enqueueing thread never waits. This class
// checks the dtypes and hands each operation to its kernels: the layers' in the headers of this
// folder (or here, where they are a loop or two), the optimizer's in optimizer.cpp.
#include <algorithm>
#include <cstdint>

#include "kernels/cpu/attention.hpp"
#include "kernels/cpu/attention_half.hpp"
#include "kernels/cpu/blas.hpp"
#include "kernels/cpu/elements.hpp"
#include "kernels/cpu/embedding.hpp"
#include "kernels/cpu/half_products.hpp"
#include "kernels/cpu/loss.hpp"
#include "kernels/cpu/norm.hpp"
#include "kernels/cpu/operands.hpp"
#include "kernels/cpu/optimizer.hpp"
#include "kernels/cpu/pointwise.hpp"
#include "kernels/cpu/routing_launch.hpp"
#include "kernels/routing_entries.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {
namespace {

using async::Stream;

Result<void> check_ids(const std::int32_t* ids, std::int64_t n, std::int64_t limit, const char* what) {
  for (std::int64_t i = 0; i < n; ++i) {
    if (ids[i] < 0 || ids[i] >= limit)
      return fail(ErrorCode::out_of_range, what, "[", i, "]=", ids[i], ": expected an id in [0, ", limit, ")");
  }
  return {};
}

// (routing and quantized blocks: RoutingEntries, launched by routing_launch.cpp)
class CpuKernels final : public RoutingEntries<cpu_launch::Launch> {
 public:
  // bf16/f16: matrix products and attention natively where the CPU has the instructions
  // (oneDNN), the element-wise kernels (norms, activations, rotary, sums, biases, the embeddings
  // and their gradients) on the tensors in place (Direct: f32 math, each value rounded once), the rest in f32
  // on copies (Operands: products without the instructions, the vocabulary-parallel and chunked
  // cross-entropy), each output rounded once.
  bool supports(DataType dt) const noexcept override { return cpu_serves(dt); }

  Result<void> gemm(Stream& s, DataType dt, const GemmArgs& g) const override {
    // bf16/f16 natively where the CPU multiplies them (oneDNN: half_products.hpp), else on copies.
    if (is_half(dt) && g.k > 0 && native_half_products(dt))
      return s.launch_fallible([dt, g] { return half_gemm(dt, g); });
    return dispatch_blas(s, dt, [g]<class T>(Operands<T>& io) {
      GemmArgs on = g;
      const bool ta = g.trans_a, tb = g.trans_b;
      on.a = io.in(g.a, extent(ta ? g.k : g.m, ta ? g.m : g.k, g.lda, g.batch, g.stride_a));
      on.b = io.in(g.b, extent(tb ? g.n : g.k, tb ? g.k : g.n, g.ldb, g.batch, g.stride_b));
      // (C wholly written: beta 0 over rows without gaps between them or the batch's matrices)
      const bool whole = g.beta == 0.0f && g.ldc == g.n && (g.batch == 1 || g.stride_c == g.m * g.n);
      const std::int64_t c_extent = extent(g.m, g.n, g.ldc, g.batch, g.stride_c);
      on.c = g.c_in_stat_dtype ? io.stat(g.c) : whole ? io.out(g.c, c_extent) : io.inout(g.c, c_extent);
      for (std::int64_t i = 0; i < g.batch; ++i) gemm_at<T>(on, i);
    });
  }

  Result<void> embedding_forward(Stream& s, DataType dt, const std::int32_t* tokens, const void* wte, const void* wpe,
                                 void* out, std::int64_t B, std::int64_t T_, std::int64_t C, std::int64_t vocab,
                                 std::int64_t first, std::int64_t rows) const override {
    COSHARD_TRY(check_dtype(dt));
    return s.launch_fallible([=]() -> Result<void> {
      COSHARD_TRY(check_ids(tokens, B * T_, vocab, "tokens"));
      with_storage(dt, [&]<class S>(Direct<S>& io) {
        embedding_fwd<S>(tokens, io.in(wte, rows * C), wpe ? io.in(wpe, T_ * C) : nullptr, io.out(out, B * T_ * C), B,
                         T_, C, first, rows);
      });
      return {};
    });
  }

  Result<void> embedding_backward(Stream& s, DataType dt, const std::int32_t* tokens, const void* dout, void* dwte,
                                  void* dwpe, std::int64_t B, std::int64_t T_, std::int64_t C, std::int64_t first,
                                  std::int64_t rows) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      embedding_bwd<S>(tokens, io.in(dout, B * T_ * C), io.inout(dwte, rows * C), dwpe ? io.inout(dwpe, T_ * C) : nullptr,
                       B, T_, C, first, rows);
    });
  }

  Result<void> layernorm_forward(Stream& s, DataType dt, const void* x, const void* w, const void* b, void* out,
                                 void* mean, void* rstd, std::int64_t N, std::int64_t C, float eps) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      layernorm_fwd<S>(io.in(x, N * C), io.in(w, C), io.in(b, C), io.out(out, N * C), io.stat(mean),
                       io.stat(rstd), N, C, eps);
    });
  }

  Result<void> layernorm_backward(Stream& s, DataType dt, const void* dout, const void* x, const void* w,
                                  const void* mean, const void* rstd, void* dx, void* dw, void* db, void* /*scratch*/,
                                  std::int64_t N, std::int64_t C) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      layernorm_bwd<S>(io.in(dout, N * C), io.in(x, N * C), io.in(w, C), io.stat(mean), io.stat(rstd),
                       io.out(dx, N * C), io.inout(dw, C), io.inout(db, C), N, C);
    });
  }

  Result<void> rmsnorm_forward(Stream& s, DataType dt, const void* x, const void* w, void* out, void* rstd,
                               std::int64_t N, std::int64_t C, float eps) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      rmsnorm_fwd<S>(io.in(x, N * C), io.in(w, C), io.out(out, N * C), io.stat(rstd), N, C, eps);
    });
  }

  Result<void> rmsnorm_backward(Stream& s, DataType dt, const void* dout, const void* x, const void* w,
                                const void* rstd, void* dx, void* dw, void* /*scratch*/, std::int64_t N,
                                std::int64_t C) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      rmsnorm_bwd<S>(io.in(dout, N * C), io.in(x, N * C), io.in(w, C), io.stat(rstd), io.out(dx, N * C),
                     io.inout(dw, C), N, C);
    });
  }

  Result<void> gelu_forward(Stream& s, DataType dt, const void* x, void* out, std::int64_t n) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) { gelu_fwd<S>(io.in(x, n), io.out(out, n), n); });
  }

  Result<void> gelu_backward(Stream& s, DataType dt, const void* x, const void* dout, void* dx,
                             std::int64_t n) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      gelu_bwd<S>(io.in(x, n), io.in(dout, n), io.out(dx, n), n);
    });
  }

  Result<void> swiglu_forward(Stream& s, DataType dt, const void* gate_up, void* out, std::int64_t N,
                              std::int64_t I) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      swiglu_fwd<S>(io.in(gate_up, N * 2 * I), io.out(out, N * I), N, I);
    });
  }

  Result<void> swiglu_backward(Stream& s, DataType dt, const void* gate_up, const void* dout, void* dgate_up,
                               std::int64_t N, std::int64_t I) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      swiglu_bwd<S>(io.in(gate_up, N * 2 * I), io.in(dout, N * I), io.out(dgate_up, N * 2 * I), N, I);
    });
  }

  Result<void> rope(Stream& s, DataType dt, const void* x, void* out, const float* inv_freq, std::int64_t B,
                    std::int64_t T, std::int64_t heads, std::int64_t rotated, std::int64_t hd, bool inverse,
                    std::int64_t first) const override {
    const std::int64_t n = B * T * heads * hd;
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      rope_apply<S>(io.in(x, n), io.out(out, n), inv_freq, B, T, heads, rotated, hd, inverse, first);
    });
  }

  Result<void> add(Stream& s, DataType dt, const void* a, const void* b, void* out, std::int64_t n) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      const S* pa = io.in(a, n);
      const S* pb = io.in(b, n);
      S* po = io.out(out, n);
      for (std::int64_t i = 0; i < n; ++i) po[i] = narrow<S>(widen(pa[i]) + widen(pb[i]));
    });
  }

  Result<void> mul(Stream& s, DataType dt, const void* a, const void* b, void* out, std::int64_t n) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      const S* pa = io.in(a, n);
      const S* pb = io.in(b, n);
      S* po = io.out(out, n);
      for (std::int64_t i = 0; i < n; ++i) po[i] = narrow<S>(widen(pa[i]) * widen(pb[i]));
    });
  }

  Result<void> scale(Stream& s, DataType dt, void* x, float factor, std::int64_t n) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      S* p = io.inout(x, n);
      using T = compute_t<S>;
      for (std::int64_t i = 0; i < n; ++i) p[i] = narrow<S>(widen(p[i]) * static_cast<T>(factor));
    });
  }

  Result<void> bias_add(Stream& s, DataType dt, void* out, const void* bias, std::int64_t N,
                        std::int64_t C) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      const S* pb = io.in(bias, C);
      S* po = io.inout(out, N * C);
      for (std::int64_t i = 0; i < N; ++i) {
        S* row = po + i * C;
        for (std::int64_t j = 0; j < C; ++j) row[j] = narrow<S>(widen(row[j]) + widen(pb[j]));
      }
    });
  }

  Result<void> bias_grad(Stream& s, DataType dt, const void* dout, void* dbias, std::int64_t N,
                         std::int64_t C) const override {
    return dispatch_direct(s, dt, [=]<class S>(Direct<S>& io) {
      const S* pg = io.in(dout, N * C);
      S* const grads[1] = {io.inout(dbias, C)};
      column_sums(grads, N, 0, C, [&](std::int64_t i, std::int64_t j, auto& acc, std::int64_t at) {
        acc[0][at] += widen(pg[i * C + j]);
      });
    });
  }


  Result<void> attention_forward(Stream& s, DataType dt, const void* qkv, void* out, void* probs, std::int64_t B,
                                 std::int64_t T_, std::int64_t H, std::int64_t KVH, std::int64_t hd) const override {
    if (native_half_attention(dt))  // (oneDNN's products on the operands themselves)
      return s.launch_fallible([=] { return attention_fwd_half(dt, qkv, out, probs, B, T_, H, KVH, hd); });
    return dispatch_blas(s, dt, [=]<class T>(Operands<T>& io) {
      const std::int64_t C = H * hd, W = (H + 2 * KVH) * hd;
      attention_fwd<T>(io.in(qkv, B * T_ * W), io.out(out, B * T_ * C), io.out(probs, B * H * T_ * T_), B, T_,
                       H, KVH, hd);
    });
  }

  Result<void> attention_decode(Stream& s, DataType dt, const void* cache, void* out, float* scratch, std::int64_t B,
                                std::int64_t Tmax, std::int64_t first, std::int64_t Tn, std::int64_t H, std::int64_t KVH,
                                std::int64_t hd) const override {
    return dispatch(s, dt, [=]<class T>(Operands<T>& io) {
      const std::int64_t W = (H + 2 * KVH) * hd;
      attention_decode_rows<T>(io.in(cache, B * Tmax * W), io.inout(out, B * Tn * H * hd), scratch, B, Tmax, first, Tn,
                               H, KVH, hd);
    });
  }

  Result<void> attention_backward(Stream& s, DataType dt, const void* dout, const void* qkv, const void* /*out*/,
                                  const void* probs, void* dqkv, void* scratch, std::int64_t B, std::int64_t T_,
                                  std::int64_t H, std::int64_t KVH, std::int64_t hd) const override {
    if (native_half_attention(dt))
      return s.launch_fallible(
          [=] { return attention_bwd_half(dt, dout, qkv, probs, dqkv, scratch, B, T_, H, KVH, hd); });
    return dispatch_blas(s, dt, [=]<class T>(Operands<T>& io) {
      const std::int64_t C = H * hd, W = (H + 2 * KVH) * hd;
      attention_bwd<T>(io.in(dout, B * T_ * C), io.in(qkv, B * T_ * W), io.in(probs, B * H * T_ * T_),
                       io.out(dqkv, B * T_ * W), io.out(scratch, B * H * T_ * T_), B, T_, H, KVH, hd);
    });
  }

  Result<void> cross_entropy_forward(Stream& s, DataType dt, const void* logits, const std::int32_t* targets,
                                     void* loss, void* /*scratch*/, std::int64_t N, std::int64_t V) const override {
    COSHARD_TRY(check_dtype(dt));
    return s.launch_fallible([=]() -> Result<void> {
      COSHARD_TRY(check_ids(targets, N, V, "targets"));
      if (is_half(dt)) {  // (a row at a time, no copy of the whole logits)
        cross_entropy_fwd_half(dt, static_cast<const std::uint16_t*>(logits), targets, static_cast<float*>(loss), N, V);
        return {};
      }
      with_type(dt, [&]<class T>(Operands<T>& io) {
        cross_entropy_fwd<T>(io.in(logits, N * V), targets, io.stat(loss), N, V);
      });
      return {};
    });
  }

  Result<void> cross_entropy_backward(Stream& s, DataType dt, const void* logits, const std::int32_t* targets,
                                      const void* seed, void* dlogits, std::int64_t N,
                                      std::int64_t V) const override {
    if (is_half(dt))  // (a row at a time, no copies of the whole logits and their gradient)
      return s.launch([=] {
        cross_entropy_bwd_half(dt, static_cast<const std::uint16_t*>(logits), targets, static_cast<const float*>(seed),
                               static_cast<std::uint16_t*>(dlogits), N, V);
      });
    return dispatch(s, dt, [=]<class T>(Operands<T>& io) {
      cross_entropy_bwd<T>(io.in(logits, N * V), targets, io.stat(seed), io.out(dlogits, N * V), N, V);
    });
  }

  Result<void> row_max(Stream& s, DataType dt, const void* logits, void* max, std::int64_t N,
                       std::int64_t V) const override {
    return dispatch(s, dt, [=]<class T>(Operands<T>& io) { vocab_row_max<T>(io.in(logits, N * V), io.stat(max), N, V); });
  }

  Result<void> vocab_ce_sums(Stream& s, DataType dt, const void* logits, const std::int32_t* targets, const void* max,
                             void* sums, std::int64_t N, std::int64_t V, std::int64_t first,
                             std::int64_t vocab) const override {
    COSHARD_TRY(check_dtype(dt));
    return s.launch_fallible([=]() -> Result<void> {
      COSHARD_TRY(check_ids(targets, N, vocab, "targets"));
      with_type(dt, [&]<class T>(Operands<T>& io) {
        vocab_ce_sums_rows<T>(io.in(logits, N * V), targets, io.stat(max), io.stat(sums), N, V, first);
      });
      return {};
    });
  }

  Result<void> vocab_ce_loss(Stream& s, DataType dt, const void* max, const void* sums, void* loss,
                             std::int64_t N) const override {
    return dispatch(s, dt, [=]<class T>(Operands<T>& io) { vocab_ce_mean<T>(io.stat(max), io.stat(sums), io.stat(loss), N); });
  }

  Result<void> vocab_ce_backward(Stream& s, DataType dt, const void* logits, const std::int32_t* targets,
                                 const void* max, const void* sums, const void* seed, void* dlogits, std::int64_t N,
                                 std::int64_t V, std::int64_t first) const override {
    return dispatch(s, dt, [=]<class T>(Operands<T>& io) {
      vocab_ce_bwd<T>(io.in(logits, N * V), targets, io.stat(max), io.stat(sums), io.stat(seed),
                      io.out(dlogits, N * V), N, V, first);
    });
  }

  Result<void> chunk_ce_sums(Stream& s, DataType dt, const void* logits, const std::int32_t* targets, void* max,
                             void* sums, std::int64_t N, std::int64_t V, std::int64_t first,
                             std::int64_t vocab) const override {
    COSHARD_TRY(check_dtype(dt));
    return s.launch_fallible([=]() -> Result<void> {
      if (first == 0) COSHARD_TRY(check_ids(targets, N, vocab, "targets"));
      with_type(dt, [&]<class T>(Operands<T>& io) {
        chunk_ce_sums_rows<T>(io.in(logits, N * V), targets, io.stat(max), io.stat(sums), N, V, first);
      });
      return {};
    });
  }

  Result<void> mse_forward(Stream& s, DataType dt, const void* pred, const void* target, void* loss,
                           void* /*scratch*/, std::int64_t n) const override {
    return dispatch(s, dt, [=]<class T>(Operands<T>& io) {
      mse_fwd<T>(io.in(pred, n), io.in(target, n), io.stat(loss), n);
    });
  }

  Result<void> mse_backward(Stream& s, DataType dt, const void* pred, const void* target, const void* seed,
                            void* dpred, std::int64_t n) const override {
    return dispatch(s, dt, [=]<class T>(Operands<T>& io) {
      mse_bwd<T>(io.in(pred, n), io.in(target, n), io.stat(seed), io.out(dpred, n), n);
    });
  }

  Result<void> cast(Stream& s, DataType from, const void* src, DataType to, void* dst,
                    std::int64_t n) const override {
    COSHARD_TRY(check_dtype(from));
    COSHARD_TRY(check_dtype(to));
    return s.launch([=] {
      for (std::int64_t i = 0; i < n; ++i) store(to, dst, i, load(from, src, i));
    });
  }

  // The optimizer's kernels (optimizer.cpp), once their dtypes are checked.
  Result<void> step_begin(Stream& s, StepState* state) const override { return cpu::step_begin(s, state); }

  Result<void> grad_stats(Stream& s, DataType gdt, const void* grad, std::int64_t n,
                          StepState* state) const override {
    COSHARD_TRY(check_dtype(gdt));
    return cpu::grad_stats(s, gdt, grad, n, state);
  }

  Result<void> adamw(Stream& s, float* master, DataType gdt, const void* grad, float* m, float* v, DataType pdt,
                     void* param_out, std::int64_t n, const AdamArgs& a, const StepState* state) const override {
    COSHARD_TRY(check_dtype(gdt));
    if (param_out) COSHARD_TRY(check_dtype(pdt));
    return cpu::adamw(s, master, gdt, grad, m, v, pdt, param_out, n, a, state);
  }

  Result<void> sgd(Stream& s, float* master, DataType gdt, const void* grad, float* buf, DataType pdt,
                   void* param_out, std::int64_t n, const SgdArgs& a, const StepState* state) const override {
    COSHARD_TRY(check_dtype(gdt));
    if (param_out) COSHARD_TRY(check_dtype(pdt));
    return cpu::sgd(s, master, gdt, grad, buf, pdt, param_out, n, a, state);
  }

  Result<void> step_end(Stream& s, StepState* state, const LossScaleArgs& a) const override {
    return cpu::step_end(s, state, a);
  }

 private:
  Result<void> check_dtype(DataType dt) const { return check_cpu_dtype(dt); }
  // `fn` on the operands in the type the kernel computes in (f64, else f32); bf16/f16 outputs
  // are rounded back when it returns.
  template <class Fn>
  static void with_type(DataType dt, Fn&& fn) {
    if (dt == DataType::f64) {
      Operands<double> io(dt);
      fn(io);
    } else {
      Operands<float> io(dt);
      fn(io);
    }
  }
  template <class Fn>
  Result<void> dispatch(Stream& s, DataType dt, Fn fn) const {
    COSHARD_TRY(check_dtype(dt));
    return s.launch([dt, fn = std::move(fn)]() mutable { with_type(dt, fn); });
  }
  // `fn` on the tensors themselves in their storage type (elements.hpp: bf16/f16 widened where
  // read and rounded where written, no copies).
  template <class Fn>
  static void with_storage(DataType dt, Fn&& fn) {
    switch (dt) {
      case DataType::f64: {
        Direct<double> io;
        return fn(io);
      }
      case DataType::bf16: {
        Direct<Bf16> io;
        return fn(io);
      }
      case DataType::f16: {
        Direct<F16> io;
        return fn(io);
      }
      default: {
        Direct<float> io;
        return fn(io);
      }
    }
  }
  template <class Fn>
  Result<void> dispatch_direct(Stream& s, DataType dt, Fn fn) const {
    COSHARD_TRY(check_dtype(dt));
    return s.launch([dt, fn = std::move(fn)]() mutable { with_storage(dt, fn); });
  }
  // The same for kernels that call OpenBLAS: its buffers' room is checked first (blas.hpp).
  template <class Fn>
  Result<void> dispatch_blas(Stream& s, DataType dt, Fn fn) const {
    COSHARD_TRY(check_dtype(dt));
    return s.launch_fallible([dt, fn = std::move(fn)]() mutable -> Result<void> {
      COSHARD_TRY(reserve_blas_buffers());
      std::shared_lock product(blas_products());
      with_type(dt, fn);
      return {};
    });
  }
};

}  // namespace

const Kernels& cpu_kernels() noexcept {
  static const CpuKernels kernels;
  return kernels;
}

}  // namespace coshard::modules::detail
