// The CUDA kernels against the CPU kernels: every layer's output, input gradient and parameter
// gradients from the same inputs and weights, in f32, bf16 and f16, within the dtype's tolerance
// (normwise: ||cuda - cpu|| / ||cpu||). Then a few bf16/f16 training steps of a tiny GPT.
// Skips where there is no GPU (these machines compile the CUDA backend but have none). The CPU
// kernels' own bf16/f16 (f32 compute on copies) run everywhere: the same layer comparison, the
// same training, and the ZeRO engine's offloaded bf16/f16 paths against the resident ones.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>

#include <unistd.h>

#include "../support/gated_linear.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/llama_layers.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/optimizer.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "module_fixture.hpp"
#include "support/sanitizers.hpp"

namespace coshard::modules {
namespace {

using namespace coshard::zero;

using testing::normwise_error;
using testing::random_values;

using testing::dtype_tolerance;

struct Backend {
  std::unique_ptr<async::Stream> stream;
  std::unique_ptr<async::CachingAllocator> allocator;
  std::unique_ptr<Context> ctx;
  static Backend make(async::Device where) {
    Backend d;
    d.stream = std::make_unique<async::Stream>(std::move(*async::Stream::create(where, {.name = where.to_string()})));
    d.allocator = std::move(*async::CachingAllocator::create(where));
    d.ctx = std::make_unique<Context>(std::move(*Context::create(*d.stream, *d.allocator)));
    return d;
  }
};

struct LayerCase {
  std::string name;
  std::function<std::unique_ptr<Module>(Context&, DataType)> make;  // may set targets on the context's device
  Shape input;
  bool token_input = false;
  std::int64_t vocab = 0;
};

struct LayerRun {
  std::vector<double> out, dx, dparams;
};

async::Task<Result<Tensor>> upload(Context& ctx, const std::vector<double>& v, Shape shape, DataType dt) {
  auto bytes = encode_values(v, dt);
  co_return ctx.upload(bytes, shape, dt);
}

async::Task<Result<LayerRun>> run_layer(Context& ctx, const LayerCase& c, DataType dt) {
  auto module = c.make(ctx, dt);
  COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(ctx, *module, dt));
  const auto params = random_values(static_cast<std::size_t>(store.numel()), 1, 0.5);
  COSHARD_CO_TRY(ctx.copy_from_host(store.values(), encode_values(params, dt)));
  std::vector<double> x = random_values(static_cast<std::size_t>(c.input.numel()), 2);
  if (c.token_input)
    for (auto& v : x) v = std::floor((v + 1) / 2 * static_cast<double>(c.vocab - 1) + 0.5);
  COSHARD_CO_TRY_ASSIGN(Tensor input, co_await upload(ctx, x, c.input, c.token_input ? DataType::i32 : dt));
  COSHARD_CO_TRY_ASSIGN(Tensor y, co_await ctx.forward(*module, input));
  const auto r = random_values(static_cast<std::size_t>(y.numel()), 3);
  COSHARD_CO_TRY_ASSIGN(Tensor seed, co_await upload(ctx, r, y.shape(), y.dtype()));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, co_await ctx.backward(*module, seed));
  LayerRun run;
  COSHARD_CO_TRY_ASSIGN(run.out, co_await ctx.read(y));
  if (dx) {
    COSHARD_CO_TRY_ASSIGN(run.dx, co_await ctx.read(dx));
  }
  COSHARD_CO_TRY_ASSIGN(run.dparams, co_await ctx.read(store.grads()));
  co_return run;
}

class CudaLayers : public ::testing::TestWithParam<DataType> {
 protected:
  void SetUp() override {
    COSHARD_SKIP_WITHOUT_CUDA();
    cpu_ = Backend::make(async::Device::cpu());
    gpu_ = Backend::make(async::Device::cuda(0));
  }
  async::Runtime rt_;
  Backend cpu_, gpu_;
};

