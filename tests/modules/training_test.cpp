// Unsharded (stage 0) training on the CPU backend: a tiny GPT overfits a fixed batch, runs are
// deterministic, steady-state steps never block the host, and the optimizers match a reference
// written out by hand.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "coshard/async/sync.hpp"
#include "coshard/modules/cpu_threads.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/optimizer.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

struct FixedBatch {
  std::vector<int> tokens, targets;
};

FixedBatch random_batch(std::int64_t B, std::int64_t T, std::int64_t vocab, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> d(0, static_cast<int>(vocab - 1));
  std::vector<int> seq(static_cast<std::size_t>(B * (T + 1)));
  for (auto& t : seq) t = d(rng);
  FixedBatch b;
  for (std::int64_t i = 0; i < B; ++i)
    for (std::int64_t t = 0; t < T; ++t) {
      b.tokens.push_back(seq[static_cast<std::size_t>(i * (T + 1) + t)]);
      b.targets.push_back(seq[static_cast<std::size_t>(i * (T + 1) + t + 1)]);
    }
  return b;
}

class Training : public testing::ModuleFixture {
 protected:
  struct Run {
    std::vector<double> losses;
    std::uint64_t blocking_waits_after_first = 0;
  };

  // Trains `steps` steps of AdamW on one fixed batch; records every loss (read lazily after the
  // step: the read awaits an event, it does not block).
  async::Task<Result<Run>> train(GptConfig config, std::int64_t B, std::int64_t T, int steps, float lr,
                                 std::uint64_t seed, bool strict_after_first) {
    COSHARD_CO_TRY_ASSIGN(auto model, make_gpt(config));
    COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(*ctx_, *model, DataType::f32));
    COSHARD_CO_TRY(co_await store.initialize(*ctx_, seed));
    AdamWOptions adam{.weight_decay = 0.0f};
    StepControlOptions control{.max_grad_norm = 1.0f};
    COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw(adam, control));
    COSHARD_CO_TRY(opt->add_group(*ctx_, store.values(), store.grads()));
    const auto batch = random_batch(B, T, config.vocab, seed + 100);
    Tensor tokens = this->tokens(batch.tokens, Shape{B, T});
    Tensor targets = this->tokens(batch.targets, Shape{B, T});
    CrossEntropyLoss loss;
    Run run;
    std::uint64_t waits_before = 0;
    for (int step = 0; step < steps; ++step) {
      std::optional<async::StrictSyncScope> strict;
      if (step == 1) waits_before = async::blocking_waits();
      if (strict_after_first && step >= 1) strict.emplace();
      COSHARD_CO_TRY(store.zero_grad(*ctx_));
      COSHARD_CO_TRY_ASSIGN(Tensor value,
                            co_await forward_backward(*ctx_, *model, loss, tokens, targets, opt->loss_scale()));
      COSHARD_CO_TRY(opt->step(*ctx_, lr));
      COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx_->read(value));
      run.losses.push_back(host[0]);
    }
    run.blocking_waits_after_first = async::blocking_waits() - waits_before;
    co_return run;
  }
};

TEST_F(Training, TinyGptOverfitsAFixedBatchWithin200Steps) {
  GptConfig config{.vocab = 64, .max_seq = 32, .dim = 64, .layers = 2, .heads = 4, .mlp_ratio = 4};
  auto run = rt_.block_on(train(config, 4, 32, 200, 3e-3f, 1, false));
  ASSERT_TRUE(run) << run.error().message();
  const auto& l = run->losses;
  ASSERT_EQ(l.size(), 200u);
  // An untrained model predicts close to uniform: ln(64) = 4.16.
  EXPECT_NEAR(l.front(), std::log(64.0), 0.3);
  std::size_t reached = l.size();
  for (std::size_t i = 0; i < l.size(); ++i)
    if (l[i] < 0.1 * l.front()) {
      reached = i;
      break;
    }
  EXPECT_LT(reached, l.size()) << "loss " << l.front() << " -> " << l.back() << " after 200 steps";
  RecordProperty("steps_to_10_percent", std::to_string(reached));
  RecordProperty("final_loss", std::to_string(l.back()));
}

