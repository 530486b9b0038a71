// The GPU kernels of issue #19 against their unfused baselines, in one process on one GPU:
//   BM_FusedAttention_<shape> vs BM_Baseline_MaterializedAttention_<shape>: a causal attention
//     layer's forward and backward in bf16 (the flash-style kernels against cuBLAS around the
//     T x T softmax), at the attention shapes of GPT-2 1.5B (T 1024, 25 heads of 64), Llama-3.2-1B
//     (T 2048, 32 query and 8 key/value heads of 64) and Llama-3.1-8B (T 2048, 32/8 heads of 128);
//     counters: TFLOP/s (causal: 2 B H T^2 hd forward, 2.5 times that backward) and the layer's
//     activation peak. BM_CudnnAttention_<shape>: the same layer through cuDNN's fused attention
//     (issue 52, item 1), whose target is 0.8x PyTorch SDPA's TFLOP/s (bench/sdpa_baseline.py).
//   BM_MultiTensorAdamW vs BM_Baseline_PerGroupAdamW: one optimizer step (statistics and update)
//     of 400 groups of 256 Ki bf16 parameters with fp32 masters, multi-tensor against one launch
//     per group.
//   BM_CrossEntropy_<shape> vs BM_Baseline_LogitsCopy_<shape>: the loss's forward and backward in
//     bf16 over a step's logits (GPT-2 1.5B: 4 x 1024 rows of 50,257; Llama-3.2-1B: 4 x 2048 rows of
//     128,256), against a device copy of the logits; counter GBps: the fewest bytes each must move
//     (the loss: logits read forward, read again and dlogits written backward, three N x V tensors;
//     the copy: two) per second.
//   BM_Norm_<shape> vs BM_Baseline_DeviceCopy_<shape>: a norm layer's forward and backward in
//     bf16 over 16,384 rows (8 sequences of 2048) at GPT-2 1.5B's width (LayerNorm, 1600) and
//     Llama-3.2-1B's and Llama-3.1-8B's (RMSNorm, 2048 and 4096), against a device-to-device copy
//     of one N x C tensor; counter GBps: the fewest bytes each must move (the norm: x and out
//     forward; dout, x and dx backward, five N x C tensors; the copy: two) per second, so the
//     ratio of the two is the fraction of the card's achievable bandwidth the norm reaches.
//   BM_FusedOutputLoss_<shape> vs BM_Baseline_WholeLogitsLoss_<shape> (issue 52): the output layer
//     (a Linear [vocab, dim] in bf16) and its cross-entropy, forward and backward, fused chunk by
//     chunk (FusedCrossEntropyLoss, 256 MiB chunks) against the layer's whole logits through
//     CrossEntropyLoss, at the logits shapes above with dim 1600 / 2048; counters: TFLOP/s of the
//     unfused products (6 N V dim: the fused one makes the forward product once more) and the
//     activation peak.
// Without a GPU every benchmark reports "no CUDA device" and skips. Times are wall time around
// the enqueue and a stream synchronize (manual time). Inputs are random (never zeros: a kernel can
// run faster on zeros than on real data). bench/sdpa_baseline.py times PyTorch's SDPA at the same
// attention shapes, counted the same way.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <random>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/fused_cross_entropy.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/llama_layers.hpp"
#include "coshard/modules/ops.hpp"
#include "coshard/modules/optimizer.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "bench_rank.hpp"