std::vector<LayerCase> cases() {
  auto targets = [](Context& ctx) {
    std::vector<double> t{1, 0, 4, 3, 2, 2, 0, 1, 3, 4, 4, 0};
    auto bytes = encode_values(t, DataType::i32);
    return *ctx.upload(bytes, Shape{2, 6}, DataType::i32);
  };
  return {
      {"Linear", [](Context&, DataType) { return std::make_unique<Linear>(48, 40); }, Shape{3, 7, 48}},
      // a bias at an odd element offset: cuBLASLt's epilogue declines it, cuBLAS then bias_add serve
      {"LinearUnalignedBias", [](Context&, DataType) { return std::make_unique<Linear>(13, 5); }, Shape{3, 13}},
      {"LayerNorm", [](Context&, DataType) { return std::make_unique<LayerNorm>(96); }, Shape{5, 96}},
      // more rows than a column sum's row lanes, and columns that end inside a tile
      {"LinearManyRows", [](Context&, DataType) { return std::make_unique<Linear>(48, 72); }, Shape{4, 50, 48}},
      {"LayerNormManyRows", [](Context&, DataType) { return std::make_unique<LayerNorm>(200); }, Shape{3, 70, 200}},
      {"RmsNorm", [](Context&, DataType) { return std::make_unique<RmsNorm>(96); }, Shape{5, 96}},
      {"RmsNormManyRows", [](Context&, DataType) { return std::make_unique<RmsNorm>(200); }, Shape{3, 70, 200}},
      {"Gelu", [](Context&, DataType) { return std::make_unique<Gelu>(); }, Shape{4, 50}},
      {"SwiGlu", [](Context&, DataType) { return std::make_unique<SwiGlu>(); }, Shape{3, 7, 64}},
      {"RotaryEmbedding", [](Context&, DataType) { return std::make_unique<RotaryEmbedding>(4, 2, 16); },
       Shape{2, 9, (4 + 2 * 2) * 16}},
      // a user's module written with the public ops (tests/support/gated_linear.hpp)
      {"GatedLinear", [](Context&, DataType) { return std::make_unique<::coshard::testing::GatedLinear>(24); },
       Shape{3, 5, 24}},
      {"CausalSelfAttention", [](Context&, DataType) { return std::make_unique<CausalSelfAttention>(32, 4); },
       Shape{2, 9, 96}},
      {"GroupedQueryAttention",
       [](Context&, DataType) { return std::make_unique<CausalSelfAttention>(AttentionHeads{4, 2, 16}); },
       Shape{2, 9, (4 + 2 * 2) * 16}},
      // head sizes the fused kernels serve (bf16/f16 run fused, f32 materialized), past one tile
      {"FusedSizeAttention",
       [](Context&, DataType) { return std::make_unique<CausalSelfAttention>(AttentionHeads{4, 2, 64}); },
       Shape{2, 70, (4 + 2 * 2) * 64}},
      {"FusedSizeAttentionHd128",
       [](Context&, DataType) { return std::make_unique<CausalSelfAttention>(AttentionHeads{2, 1, 128}); },
       Shape{1, 90, (2 + 2 * 1) * 128}},
      {"Embedding", [](Context&, DataType) { return std::make_unique<Embedding>(20, 8, 16); }, Shape{3, 8}, true, 20},
      {"TokenEmbedding", [](Context&, DataType) { return std::make_unique<TokenEmbedding>(20, 16); }, Shape{3, 8}, true, 20},
      // the whole Llama: tied embeddings (the table's two uses), every Llama layer, a checkpointed block
      {"TinyLlamaCheckpointed",
       [](Context&, DataType) -> std::unique_ptr<Module> {
         auto m = make_llama({.vocab = 20, .max_seq = 8, .dim = 32, .layers = 2, .heads = 4, .kv_heads = 2,
                              .intermediate = 48, .rope_theta = 10000.0, .tie_embeddings = true});
         apply_activation_checkpointing(**m, ActivationCheckpointing{1});
         return std::move(*m);
       },
       Shape{3, 8}, true, 20},
      {"CrossEntropyLoss",
       [targets](Context& ctx, DataType) {
         auto m = std::make_unique<CrossEntropyLoss>();
         m->set_targets(targets(ctx));
         return m;
       },
       Shape{2, 6, 5}},
      {"MeanSquaredErrorLoss",
       [](Context& ctx, DataType dt) {
         std::vector<double> t(3 * 7);
         for (std::size_t i = 0; i < t.size(); ++i) t[i] = 0.1 * static_cast<double>(i % 5) - 0.2;
         auto m = std::make_unique<MeanSquaredErrorLoss>();
         m->set_targets(*ctx.upload(encode_values(t, dt), Shape{3, 7}, dt));
         return m;
       },
       Shape{3, 7}},
  };
}