TEST_F(Training, SameSeedGivesBitIdenticalLosses) {
  GptConfig config{.vocab = 32, .max_seq = 8, .dim = 32, .layers = 2, .heads = 2, .mlp_ratio = 2};
  auto a = rt_.block_on(train(config, 2, 8, 5, 1e-3f, 42, false));
  auto b = rt_.block_on(train(config, 2, 8, 5, 1e-3f, 42, false));
  auto c = rt_.block_on(train(config, 2, 8, 5, 1e-3f, 43, false));
  ASSERT_TRUE(a && b && c);
  for (std::size_t i = 0; i < a->losses.size(); ++i) EXPECT_EQ(a->losses[i], b->losses[i]) << "step " << i;
  EXPECT_NE(a->losses[0], c->losses[0]);
}

TEST_F(Training, SteadyStateStepsNeverBlockTheHost) {
  GptConfig config{.vocab = 32, .max_seq = 8, .dim = 32, .layers = 2, .heads = 2, .mlp_ratio = 2};
  auto run = rt_.block_on(train(config, 2, 8, 4, 1e-3f, 5, true));
  ASSERT_TRUE(run) << run.error().message();
  EXPECT_EQ(run->blocking_waits_after_first, 0u);
}

// ---- optimizers against a reference written out by hand ----

class Optimizers : public testing::ModuleFixture {
 protected:
  // Runs `steps` steps on params p with the given gradient sequence; returns the final params
  // and the stats.
  async::Task<Result<std::pair<std::vector<double>, OptimizerStats>>> run(
      std::unique_ptr<Optimizer> opt, std::vector<double> p, const std::vector<std::vector<double>>& grads,
      std::vector<float> lrs) {
    const Shape shape{static_cast<std::int64_t>(p.size())};
    Tensor params = host_tensor(p, shape, DataType::f32);
    Tensor g = host_tensor(grads[0], shape, DataType::f32);
    COSHARD_CO_TRY(opt->add_group(*ctx_, params, g));
    for (std::size_t s = 0; s < grads.size(); ++s) {
      COSHARD_CO_TRY(ctx_->copy_from_host(g, encode_values(grads[s], DataType::f32)));
      COSHARD_CO_TRY(opt->step(*ctx_, lrs[s]));
    }
    COSHARD_CO_TRY_ASSIGN(auto out, co_await ctx_->read(params));
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await opt->read_stats(*ctx_));
    co_return std::pair{out, stats};
  }
};

TEST_F(Optimizers, AdamWMatchesTheReferenceWithClipping) {
  const std::vector<double> p0{0.5, -1.0, 2.0};
  const std::vector<std::vector<double>> grads{{0.3, -4.0, 0.0}, {1.0, 1.0, -1.0}, {-0.2, 0.1, 0.05}};
  const float b1 = 0.9f, b2 = 0.99f, eps = 1e-8f, wd = 0.1f, max_norm = 1.0f;
  auto opt = Optimizer::adamw({.beta1 = b1, .beta2 = b2, .eps = eps, .weight_decay = wd}, {.max_grad_norm = max_norm});
  ASSERT_TRUE(opt);
  auto r = rt_.block_on(run(std::move(*opt), p0, grads, {0.1f, 0.05f, 0.02f}));
  ASSERT_TRUE(r) << r.error().message();

  std::vector<double> p = p0, m(3, 0), v(3, 0);
  const double lrs[] = {0.1, 0.05, 0.02};
  double last_norm = 0;
  for (int t = 1; t <= 3; ++t) {
    const auto& g = grads[static_cast<std::size_t>(t - 1)];
    double norm = 0;
    for (double x : g) norm += x * x;
    norm = std::sqrt(norm);
    last_norm = norm;
    const double clip = norm > max_norm ? max_norm / (norm + 1e-6) : 1.0;
    for (int i = 0; i < 3; ++i) {
      const double gi = g[static_cast<std::size_t>(i)] * clip;
      auto& mi = m[static_cast<std::size_t>(i)];
      auto& vi = v[static_cast<std::size_t>(i)];
      mi = b1 * mi + (1 - b1) * gi;
      vi = b2 * vi + (1 - b2) * gi * gi;
      const double update = (mi / (1 - std::pow(b1, t))) / (std::sqrt(vi / (1 - std::pow(b2, t))) + eps);
      auto& pi = p[static_cast<std::size_t>(i)];
      pi = pi * (1 - lrs[t - 1] * wd) - lrs[t - 1] * update;
    }
  }
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(r->first[static_cast<std::size_t>(i)], p[static_cast<std::size_t>(i)], 1e-5);
  EXPECT_EQ(r->second.steps, 3);
  EXPECT_EQ(r->second.skipped_steps, 0);
  EXPECT_NEAR(r->second.grad_norm, last_norm, 1e-5);
}