namespace {

using namespace coshard;
using namespace coshard::modules;
using Clock = std::chrono::steady_clock;
using bench::BenchRank;
using bench::have_gpu;

// A rank on cuda:0, or null with the benchmark skipped (no GPU, or the reason it failed).
std::unique_ptr<BenchRank> gpu_rank(benchmark::State& state, ContextOptions options = {}) {
  if (!have_gpu()) {
    state.SkipWithError("no CUDA device");
    return nullptr;
  }
  auto rank = BenchRank::make(async::Device::cuda(0), options);
  if (!rank) {
    state.SkipWithError(rank.error().message().c_str());
    return nullptr;
  }
  return std::move(*rank);
}

// `bytes` bytes of bf16 values drawn uniformly from [-scale, scale] (bf16 is a float's upper half):
// a block of 1 Mi values drawn, then repeated (drawing a 2 GB tensor's worth would take seconds).
std::vector<std::byte> random_bf16(std::size_t bytes, float scale, unsigned seed) {
  std::vector<std::byte> out(bytes);
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(-scale, scale);
  const std::size_t block = std::min<std::size_t>(bytes, std::size_t{2} << 20);
  for (std::size_t i = 0; i + 1 < block; i += 2) {
    const float v = dist(gen);
    std::uint32_t bits = 0;
    std::memcpy(&bits, &v, sizeof bits);
    const auto half = static_cast<std::uint16_t>(bits >> 16);
    std::memcpy(out.data() + i, &half, sizeof half);
  }
  for (std::size_t i = block; i < bytes; i += block) std::memcpy(out.data() + i, out.data(), std::min(block, bytes - i));
  return out;
}

// Times each iteration's once() from its first enqueue to the stream's end; false (the benchmark
// skipped with the reason) where one fails.
template <class Once>
bool timed_passes(benchmark::State& state, BenchRank& rank, Once& once) {
  for (auto _ : state) {
    const auto start = Clock::now();
    auto r = rank.rt.block_on(once());
    const bool synced = rank.stream->synchronize().has_value();
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - start).count());
    if (!r || !synced) {
      state.SkipWithError(r ? "stream failed" : r.error().message().c_str());
      return false;
    }
  }
  return true;
}

struct AttentionShape {
  std::int64_t B, T, H, KVH, hd;
};

void attention(benchmark::State& state, AttentionKernels kernels, AttentionShape s) {
  auto gpu = gpu_rank(state, {.attention = kernels});
  if (!gpu) return;
  Context& ctx = *gpu->ctx;
  CausalSelfAttention layer(AttentionHeads{s.H, s.KVH, s.hd});
  auto qkv = ctx.empty(Shape{s.B, s.T, (s.H + 2 * s.KVH) * s.hd}, DataType::bf16);
  auto seed = ctx.empty(Shape{s.B, s.T, s.H * s.hd}, DataType::bf16);
  if (!qkv || !seed) {
    state.SkipWithError("out of device memory");
    return;
  }
  if (!ctx.copy_from_host(*qkv, random_bf16(qkv->bytes(), 1.0f, 1)) ||
      !ctx.copy_from_host(*seed, random_bf16(seed->bytes(), 1.0f, 2))) {
    state.SkipWithError("cannot fill the inputs");
    return;
  }
  auto once = [&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(layer, *qkv));
    COSHARD_CO_TRY_ASSIGN(Tensor dqkv, co_await ctx.backward(layer, *seed));
    co_return Result<void>{};
  };
  ctx.reset_activation_peak();
  if (!timed_passes(state, *gpu, once)) return;
  const double forward = 2.0 * static_cast<double>(s.B * s.H * s.T) * static_cast<double>(s.T * s.hd);
  state.counters["TFLOPs"] =
      benchmark::Counter(3.5 * forward * static_cast<double>(state.iterations()) / 1e12, benchmark::Counter::kIsRate);
  state.counters["peak_activation_MiB"] = static_cast<double>(ctx.activation_memory().peak_bytes) / (1 << 20);
}