// Every layer run in `dt` on `ctx` against the same run in `want_dt` on `want_ctx`: output, input
// gradient and parameter gradients within `tol` (normwise).
void expect_layers_match(async::Runtime& rt, Context& want_ctx, DataType want_dt, Context& ctx, DataType dt,
                         double tol) {
  for (const auto& c : cases()) {
    SCOPED_TRACE(std::string(collectives::to_string(dt)) + " " + c.name);
    auto want = rt.block_on(run_layer(want_ctx, c, want_dt));
    ASSERT_TRUE(want) << want.error().message();
    auto got = rt.block_on(run_layer(ctx, c, dt));
    ASSERT_TRUE(got) << got.error().message();
    EXPECT_FALSE(want->out.empty());
    EXPECT_LT(normwise_error(got->out, want->out), tol) << "output";
    EXPECT_LT(normwise_error(got->dx, want->dx), tol) << "input gradient";
    if (!want->dparams.empty()) EXPECT_LT(normwise_error(got->dparams, want->dparams), tol) << "parameters";
  }
}

TEST_P(CudaLayers, MatchTheCpuKernels) {
  expect_layers_match(rt_, *cpu_.ctx, DataType::f32, *gpu_.ctx, GetParam(), dtype_tolerance(GetParam()));
}

// The same comparison on the CPU alone (f32 against f64), so the harness itself runs everywhere.
TEST(CudaLayersHarness, CpuF32AgainstCpuF64) {
  async::Runtime rt;
  auto cpu = Backend::make(async::Device::cpu());
  expect_layers_match(rt, *cpu.ctx, DataType::f64, *cpu.ctx, DataType::f32, 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaLayers, ::testing::Values(DataType::f32, DataType::bf16, DataType::f16),
                         [](const auto& info) { return std::string(collectives::to_string(info.param)); });

// Mixed precision training: bf16 (no scaling) and f16 (dynamic loss scaling) parameters with
// fp32 master weights; the loss must fall on a fixed batch.
class CudaTraining : public CudaLayers {};

async::Task<Result<std::pair<double, double>>> train_tiny_gpt(Context& ctx, DataType dt, bool llama = false) {
  GptConfig config;
  config.vocab = 64;
  config.max_seq = 16;
  COSHARD_CO_TRY_ASSIGN(auto model, llama ? make_llama({.vocab = 64, .max_seq = 16, .dim = 128, .layers = 2, .heads = 2,
                                                        .kv_heads = 1, .intermediate = 128, .tie_embeddings = true})
                                          : make_gpt(config));
  // The Llama's head size is 64: bf16/f16 train through the fused attention.
  if (llama) apply_activation_checkpointing(*model, ActivationCheckpointing{2});
  COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(ctx, *model, dt));
  COSHARD_CO_TRY(co_await store.initialize(ctx, 1));
  StepControlOptions control;
  control.max_grad_norm = 1.0f;
  if (dt == DataType::f16) control.loss_scaling = LossScaling::dynamic;
  AdamWOptions adam;
  adam.weight_decay = 0.0f;
  COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw(adam, control));
  COSHARD_CO_TRY(opt->add_group(ctx, store.values(), store.grads()));
  std::vector<double> tok(4 * 16), tgt(4 * 16);
  for (std::size_t i = 0; i < tok.size(); ++i) {
    tok[i] = static_cast<double>((i * 7) % 64);
    tgt[i] = static_cast<double>((i * 7 + 3) % 64);
  }
  const Shape batch{4, 16};
  COSHARD_CO_TRY_ASSIGN(Tensor tokens, co_await upload(ctx, tok, batch, DataType::i32));
  COSHARD_CO_TRY_ASSIGN(Tensor targets, co_await upload(ctx, tgt, batch, DataType::i32));
  CrossEntropyLoss loss;
  double first = 0, last = 0;
  for (int step = 0; step < 60; ++step) {
    COSHARD_CO_TRY(store.zero_grad(ctx));
    COSHARD_CO_TRY_ASSIGN(Tensor value, co_await forward_backward(ctx, *model, loss, tokens, targets, opt->loss_scale()));
    COSHARD_CO_TRY(opt->step(ctx, 3e-3f));
    COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx.read(value));
    (step == 0 ? first : last) = host[0];
  }
  std::pair<double, double> out(first, last);
  co_return out;
}