TEST_F(Optimizers, SgdWithNesterovMomentumMatchesTheReference) {
  const std::vector<double> p0{1.0, -2.0};
  const std::vector<std::vector<double>> grads{{0.5, 0.25}, {-1.0, 0.5}, {0.1, 0.1}};
  const float mu = 0.9f, wd = 0.01f, lr = 0.1f;
  auto opt = Optimizer::sgd({.momentum = mu, .weight_decay = wd, .nesterov = true});
  ASSERT_TRUE(opt);
  auto r = rt_.block_on(run(std::move(*opt), p0, grads, {lr, lr, lr}));
  ASSERT_TRUE(r) << r.error().message();
  std::vector<double> p = p0, buf(2, 0);
  for (std::size_t s = 0; s < grads.size(); ++s)
    for (std::size_t i = 0; i < 2; ++i) {
      const double g = grads[s][i] + wd * p[i];
      buf[i] = s == 0 ? g : mu * buf[i] + g;
      p[i] -= lr * (g + mu * buf[i]);
    }
  for (std::size_t i = 0; i < 2; ++i) EXPECT_NEAR(r->first[i], p[i], 1e-5);
}

TEST_F(Optimizers, DynamicLossScalingSkipsOverflowsAndGrows) {
  const double inf = std::numeric_limits<double>::infinity();
  const std::vector<double> p0{1.0, 1.0};
  // Gradients arrive scaled by the loss scale: step 1 overflows, steps 2-4 are fine.
  const std::vector<std::vector<double>> grads{{inf, 1.0}, {8.0, 8.0}, {8.0, 8.0}, {8.0, 8.0}};
  auto opt = Optimizer::sgd({}, {.loss_scaling = LossScaling::dynamic, .initial_loss_scale = 16.0f,
                                 .growth_factor = 2.0f, .backoff_factor = 0.5f, .growth_interval = 3});
  ASSERT_TRUE(opt);
  auto r = rt_.block_on(run(std::move(*opt), p0, grads, {1.0f, 1.0f, 1.0f, 1.0f}));
  ASSERT_TRUE(r) << r.error().message();
  // Skipped step: scale 16 -> 8. Then three good steps at scale 8 (grad 8 / 8 = 1 each): p = 1 - 3.
  EXPECT_EQ(r->second.skipped_steps, 1);
  EXPECT_EQ(r->second.steps, 3);
  EXPECT_FLOAT_EQ(r->second.loss_scale, 16.0f);  // grew back after growth_interval = 3 good steps
  EXPECT_FALSE(r->second.last_skipped);
  EXPECT_NEAR(r->first[0], -2.0, 1e-6);
  EXPECT_NEAR(r->first[1], -2.0, 1e-6);
}