void adamw(benchmark::State& state, bool multi_tensor) {
  auto gpu = gpu_rank(state);
  if (!gpu) return;
  Context& ctx = *gpu->ctx;
  constexpr int kGroups = 400;
  constexpr std::int64_t kElements = 256 * 1024;
  auto opt = Optimizer::adamw({});
  if (!opt) {
    state.SkipWithError(opt.error().message().c_str());
    return;
  }
  std::vector<Tensor> keep;
  for (int i = 0; i < kGroups; ++i) {
    auto p = ctx.empty(Shape{kElements}, DataType::bf16);
    auto g = ctx.empty(Shape{kElements}, DataType::bf16);
    if (!p || !g) {
      state.SkipWithError("cannot allocate the groups");
      return;
    }
    // Random values (the masters start from them) and small random gradients: the statistics stay
    // finite, so every step runs its update.
    if (!ctx.copy_from_host(*p, random_bf16(kElements * 2, 1.0f, 3 * i + 1)) ||
        !ctx.copy_from_host(*g, random_bf16(kElements * 2, 1e-3f, 3 * i + 2)) || !(*opt)->add_group(ctx, *p, *g)) {
      state.SkipWithError("cannot fill the groups");
      return;
    }
    keep.push_back(*p);
    keep.push_back(*g);
  }
  for (auto _ : state) {
    const auto start = Clock::now();
    Result<void> r;
    if (multi_tensor) {
      r = (*opt)->step(ctx, 1e-4f);
    } else {
      r = (*opt)->begin_grad_stats(ctx);
      for (int i = 0; i < kGroups && r; ++i) r = (*opt)->add_grad_stats(ctx, static_cast<std::size_t>(i));
      for (int i = 0; i < kGroups && r; ++i) r = (*opt)->apply_one(ctx, static_cast<std::size_t>(i), 1e-4f);
      if (r) r = (*opt)->finish_step(ctx);
    }
    const bool synced = gpu->stream->synchronize().has_value();
    state.SetIterationTime(std::chrono::duration<double>(Clock::now() - start).count());
    if (!r || !synced) {
      state.SkipWithError(r ? "stream failed" : r.error().message().c_str());
      return;
    }
  }
  state.counters["groups"] = kGroups;
  state.counters["GB/s"] = benchmark::Counter(  // master, m, v read and written; grad and params in bf16
      static_cast<double>(kGroups * kElements) * (3 * 8 + 2 + 2) * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}

struct NormShape {
  bool layer_norm;  // else RMSNorm
  std::int64_t rows, dim;
};

// The norm's forward and backward (with_norm), or a device copy of one rows x dim tensor.
void norm_or_copy(benchmark::State& state, NormShape s, bool with_norm) {
  auto gpu = gpu_rank(state);
  if (!gpu) return;
  Context& ctx = *gpu->ctx;
  std::unique_ptr<Module> layer;
  if (s.layer_norm)
    layer = std::make_unique<LayerNorm>(s.dim);
  else
    layer = std::make_unique<RmsNorm>(s.dim);
  auto store = ParameterStore::create(ctx, *layer, DataType::bf16);
  auto x = ctx.empty(Shape{s.rows, s.dim}, DataType::bf16);
  auto seed = ctx.empty(Shape{s.rows, s.dim}, DataType::bf16);
  if (!store || !x || !seed) {
    state.SkipWithError("out of device memory");
    return;
  }
  if (!ctx.copy_from_host(*x, random_bf16(x->bytes(), 1.0f, 1)) ||
      !ctx.copy_from_host(*seed, random_bf16(seed->bytes(), 1.0f, 2)) ||
      !ctx.copy_from_host(store->values(), random_bf16(store->values().bytes(), 1.0f, 3)) ||
      !ctx.copy_from_host(store->grads(), std::vector<std::byte>(store->grads().bytes()))) {
    state.SkipWithError("cannot fill the inputs");
    return;
  }
  auto once = [&]() -> async::Task<Result<void>> {
    if (!with_norm) {
      COSHARD_CO_TRY_ASSIGN(Tensor copied, ops::copy(ctx, *x));
      co_return Result<void>{};
    }
    COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(*layer, *x));
    COSHARD_CO_TRY_ASSIGN(Tensor dx, co_await ctx.backward(*layer, *seed));
    co_return Result<void>{};
  };
  if (!timed_passes(state, *gpu, once)) return;
  const double tensors = with_norm ? 5.0 : 2.0;
  state.counters["GBps"] = benchmark::Counter(
      tensors * static_cast<double>(x->bytes()) * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}

struct LogitsShape {
  std::int64_t rows, vocab;
};

// One random target a row below the vocabulary, on the device.
Result<Tensor> random_targets(Context& ctx, LogitsShape s, unsigned seed) {
  std::vector<std::byte> ids(static_cast<std::size_t>(s.rows) * sizeof(std::int32_t));
  std::mt19937 gen(seed);
  for (std::int64_t r = 0; r < s.rows; ++r) {
    const auto id = static_cast<std::int32_t>(gen() % static_cast<std::uint32_t>(s.vocab));
    std::memcpy(ids.data() + r * sizeof id, &id, sizeof id);
  }
  return ctx.upload(ids, Shape{s.rows}, DataType::i32);
}

// The cross-entropy loss's forward and backward (with_loss), or a device copy of the logits.
void cross_entropy_or_copy(benchmark::State& state, LogitsShape s, bool with_loss) {
  auto gpu = gpu_rank(state);
  if (!gpu) return;
  Context& ctx = *gpu->ctx;
  auto logits = ctx.empty(Shape{s.rows, s.vocab}, DataType::bf16);
  auto targets = random_targets(ctx, s, 4);
  if (!logits || !targets || !ctx.copy_from_host(*logits, random_bf16(logits->bytes(), 4.0f, 5))) {
    state.SkipWithError("cannot make the logits and targets");
    return;
  }
  CrossEntropyLoss loss;
  loss.set_targets(*targets);
  auto once = [&]() -> async::Task<Result<void>> {
    if (!with_loss) {
      COSHARD_CO_TRY_ASSIGN(Tensor copied, ops::copy(ctx, *logits));
      co_return Result<void>{};
    }
    COSHARD_CO_TRY_ASSIGN(Tensor value, co_await loss.forward(ctx, *logits));
    COSHARD_CO_TRY_ASSIGN(Tensor dlogits, co_await loss.backward(ctx, value));  // any finite seed
    co_return Result<void>{};
  };
  if (!timed_passes(state, *gpu, once)) return;
  const double tensors = with_loss ? 3.0 : 2.0;
  state.counters["GBps"] = benchmark::Counter(
      tensors * static_cast<double>(logits->bytes()) * static_cast<double>(state.iterations()) / 1e9,
      benchmark::Counter::kIsRate);
}

// The output layer and its loss, forward and backward: fused (chunked) or over the whole logits.
void output_loss(benchmark::State& state, LogitsShape s, std::int64_t dim, bool fused) {
  auto gpu = gpu_rank(state);
  if (!gpu) return;
  Context& ctx = *gpu->ctx;
  Linear head(dim, s.vocab, false);
  auto store = ParameterStore::create(ctx, head, DataType::bf16);
  auto hidden = ctx.empty(Shape{s.rows, dim}, DataType::bf16);
  auto targets = random_targets(ctx, s, 6);
  if (!store || !hidden || !targets || !ctx.copy_from_host(*hidden, random_bf16(hidden->bytes(), 1.0f, 7)) ||
      !gpu->rt.block_on(store->initialize(ctx, 8))) {
    state.SkipWithError("cannot make the output layer, its input and targets");
    return;
  }
  CrossEntropyLoss whole;
  FusedCrossEntropyLoss chunked;
  if (fused && !chunked.attach(head)) {
    state.SkipWithError("cannot attach the fused loss");
    return;
  }
  Loss& loss = fused ? static_cast<Loss&>(chunked) : whole;
  auto once = [&]() -> async::Task<Result<void>> {
    loss.set_targets(*targets);
    COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(head, *hidden));
    COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, std::move(out)));
    COSHARD_CO_TRY_ASSIGN(Tensor d, co_await ctx.backward(loss, value));  // any finite seed
    COSHARD_CO_TRY_ASSIGN(Tensor dx, co_await ctx.backward(head, std::move(d)));
    co_return Result<void>{};
  };
  ctx.reset_activation_peak();
  const std::size_t before = ctx.activation_memory().live_bytes;
  if (!timed_passes(state, *gpu, once)) return;
  const double products = 6.0 * static_cast<double>(s.rows) * static_cast<double>(s.vocab) * static_cast<double>(dim);
  state.counters["TFLOPs"] =
      benchmark::Counter(products * static_cast<double>(state.iterations()) / 1e12, benchmark::Counter::kIsRate);
  state.counters["peak_activation_MiB"] =
      static_cast<double>(ctx.activation_memory().peak_bytes - before) / (1 << 20);
}