TEST_P(CudaTraining, TinyGptLossFalls) {
  auto r = rt_.block_on(train_tiny_gpt(*gpu_.ctx, GetParam()));
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_NEAR(r->first, std::log(64.0), 0.5);
  EXPECT_LT(r->second, 0.5 * r->first);
}

TEST_P(CudaTraining, TinyLlamaWithCheckpointingLossFalls) {
  auto r = rt_.block_on(train_tiny_gpt(*gpu_.ctx, GetParam(), true));
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_NEAR(r->first, std::log(64.0), 0.5);
  EXPECT_LT(r->second, 0.5 * r->first);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaTraining, ::testing::Values(DataType::f32, DataType::bf16, DataType::f16),
                         [](const auto& info) { return std::string(collectives::to_string(info.param)); });

// The ZeRO engine on the GPU (NCCL, world size 1): stage 3 in f32, bf16 and f16 with fp32
// gradient shards and masters; the loss falls on a fixed batch, with and without the optimizer
// offloaded (f32).
class CudaZero : public CudaLayers {};

// The loss of each step (60 unless told) on one fixed batch.
// How the optimizer steps: after backward with global-norm clipping (and dynamic loss scaling for
// f16), after backward without either, or each unit during backward (which needs neither).
enum class Stepping { clipped, unclipped, in_backward };

async::Task<Result<std::vector<double>>> train_zero(Context& ctx, collectives::Communicator& comm, DataType dt,
                                                   OptimizerOffload offload, OffloadTarget params,
                                                   const std::filesystem::path& nvme_path,
                                                   Stepping stepping = Stepping::clipped, int steps = 60) {
  GptConfig config;
  config.vocab = 64;
  config.max_seq = 16;
  COSHARD_CO_TRY_ASSIGN(auto model, make_gpt(config));
  StepControlOptions control;
  if (stepping == Stepping::clipped) {
    control.max_grad_norm = 1.0f;
    if (dt == DataType::f16) control.loss_scaling = LossScaling::dynamic;
  }
  AdamWOptions adam;
  adam.weight_decay = 0.0f;
  COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw(adam, control));
  EngineOptions o;
  o.step_in_backward = stepping == Stepping::in_backward;
  o.zero_stage = 3;
  o.dtype = dt;
  o.prefetch_bucket_bytes = 1 << 20;
  o.timing = true;
  o.offload_optimizer = offload;
  o.offload_params = params;
  o.offload_optimizer.nvme_path = nvme_path;
  COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(ctx, comm, *model, *opt, o));
  COSHARD_CO_TRY(co_await engine->initialize(1));
  std::vector<double> tok(4 * 16), tgt(4 * 16);
  for (std::size_t i = 0; i < tok.size(); ++i) {
    tok[i] = static_cast<double>((i * 7) % 64);
    tgt[i] = static_cast<double>((i * 7 + 3) % 64);
  }
  const Shape batch{4, 16};
  COSHARD_CO_TRY_ASSIGN(Tensor tokens, co_await upload(ctx, tok, batch, DataType::i32));
  COSHARD_CO_TRY_ASSIGN(Tensor targets, co_await upload(ctx, tgt, batch, DataType::i32));
  std::vector<Batch> micro{Batch{tokens, targets}};
  CrossEntropyLoss loss;
  std::vector<double> losses;
  for (int step = 0; step < steps; ++step) {
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->step(loss, micro, 3e-3f));
    if (!stats.exposed_comm_ms) co_return fail(ErrorCode::internal, "no exposed_comm_ms with timing on");
    losses.push_back(stats.loss);
  }
  co_return losses;
}

// `got` follows `want` closely for the first steps (where a wrong update would show at once) and
// loosely at the end (different rounding, here the CPU's AdamW against the GPU's, or another
// order of sums, grows over 60 steps on a fixed batch, as does the token embedding's atomic
// gradient, which is not bit-reproducible run to run).
void expect_same_training(const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (std::size_t i = 0; i < 10; ++i) EXPECT_NEAR(got[i], want[i], 1e-3 * want[i]) << what << ", step " << i;
  EXPECT_NEAR(got.back(), want.back(), 0.05 * want.back()) << what << ", last step";
}