// bf16/f16 parameters stepped on the CPU (an offloaded optimizer's host step): the fp32 master
// follows the f32 optimizer bit for bit, and the parameters are the master rounded to nearest
// even, through add_group (cast at each step) and through apply_group's params_out (a swapped
// group, as the NVMe optimizer steps it).
TEST_F(Optimizers, Bf16AndF16ParametersStepFromFp32MastersOnTheCpu) {
  constexpr std::size_t n = 1003;
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<double> value(-2.0, 2.0);
  std::vector<std::vector<double>> grads(3, std::vector<double>(n));
  for (auto& g : grads)
    for (auto& x : g) x = value(rng);
  const Shape shape{static_cast<std::int64_t>(n)};
  for (const DataType dt : {DataType::bf16, DataType::f16}) {
    SCOPED_TRACE(std::string(async::to_string(dt)));
    std::vector<double> p0(n);
    for (auto& x : p0) x = value(rng);
    p0 = decode_values(encode_values(p0, dt), dt);  // representable in dt, so the f32 run starts alike
    auto body = [&]() -> async::Task<Result<void>> {
      AdamWOptions adam{.weight_decay = 0.01f};
      StepControlOptions clip{.max_grad_norm = 1.0f};
      COSHARD_CO_TRY_ASSIGN(auto reference, Optimizer::adamw(adam, clip));
      COSHARD_CO_TRY_ASSIGN(auto narrow, Optimizer::adamw(adam, clip));
      COSHARD_CO_TRY_ASSIGN(auto swapped, Optimizer::adamw(adam, clip));
      Tensor p32 = host_tensor(p0, shape, DataType::f32), pn = host_tensor(p0, shape, dt);
      Tensor g = host_tensor(grads[0], shape, DataType::f32);
      Tensor master = host_tensor(p0, shape, DataType::f32), m = host_tensor(std::vector<double>(n), shape, DataType::f32),
             v = host_tensor(std::vector<double>(n), shape, DataType::f32), out = host_tensor(std::vector<double>(n), shape, dt);
      COSHARD_CO_TRY(reference->add_group(*ctx_, p32, g));
      COSHARD_CO_TRY(narrow->add_group(*ctx_, pn, g));
      COSHARD_CO_TRY(swapped->add_swapped_group(*ctx_, g));
      for (std::size_t step = 0; step < grads.size(); ++step) {
        COSHARD_CO_TRY(ctx_->copy_from_host(g, encode_values(grads[step], DataType::f32)));
        COSHARD_CO_TRY(reference->step(*ctx_, 0.05f));
        COSHARD_CO_TRY(narrow->step(*ctx_, 0.05f));
        COSHARD_CO_TRY(swapped->compute_grad_stats(*ctx_));
        COSHARD_CO_TRY(swapped->apply_group(*ctx_, 0, 0.05f, master, m, v, out));
        COSHARD_CO_TRY(swapped->finish_step(*ctx_));
      }
      COSHARD_CO_TRY_ASSIGN(auto want, co_await ctx_->read(p32));
      COSHARD_CO_TRY_ASSIGN(auto narrow_master, co_await ctx_->read(narrow->groups()[0].master));
      COSHARD_CO_TRY_ASSIGN(auto narrow_params, co_await ctx_->read(pn));
      COSHARD_CO_TRY_ASSIGN(auto swapped_master, co_await ctx_->read(master));
      COSHARD_CO_TRY_ASSIGN(auto swapped_params, co_await ctx_->read(out));
      const auto rounded = decode_values(encode_values(want, dt), dt);
      EXPECT_EQ(narrow_master, want);
      EXPECT_EQ(swapped_master, want);
      EXPECT_EQ(narrow_params, rounded);
      EXPECT_EQ(swapped_params, rounded);
      EXPECT_NE(want, p0) << "the parameters moved";
      co_return Result<void>{};
    };
    auto r = rt_.block_on(body());
    ASSERT_TRUE(r) << r.error().message();
  }
}