const struct {
  const char* name;
  LogitsShape shape;
} kLogitsShapes[] = {
    {"Gpt2XL", {4 * 1024, 50257}},
    {"Llama1B", {4 * 2048, 128256}},
};

const struct {
  const char* name;
  NormShape shape;
} kNormShapes[] = {
    {"Gpt2XL", {true, 16384, 1600}},
    {"Llama1B", {false, 16384, 2048}},
    {"Llama8B", {false, 16384, 4096}},
};

const struct {
  const char* name;
  AttentionShape shape;
} kShapes[] = {
    {"Gpt2XL", {4, 1024, 25, 25, 64}},
    {"Llama1B", {2, 2048, 32, 8, 64}},
    {"Llama8B", {1, 2048, 32, 8, 128}},
};

[[maybe_unused]] const bool registered = [] {
  for (const auto& s : kShapes) {
    benchmark::RegisterBenchmark((std::string("BM_FusedAttention_") + s.name).c_str(), attention,
                                 AttentionKernels::fused, s.shape)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    // cuDNN's fused attention (AttentionKernels::cudnn: the fused kernels where cuDNN is absent;
    // the run header of device_check.sh's bench step says which cuDNN was opened).
    benchmark::RegisterBenchmark((std::string("BM_CudnnAttention_") + s.name).c_str(), attention,
                                 AttentionKernels::cudnn, s.shape)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((std::string("BM_Baseline_MaterializedAttention_") + s.name).c_str(), attention,
                                 AttentionKernels::materialized, s.shape)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const auto& s : kNormShapes) {
    benchmark::RegisterBenchmark((std::string("BM_Norm_") + s.name).c_str(), norm_or_copy, s.shape, true)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((std::string("BM_Baseline_DeviceCopy_") + s.name).c_str(), norm_or_copy, s.shape,
                                 false)
        ->UseManualTime()
        ->Unit(benchmark::kMicrosecond);
  }
  for (const auto& s : kLogitsShapes) {
    benchmark::RegisterBenchmark((std::string("BM_CrossEntropy_") + s.name).c_str(), cross_entropy_or_copy, s.shape,
                                 true)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((std::string("BM_Baseline_LogitsCopy_") + s.name).c_str(), cross_entropy_or_copy,
                                 s.shape, false)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  for (const auto& s : kLogitsShapes) {
    const std::int64_t dim = s.shape.vocab == 50257 ? 1600 : 2048;
    benchmark::RegisterBenchmark((std::string("BM_FusedOutputLoss_") + s.name).c_str(), output_loss, s.shape, dim, true)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
    benchmark::RegisterBenchmark((std::string("BM_Baseline_WholeLogitsLoss_") + s.name).c_str(), output_loss, s.shape,
                                 dim, false)
        ->UseManualTime()
        ->Unit(benchmark::kMillisecond);
  }
  benchmark::RegisterBenchmark("BM_MultiTensorAdamW", adamw, true)->UseManualTime()->Unit(benchmark::kMillisecond);
  benchmark::RegisterBenchmark("BM_Baseline_PerGroupAdamW", adamw, false)->UseManualTime()->Unit(benchmark::kMillisecond);
  return true;
}();

}  // namespace

BENCHMARK_MAIN();