TEST_P(CudaZero, Stage3LossFalls) {
  auto comm = collectives::communicator_from_env(rt_);
  ASSERT_TRUE(comm) << comm.error().message();
  const auto folder = std::filesystem::current_path() / ("cuda_zero_" + std::to_string(::getpid()));
  const std::filesystem::path no_path;  // (an lvalue: see the GCC 12 coroutine trap in the README)
  auto r = rt_.block_on(train_zero(*gpu_.ctx, **comm, GetParam(), OptimizerOffload::none, OffloadTarget::none, no_path));
  ASSERT_TRUE(r) << r.error().message();
  EXPECT_NEAR(r->front(), std::log(64.0), 0.5);
  EXPECT_LT(r->back(), 0.5 * r->front());
  // Offloaded in every dtype (bf16/f16: the host writes the parameters from its fp32 masters):
  // the optimizer in pinned memory or on NVMe, the parameter shards on the device or pinned.
  struct Case {
    OptimizerOffload optimizer;
    OffloadTarget params;
    const char* what;
  };
  for (const Case& c : {Case{OptimizerOffload::cpu, OffloadTarget::none, "optimizer offloaded to the CPU"},
                        Case{OptimizerOffload::nvme, OffloadTarget::none, "optimizer offloaded to NVMe"},
                        Case{OptimizerOffload::cpu, OffloadTarget::cpu, "optimizer and parameters offloaded to the CPU"},
                        Case{OptimizerOffload::nvme, OffloadTarget::cpu, "optimizer on NVMe, parameters on the CPU"}}) {
    auto offloaded = rt_.block_on(train_zero(*gpu_.ctx, **comm, GetParam(), c.optimizer, c.params, folder));
    ASSERT_TRUE(offloaded) << c.what << ": " << offloaded.error().message();
    expect_same_training(*offloaded, *r, c.what);
  }
  std::filesystem::remove_all(folder);
}

INSTANTIATE_TEST_SUITE_P(Dtypes, CudaZero, ::testing::Values(DataType::f32, DataType::bf16, DataType::f16),
                         [](const auto& info) { return std::string(collectives::to_string(info.param)); });

}  // namespace
}  // namespace coshard::modules

namespace coshard::modules {
namespace {

using namespace coshard::zero;

// Ranks as threads sharing the GPU (the Local backend on device memory): stage 3 at world size
// 2, each rank with the same batch, trains like world size 1 (the averaged gradients are the
// same; only the order of the gradient-norm sums differs), with and without the optimizer
// offloaded.
TEST(CudaLocalRanks, TwoRanksSharingTheGpuTrainLikeOne) {
  COSHARD_SKIP_WITHOUT_CUDA();
  const std::filesystem::path no_path;  // (an lvalue: see the GCC 12 coroutine trap in the README)
  for (OptimizerOffload offload : {OptimizerOffload::none, OptimizerOffload::cpu}) {
    std::vector<std::vector<double>> losses;
    for (int world : {1, 2}) {
      auto comms = collectives::make_local_communicators(world, {.device = async::Device::cuda(0)});
      ASSERT_TRUE(comms) << comms.error().message();
      std::vector<Result<std::vector<double>>> results(static_cast<std::size_t>(world),
                                                       fail(ErrorCode::internal, "not run"));
      std::vector<std::thread> threads;
      for (int r = 0; r < world; ++r) {
        threads.emplace_back([&, r] {
          async::Runtime rt;
          Backend gpu = Backend::make(async::Device::cuda(0));
          results[static_cast<std::size_t>(r)] =
              rt.block_on(train_zero(*gpu.ctx, *(*comms)[static_cast<std::size_t>(r)], DataType::f32, offload,
                                     OffloadTarget::none, no_path));
        });
      }
      for (auto& t : threads) t.join();
      for (auto& r : results) ASSERT_TRUE(r) << r.error().message();
      EXPECT_EQ(*results[0], *results.back()) << "every rank reports the same losses";
      losses.push_back(*results[0]);
    }
    EXPECT_EQ(losses[0].front(), losses[1].front()) << "the first loss comes before any update";
    expect_same_training(losses[1], losses[0], "world size 2 against 1");
    EXPECT_LT(losses[1].back(), 0.5 * losses[1].front());
  }
}

}  // namespace
}  // namespace coshard::modules