// The CPU step of a shard big enough to split across cores (the offloaded optimizer's host step):
// AdamW and SGD with momentum, f32 and bf16 parameters, the same bits and gradient norm as on
// one thread.
TEST_F(Optimizers, SplitAcrossCoresTheStepIsBitIdenticalToOneThread) {
  constexpr std::size_t n = 3 * (64 * 4096) + 12345;  // four grains of the split, the last partial
  std::mt19937_64 rng(11);
  std::uniform_real_distribution<double> value(-2.0, 2.0);
  std::vector<std::vector<double>> grads(2, std::vector<double>(n));
  for (auto& g : grads)
    for (auto& x : g) x = value(rng);
  std::vector<double> p0(n);
  for (auto& x : p0) x = value(rng);
  p0 = decode_values(encode_values(p0, DataType::bf16), DataType::bf16);
  const Shape shape{static_cast<std::int64_t>(n)};
  const int threads_before = cpu_math_threads();
  struct Run {
    std::vector<double> params;
    double grad_norm = 0;
  };
  auto run = [&](bool adamw, DataType dt, int threads) -> async::Task<Result<Run>> {
    set_cpu_math_threads(threads);
    StepControlOptions clip{.max_grad_norm = 1.0f};
    COSHARD_CO_TRY_ASSIGN(auto opt, adamw ? Optimizer::adamw({.weight_decay = 0.01f}, clip)
                                          : Optimizer::sgd({.momentum = 0.9f, .weight_decay = 0.0f, .nesterov = true}, clip));
    Tensor p = host_tensor(p0, shape, dt), g = host_tensor(grads[0], shape, DataType::f32);
    COSHARD_CO_TRY(opt->add_group(*ctx_, p, g));
    for (const auto& step : grads) {
      COSHARD_CO_TRY(ctx_->copy_from_host(g, encode_values(step, DataType::f32)));
      COSHARD_CO_TRY(opt->step(*ctx_, 0.05f));
    }
    Run r;
    COSHARD_CO_TRY_ASSIGN(r.params, co_await ctx_->read(p));
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await opt->read_stats(*ctx_));
    r.grad_norm = stats.grad_norm;
    co_return r;
  };
  for (const bool adamw : {true, false}) {
    for (const DataType dt : {DataType::f32, DataType::bf16}) {
      SCOPED_TRACE(std::string(adamw ? "adamw " : "sgd ") + std::string(async::to_string(dt)));
      auto one = rt_.block_on(run(adamw, dt, 1));
      auto four = rt_.block_on(run(adamw, dt, 4));
      ASSERT_TRUE(one) << one.error().message();
      ASSERT_TRUE(four) << four.error().message();
      EXPECT_GE(cpu_math_threads(), 2) << "the split was not exercised";
      EXPECT_EQ(four->params, one->params);
      EXPECT_EQ(four->grad_norm, one->grad_norm);
      EXPECT_NE(one->params, p0) << "the parameters moved";
    }
  }
  set_cpu_math_threads(threads_before);
}

TEST_F(Optimizers, RejectsBadOptionsAndTensorsWithClearErrors) {
  auto bad = Optimizer::adamw({.beta1 = 1.0f});
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("beta1=1"), std::string::npos) << bad.error().message();
  auto bad_norm = Optimizer::sgd({}, {.max_grad_norm = -1.0f});
  ASSERT_FALSE(bad_norm);
  EXPECT_NE(bad_norm.error().message().find("max_grad_norm=-1"), std::string::npos);

  auto opt = Optimizer::adamw({});
  ASSERT_TRUE(opt);
  Tensor p = host_tensor({1, 2, 3}, Shape{3}, DataType::f32);
  Tensor g = host_tensor({1, 2}, Shape{2}, DataType::f32);
  auto r = (*opt)->add_group(*ctx_, p, g);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("f32[3]"), std::string::npos) << r.error().message();
  Tensor p64 = host_tensor({1, 2}, Shape{2}, DataType::f64);
  Tensor g64 = host_tensor({1, 2}, Shape{2}, DataType::f64);
  r = (*opt)->add_group(*ctx_, p64, g64);
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::unsupported);
  EXPECT_FALSE((*opt)->step(*ctx_, 0.1f));  // no groups
}

}  // namespace
}  // namespace coshard::modules
