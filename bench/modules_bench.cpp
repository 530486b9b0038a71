// One unsharded training step of a ~10M-parameter GPT on the CPU backend, beside its limit:
//
//   BM_GptTrainingStep      forward + backward + AdamW through coshard (CPU stream, OpenBLAS)
//   BM_Baseline_SgemmOnly   the same matrix products (shapes, transposes, counts) as bare
//                           cblas_sgemm calls back to back: the step's matmul time with nothing
//                           else, the most a step could reach in GFLOP/s
//
// Both report matmul GFLOP/s (the step's matrix-product FLOPs over each one's time); the ratio
// step / sgemm-only is the fraction of the limit coshard reaches. Model: vocab 4096, dim 320,
// 6 layers, 5 heads, sequence 128, batch 4 (~10.2M parameters).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <random>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/optimizer.hpp"
#include "coshard/modules/parameter_store.hpp"

namespace {

using namespace coshard;
using namespace coshard::modules;

constexpr GptConfig kConfig{.vocab = 4096, .max_seq = 128, .dim = 320, .layers = 6, .heads = 5, .mlp_ratio = 4};
constexpr std::int64_t kBatch = 4;
constexpr std::int64_t kSeq = 128;

struct Gemm {
  bool ta, tb;
  std::int64_t m, n, k, count;
};

// The matrix products of one step, as the layers (modules/src/layers) and the CPU kernels (kernels/cpu/cpu_kernels.cpp) issue them.
std::vector<Gemm> step_gemms() {
  const std::int64_t N = kBatch * kSeq, C = kConfig.dim, H = kConfig.heads, hd = C / H, T = kSeq;
  std::vector<Gemm> g;
  auto linear = [&](std::int64_t in, std::int64_t out) {
    g.push_back({false, true, N, out, in, 1});  // y = x W^T
    g.push_back({false, false, N, in, out, 1}); // dx = dy W
    g.push_back({true, false, out, in, N, 1});  // dW += dy^T x
  };
  for (std::int64_t l = 0; l < kConfig.layers; ++l) {
    linear(C, 3 * C);
    g.push_back({false, true, T, T, hd, kBatch * H});   // S = Q K^T
    g.push_back({false, false, T, hd, T, kBatch * H});  // O = P V
    g.push_back({false, true, T, T, hd, kBatch * H});   // dP = dO V^T
    g.push_back({true, false, T, hd, T, kBatch * H});   // dV = P^T dO
    g.push_back({false, false, T, hd, T, kBatch * H});  // dQ = dS K
    g.push_back({true, false, T, hd, T, kBatch * H});   // dK = dS^T Q
    linear(C, C);
    linear(C, kConfig.mlp_ratio * C);
    linear(kConfig.mlp_ratio * C, C);
  }
  linear(C, kConfig.vocab);
  return g;
}

double step_flops() {
  double f = 0;
  for (const auto& g : step_gemms()) f += 2.0 * static_cast<double>(g.m * g.n * g.k * g.count);
  return f;
}

void BM_GptTrainingStep(benchmark::State& state) {
  async::Runtime rt;
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "compute"});
  auto allocator = async::CachingAllocator::create(async::Device::cpu());
  if (!stream || !allocator) return state.SkipWithError("no CPU stream or allocator");
  auto ctx = Context::create(*stream, **allocator);
  auto model = make_gpt(kConfig);
  if (!ctx || !model) return state.SkipWithError("setup failed");
  auto store = ParameterStore::create(*ctx, **model, DataType::f32);
  auto opt = Optimizer::adamw({}, {.max_grad_norm = 1.0f});
  if (!store || !opt) return state.SkipWithError("setup failed");
  if (!rt.block_on(store->initialize(*ctx, 1)) || !(*opt)->add_group(*ctx, store->values(), store->grads()))
    return state.SkipWithError("setup failed");
  std::mt19937 rng(1);
  std::vector<double> ids(static_cast<std::size_t>(kBatch * kSeq));
  for (auto& v : ids) v = static_cast<double>(rng() % kConfig.vocab);
  auto bytes = encode_values(ids, DataType::i32);
  auto tokens = ctx->upload(bytes, Shape{kBatch, kSeq}, DataType::i32);
  auto targets = ctx->upload(bytes, Shape{kBatch, kSeq}, DataType::i32);
  if (!tokens || !targets) return state.SkipWithError("upload failed");
  CrossEntropyLoss loss;

  auto step = [&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY(store->zero_grad(*ctx));
    COSHARD_CO_TRY_ASSIGN(Tensor value,
                          co_await forward_backward(*ctx, **model, loss, *tokens, *targets, (*opt)->loss_scale()));
    COSHARD_CO_TRY((*opt)->step(*ctx, 1e-4f));
    COSHARD_CO_TRY_ASSIGN(auto done, stream->record());
    co_return co_await done;
  };
  if (auto warm = rt.block_on(step()); !warm) return state.SkipWithError(warm.error().message().c_str());
  for (auto _ : state) {
    auto r = rt.block_on(step());
    if (!r) return state.SkipWithError(r.error().message().c_str());
  }
  state.counters["matmul_GFLOPs"] =
      benchmark::Counter(step_flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
  state.counters["params_M"] = static_cast<double>(store->numel()) * 1e-6;
}
BENCHMARK(BM_GptTrainingStep)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_Baseline_SgemmOnly(benchmark::State& state) {
  const auto gemms = step_gemms();
  std::int64_t largest = 0;
  for (const auto& g : gemms) largest = std::max({largest, g.m * g.k, g.k * g.n, g.m * g.n});
  std::vector<float> a(static_cast<std::size_t>(largest), 0.01f), b(a), c(a);
  for (auto _ : state) {
    for (const auto& g : gemms)
      for (std::int64_t i = 0; i < g.count; ++i)
        cblas_sgemm(CblasRowMajor, g.ta ? CblasTrans : CblasNoTrans, g.tb ? CblasTrans : CblasNoTrans,
                    static_cast<blasint>(g.m), static_cast<blasint>(g.n), static_cast<blasint>(g.k), 1.0f, a.data(),
                    static_cast<blasint>(g.ta ? g.m : g.k), b.data(), static_cast<blasint>(g.tb ? g.k : g.n), 0.0f,
                    c.data(), static_cast<blasint>(g.n));
    benchmark::DoNotOptimize(c.data());
  }
  state.counters["matmul_GFLOPs"] =
      benchmark::Counter(step_flops() * 1e-9, benchmark::Counter::kIsIterationInvariantRate);
}
BENCHMARK(BM_Baseline_SgemmOnly)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