namespace coshard::modules {
namespace {

using namespace coshard::zero;

// The CPU kernels in bf16 and f16 (f32 on copies, each output rounded once) against their f32:
// within the dtype's rounding, as the CUDA kernels are held to.
TEST(CpuHalfPrecision, LayersMatchF32WithinTheirRounding) {
  async::Runtime rt;
  auto cpu = Backend::make(async::Device::cpu());
  for (const DataType dt : {DataType::bf16, DataType::f16})
    expect_layers_match(rt, *cpu.ctx, DataType::f32, *cpu.ctx, dt, dtype_tolerance(dt));
}

TEST(CpuHalfPrecision, TinyGptLossFalls) {
  async::Runtime rt;
  auto cpu = Backend::make(async::Device::cpu());
  for (const DataType dt : {DataType::bf16, DataType::f16}) {
    SCOPED_TRACE(std::string(collectives::to_string(dt)));
    auto r = rt.block_on(train_tiny_gpt(*cpu.ctx, dt));
    ASSERT_TRUE(r) << r.error().message();
    EXPECT_NEAR(r->first, std::log(64.0), 0.5);
    EXPECT_LT(r->second, 0.5 * r->first);
  }
}

// The engine's bf16/f16 offload paths (the host step writing the compute-dtype parameters from
// its fp32 masters into pinned memory, through the staging buffer for NVMe; parameters on NVMe
// rounded from the masters as they are read; the masters widened from the shards at start)
// against the resident engine: the same kernels in the same order, so
// the same losses bit for bit: with clipping and (f16) dynamic loss scaling, and stepping each
// unit during backward against the resident engine stepping after it without them.
TEST(CpuHalfPrecision, OffloadedZeroTrainsBitForBitLikeResident) {
  async::Runtime rt;
  auto cpu = Backend::make(async::Device::cpu());
  auto comms = collectives::make_local_communicators(1);
  ASSERT_TRUE(comms) << comms.error().message();
  const auto folder = std::filesystem::current_path() / ("cpu_half_zero_" + std::to_string(::getpid()));
  std::filesystem::remove_all(folder);
  const std::filesystem::path no_path;  // (an lvalue: see the GCC 12 coroutine trap in the README)
  constexpr int kSteps = 12;  // (bit-exact comparisons: a wrong update shows at once)
  struct Case {
    OptimizerOffload optimizer;
    OffloadTarget params;
    const char* what;
  };
  for (const DataType dt : {DataType::bf16, DataType::f16}) {
    for (const bool in_backward : {false, true}) {
      // Under a sanitizer one stepping per dtype (bf16 after backward, f16 in it): every offload
      // path still runs both dtypes' kernels, in half the time.
      if (coshard::testing::kSanitized && in_backward != (dt == DataType::f16)) continue;
      SCOPED_TRACE(std::string(collectives::to_string(dt)) + (in_backward ? ", stepped in backward" : ""));
      auto resident = rt.block_on(train_zero(*cpu.ctx, *(*comms)[0], dt, OptimizerOffload::none, OffloadTarget::none,
                                             no_path, in_backward ? Stepping::unclipped : Stepping::clipped, kSteps));
      ASSERT_TRUE(resident) << resident.error().message();
      EXPECT_LT(resident->back(), resident->front());
      for (const Case& c :
           {Case{OptimizerOffload::cpu, OffloadTarget::none, "optimizer offloaded to the CPU"},
            Case{OptimizerOffload::nvme, OffloadTarget::none, "optimizer offloaded to NVMe"},
            Case{OptimizerOffload::cpu, OffloadTarget::cpu, "optimizer and parameters offloaded to the CPU"},
            Case{OptimizerOffload::nvme, OffloadTarget::cpu, "optimizer on NVMe, parameters on the CPU"},
            Case{OptimizerOffload::nvme, OffloadTarget::nvme, "optimizer and parameters on NVMe"}}) {
        auto offloaded = rt.block_on(train_zero(*cpu.ctx, *(*comms)[0], dt, c.optimizer, c.params, folder,
                                                in_backward ? Stepping::in_backward : Stepping::clipped, kSteps));
        ASSERT_TRUE(offloaded) << c.what << ": " << offloaded.error().message();
        EXPECT_EQ(*offloaded, *resident) << c.what;
      }
    }
  }
  std::filesystem::remove_all(folder);
}

}  // namespace
}  // namespace coshard::modules
