// Every layer's analytic backward against central finite differences, in f64 on the CPU.
//
// For a module f, the scalar L = sum(r * f(x)) with a fixed random r has dL/dy = r, so running
// backward with grad_output = r gives dL/dx and dL/dparams; each is compared, element by
// element, with (L(v + h) - L(v - h)) / 2h. Relative error: |a - n| / max(|a| + |n|, floor),
// floor = 1e-3 * the largest |analytic| of the check (at least 1e-8): a central difference
// carries ~1e-16 * |L| / h of rounding noise whatever the gradient, so for the few elements
// whose gradient is 1e-6 of the largest, a bare relative error measures that noise, not the
// backward.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/llama_layers.hpp"
#include "coshard/modules/lora.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "module_fixture.hpp"
#include "../support/gated_linear.hpp"
#include "../support/scale_shift.hpp"

namespace coshard::modules {
namespace {

constexpr double kStep = 1e-5;
constexpr double kTolerance = 1e-6;

using testing::random_values;

double relative_error_floor(double a, double n, double floor) {
  return std::abs(a - n) / std::max(std::abs(a) + std::abs(n), floor);
}

class GradCheck : public testing::ModuleFixture {
 protected:
  // L(x) = sum(r * module(x)); the stream is drained before reading.
  async::Task<Result<double>> objective(Module& m, Tensor x, const std::vector<double>& r) {
    COSHARD_CO_TRY_ASSIGN(Tensor y, co_await ctx_->forward(m, x));
    COSHARD_CO_TRY(co_await drained());
    m.clear_saved_recursive();
    if (static_cast<std::size_t>(y.numel()) != r.size())
      co_return fail(ErrorCode::internal, "output ", y.describe(), " vs r of ", r.size());
    double sum = 0;
    auto ys = y.span<double>();
    for (std::size_t i = 0; i < r.size(); ++i) sum += r[i] * ys[i];
    co_return sum;
  }

  // Checks dL/dx (when x is floating) and dL/dp for every parameter of `m`.
  async::Task<Result<void>> check(Module& m, Tensor x, std::uint64_t seed) {
    COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(*ctx_, m, DataType::f64));
    COSHARD_CO_TRY(co_await drained());
    // Random parameters (not the layer defaults: unit gains and zero biases would hide errors).
    auto pv = random_values(static_cast<std::size_t>(store.numel()), seed + 1, 0.5);
    std::copy(pv.begin(), pv.end(), store.values().span<double>().begin());

    // Analytic: one forward, backward with r.
    COSHARD_CO_TRY_ASSIGN(Tensor y0, co_await ctx_->forward(m, x));
    const auto r = random_values(static_cast<std::size_t>(y0.numel()), seed + 2);
    Tensor seed_grad = host_tensor(r, y0.shape(), DataType::f64);
    COSHARD_CO_TRY_ASSIGN(Tensor dx, co_await ctx_->backward(m, seed_grad));
    COSHARD_CO_TRY(co_await drained());
    const std::vector<double> analytic_params(store.grads().span<double>().begin(), store.grads().span<double>().end());
    std::vector<double> analytic_x;
    if (dx) analytic_x.assign(dx.span<double>().begin(), dx.span<double>().end());

    auto numeric = [&](std::span<double> values, std::size_t i) -> async::Task<Result<double>> {
      const double saved = values[i];
      values[i] = saved + kStep;
      COSHARD_CO_TRY_ASSIGN(double up, co_await objective(m, x, r));
      values[i] = saved - kStep;
      COSHARD_CO_TRY_ASSIGN(double down, co_await objective(m, x, r));
      values[i] = saved;
      co_return (up - down) / (2 * kStep);
    };

    double largest = 0;
    for (double a : analytic_params) largest = std::max(largest, std::abs(a));
    for (double a : analytic_x) largest = std::max(largest, std::abs(a));
    const double floor = std::max(1e-3 * largest, 1e-8);
    auto relative_error = [floor](double a, double n) { return relative_error_floor(a, n, floor); };
    double worst = 0;
    for (const auto& e : store.entries()) {
      auto values = e.parameter->value().span<double>();
      for (std::size_t i = 0; i < values.size(); ++i) {
        COSHARD_CO_TRY_ASSIGN(double n, co_await numeric(values, i));
        const double a = analytic_params[static_cast<std::size_t>(e.offset) + i];
        worst = std::max(worst, relative_error(a, n));
        EXPECT_LT(relative_error(a, n), kTolerance) << e.name << "[" << i << "]: analytic " << a << ", numeric " << n;
      }
    }
    if (x.dtype() == DataType::f64) {
      EXPECT_EQ(analytic_x.size(), static_cast<std::size_t>(x.numel()));
      auto xs = x.span<double>();
      for (std::size_t i = 0; i < xs.size() && i < analytic_x.size(); ++i) {
        COSHARD_CO_TRY_ASSIGN(double n, co_await numeric(xs, i));
        worst = std::max(worst, relative_error(analytic_x[i], n));
        EXPECT_LT(relative_error(analytic_x[i], n), kTolerance)
            << "input[" << i << "]: analytic " << analytic_x[i] << ", numeric " << n;
      }
    } else {
      EXPECT_FALSE(dx) << "integer inputs have no gradient";
    }
    RecordProperty("worst_relative_error", std::to_string(worst));
    co_return Result<void>{};
  }

  // The f64 output of one forward, read after the stream passed it.
  async::Task<Result<std::vector<double>>> forward_values(Module& m, Tensor x) {
    COSHARD_CO_TRY_ASSIGN(Tensor y, co_await ctx_->forward(m, x));
    COSHARD_CO_TRY(co_await drained());
    co_return std::vector<double>(y.span<double>().begin(), y.span<double>().end());
  }

  void run_check(Module& m, Tensor x, std::uint64_t seed = 7) {
    auto r = rt_.block_on(check(m, std::move(x), seed));
    ASSERT_TRUE(r) << r.error().message();
  }

  Tensor random_input(Shape shape, std::uint64_t seed) {
    return host_tensor(random_values(static_cast<std::size_t>(shape.numel()), seed), shape, DataType::f64);
  }
};

TEST_F(GradCheck, Linear) {
  Linear m(5, 3);
  run_check(m, random_input(Shape{2, 4, 5}, 11));
}

TEST_F(GradCheck, LinearWithoutBias) {
  Linear m(4, 6, false);
  run_check(m, random_input(Shape{3, 4}, 12));
}

// A Linear with low-rank adapters (lora.hpp): one over every output row and one over rows 2-4 (as
// a fused projection's q, k or v), everything training, so W, b, each A and B and the input are
// all checked. The store's random values make B nonzero.
TEST_F(GradCheck, LinearWithLowRankAdapters) {
  Linear m(5, 7);
  const LoraOptions o{.targets = {"unused"}, .rank = 2, .alpha = 3};
  ASSERT_TRUE(m.add_lora("lora", 0, 7, o));
  ASSERT_TRUE(m.add_lora("lora_rows", 2, 5, o));
  run_check(m, random_input(Shape{2, 3, 5}, 31));
}

TEST_F(GradCheck, LayerNorm) {
  LayerNorm m(6);
  run_check(m, random_input(Shape{2, 3, 6}, 13));
}

TEST_F(GradCheck, RmsNorm) {
  RmsNorm m(6);
  run_check(m, random_input(Shape{2, 3, 6}, 16));
}

TEST_F(GradCheck, SwiGlu) {
  SwiGlu m;
  run_check(m, random_input(Shape{2, 3, 10}, 17));
}

TEST_F(GradCheck, RotaryEmbeddingWithGroupedKeyValueHeads) {
  RotaryEmbedding m(4, 2, 6, 10000.0);  // 4 query heads, 2 key/value heads of 6
  run_check(m, random_input(Shape{2, 5, (4 + 2 * 2) * 6}, 18));
}

// transformers' convention by hand: at position t, dimension i of a query or key head pairs with
// i + head_dim/2 and turns by t * theta^(-2i/head_dim); value heads and position 0 pass unchanged.
TEST_F(GradCheck, RotaryTurnsQueryAndKeyHeadsInTransformersConvention) {
  RotaryEmbedding m(1, 1, 4, 100.0);
  ASSERT_EQ(m.inv_freq().size(), 2u);
  EXPECT_FLOAT_EQ(m.inv_freq()[0], 1.0f);
  EXPECT_FLOAT_EQ(m.inv_freq()[1], 0.1f);
  std::vector<double> x(2 * 12);  // [1, 2, (1 + 2) * 4]
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = 1.0 + static_cast<double>(i);
  auto y = rt_.block_on(forward_values(m, host_tensor(x, Shape{1, 2, 12}, DataType::f64)));
  ASSERT_TRUE(y.has_value()) << y.error().message();
  for (std::size_t i = 0; i < 12; ++i) EXPECT_DOUBLE_EQ((*y)[i], x[i]) << "position 0, element " << i;
  for (std::size_t i = 20; i < 24; ++i) EXPECT_DOUBLE_EQ((*y)[i], x[i]) << "the value head at position 1";
  for (std::size_t head = 0; head < 2; ++head) {  // the query head and the key head at position 1
    const std::size_t at = 12 + head * 4;
    for (std::size_t i = 0; i < 2; ++i) {
      const double a = static_cast<double>(m.inv_freq()[i]);
      EXPECT_NEAR((*y)[at + i], x[at + i] * std::cos(a) - x[at + i + 2] * std::sin(a), 1e-12);
      EXPECT_NEAR((*y)[at + i + 2], x[at + i + 2] * std::cos(a) + x[at + i] * std::sin(a), 1e-12);
    }
  }
}

TEST(Rotary, Llama3ScalingStretchesLongWavelengthsOnlyAndBadShapesAreNamed) {
  const RopeScaling llama3{.factor = 32, .low_freq_factor = 1, .high_freq_factor = 4, .original_max_positions = 8192};
  RotaryEmbedding plain(32, 8, 64, 500000.0), scaled(32, 8, 64, 500000.0, llama3);
  ASSERT_EQ(plain.inv_freq().size(), 32u);
  EXPECT_EQ(scaled.inv_freq().front(), plain.inv_freq().front());  // the highest frequency: kept
  EXPECT_NEAR(scaled.inv_freq().back(), plain.inv_freq().back() / 32, 1e-12);  // the lowest: stretched 32 times
  for (std::size_t i = 0; i < 32; ++i) EXPECT_LE(scaled.inv_freq()[i], plain.inv_freq()[i]);
  EXPECT_FALSE(RotaryEmbedding(6, 4, 64).check().has_value());  // 4 key/value heads do not divide 6
  EXPECT_FALSE(RotaryEmbedding(4, 4, 7).check().has_value());   // odd head_dim
  EXPECT_FALSE(RotaryEmbedding(4, 4, 8, 0.5).check().has_value());
  EXPECT_FALSE(RotaryEmbedding(4, 4, 8, 1e4, RopeScaling{.factor = 8, .low_freq_factor = 4, .high_freq_factor = 1})
                   .check()
                   .has_value());
}

TEST_F(GradCheck, Gelu) {
  Gelu m;
  run_check(m, random_input(Shape{4, 5}, 14));
}

TEST_F(GradCheck, CausalSelfAttention) {
  CausalSelfAttention m(8, 2);
  run_check(m, random_input(Shape{2, 5, 24}, 15));
}

TEST_F(GradCheck, GroupedQueryAttention) {
  CausalSelfAttention m(AttentionHeads{.n_heads = 4, .n_kv_heads = 2, .head_dim = 3});
  run_check(m, random_input(Shape{2, 5, (4 + 2 * 2) * 3}, 19));
}

// With every query head its own key/value head, grouped-query attention is multi-head attention:
// the same bits.
TEST_F(GradCheck, GroupedQueryAttentionWithAHeadPerGroupIsMultiHead) {
  CausalSelfAttention mha(12, 4), gqa(AttentionHeads{.n_heads = 4, .n_kv_heads = 4, .head_dim = 3});
  const Tensor x = random_input(Shape{2, 5, 36}, 20);
  auto a = rt_.block_on(forward_values(mha, x));
  auto b = rt_.block_on(forward_values(gqa, x));
  ASSERT_TRUE(a.has_value() && b.has_value());
  EXPECT_EQ(*a, *b);
  EXPECT_FALSE(rt_.block_on(forward_values(*std::make_unique<CausalSelfAttention>(AttentionHeads{4, 3, 2}), x)).has_value());
}

TEST_F(GradCheck, Embedding) {
  Embedding m(7, 6, 4);
  run_check(m, tokens({0, 3, 6, 3, 1, 2, 2, 5}, Shape{2, 4}));
}

TEST_F(GradCheck, TokenEmbedding) {
  TokenEmbedding m(7, 4);
  run_check(m, tokens({0, 3, 6, 3, 1, 2, 2, 5}, Shape{2, 4}));
}

// One table for the tokens in and the logits out: both uses add into its one gradient.
TEST_F(GradCheck, TiedEmbeddingAndHead) {
  Sequential m;
  auto& table = m.add("embed", std::make_unique<TokenEmbedding>(7, 4));
  m.add("norm", std::make_unique<RmsNorm>(4));
  m.add("head", std::make_unique<TiedHead>(table));
  run_check(m, tokens({0, 3, 6, 3, 1, 2, 2, 5}, Shape{2, 4}));
}

// A checkpointed block: forward keeps its input only, backward recomputes.
TEST_F(GradCheck, CheckpointedBlock) {
  auto inner = std::make_unique<Sequential>();
  inner->add("norm", std::make_unique<RmsNorm>(4));
  inner->add("fc", std::make_unique<Linear>(4, 8, false));
  inner->add("swiglu", std::make_unique<SwiGlu>());
  Sequential m;
  m.add("block", std::make_unique<Checkpointed>(std::make_unique<Residual>(std::move(inner))));
  run_check(m, random_input(Shape{3, 4}, 21));
}

// A layer with one parameter frozen (its gradient unbound) still adds the gradients of the others,
// exactly those of the layer with every parameter training.
TEST_F(GradCheck, APartlyFrozenLayerKeepsTheGradientsOfWhatTrains) {
  auto grads_of = [&](Module& m, Tensor x, int frozen) -> std::vector<std::vector<double>> {
    auto store = ParameterStore::create(*ctx_, m, DataType::f64);
    EXPECT_TRUE(store) << store.error().message();
    auto pv = random_values(static_cast<std::size_t>(store->numel()), 5, 0.5);
    std::copy(pv.begin(), pv.end(), store->values().span<double>().begin());
    if (frozen >= 0) {
      Parameter& p = *store->entries()[static_cast<std::size_t>(frozen)].parameter;
      EXPECT_TRUE(p.bind(p.value(), Tensor{}));
    }
    auto run = rt_.block_on([&]() -> async::Task<Result<void>> {
      COSHARD_CO_TRY_ASSIGN(Tensor y, co_await ctx_->forward(m, x));
      Tensor seed = host_tensor(random_values(static_cast<std::size_t>(y.numel()), 6), y.shape(), DataType::f64);
      COSHARD_CO_TRY(co_await ctx_->backward(m, seed));
      co_return co_await drained();
    }());
    EXPECT_TRUE(run) << run.error().message();
    std::vector<std::vector<double>> out;
    for (const auto& e : store->entries()) {
      auto g = store->grads().slice(e.offset, Shape{e.parameter->numel()}).span<double>();
      out.emplace_back(g.begin(), g.end());
    }
    return out;
  };
  LayerNorm norm(6);
  Embedding embed(7, 4, 6);
  const std::pair<Module*, Tensor> cases[] = {{&norm, random_input(Shape{3, 6}, 31)},
                                              {&embed, tokens({0, 3, 6, 3, 1, 2, 2, 5}, Shape{2, 4})}};
  for (const auto& [m, x] : cases) {
    SCOPED_TRACE(std::string(m->type_name()));
    const auto all = grads_of(*m, x, -1);
    ASSERT_EQ(all.size(), 2u);
    for (int frozen : {0, 1}) {
      const auto some = grads_of(*m, x, frozen);
      const int trained = 1 - frozen;
      EXPECT_EQ(some[static_cast<std::size_t>(trained)], all[static_cast<std::size_t>(trained)])
          << "parameter " << trained << " with parameter " << frozen << " frozen";
      for (double g : some[static_cast<std::size_t>(frozen)]) EXPECT_EQ(g, 0.0) << "the frozen one gets nothing";
    }
  }
}

TEST_F(GradCheck, ResidualAroundSequential) {
  auto inner = std::make_unique<Sequential>();
  inner->add("ln", std::make_unique<LayerNorm>(4));
  inner->add("fc", std::make_unique<Linear>(4, 4));
  inner->add("gelu", std::make_unique<Gelu>());
  Residual m(std::move(inner));
  run_check(m, random_input(Shape{3, 4}, 16));
}

using ScaleShift = ::coshard::testing::ScaleShift<double>;  // a module of the test's own (tests/support)

TEST_F(GradCheck, AUserWrittenModuleInsideBuiltInOnes) {
  Sequential m;
  m.add("fc", std::make_unique<Linear>(3, 4));
  m.add("affine", std::make_unique<ScaleShift>(4));
  m.add("ln", std::make_unique<LayerNorm>(4));
  run_check(m, random_input(Shape{2, 3}, 18));
}

// A user's module written with the public ops only (the same code runs on CUDA: CudaLayers).
TEST_F(GradCheck, AUserModuleWrittenWithOps) {
  Sequential m;
  m.add("fc", std::make_unique<Linear>(3, 4));
  m.add("gate", std::make_unique<::coshard::testing::GatedLinear>(4));
  run_check(m, random_input(Shape{2, 3, 3}, 19));
}

// The loss as a module: L = r * CE(logits, targets) with a scalar r (the backward seed).
TEST_F(GradCheck, CrossEntropyLoss) {
  CrossEntropyLoss m;
  m.set_targets(tokens({2, 0, 4, 1, 1, 3}, Shape{2, 3}));
  run_check(m, random_input(Shape{2, 3, 5}, 17));
}

// L = r * MSE(pred, targets): the gradient of the prediction (the targets are data).
TEST_F(GradCheck, MeanSquaredErrorLoss) {
  MeanSquaredErrorLoss m;
  m.set_targets(random_input(Shape{3, 4}, 23));
  run_check(m, random_input(Shape{3, 4}, 19));
}

// Everything together: a GPT with the loss on top, checked on its parameters.
class LossOfModel final : public Module {
 public:
  LossOfModel(std::unique_ptr<Module> model, Tensor targets) {
    model_ = &register_child("model", std::move(model));
    loss_.set_targets(std::move(targets));
  }
  std::string_view type_name() const override { return "LossOfModel"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor x) override {
    COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(*model_, std::move(x)));
    co_return co_await ctx.forward(loss_, std::move(logits));
  }
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor seed) override {
    COSHARD_CO_TRY_ASSIGN(Tensor dlogits, co_await ctx.backward(loss_, std::move(seed)));
    co_return co_await ctx.backward(*model_, std::move(dlogits));
  }
  void clear_saved() override { loss_.clear_saved(); }

 private:
  Module* model_;
  CrossEntropyLoss loss_;
};

TEST_F(GradCheck, TinyGptEndToEnd) {
  GptConfig c{.vocab = 11, .max_seq = 5, .dim = 8, .layers = 2, .heads = 2, .mlp_ratio = 2};
  auto gpt = make_gpt(c);
  ASSERT_TRUE(gpt) << gpt.error().message();
  LossOfModel m(std::move(*gpt), tokens({1, 2, 3, 4, 5, 6, 7, 8}, Shape{2, 4}));
  run_check(m, tokens({0, 1, 2, 3, 10, 9, 8, 7}, Shape{2, 4}));
}

TEST_F(GradCheck, TinyLlamaEndToEnd) {
  for (bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "tied embeddings" : "a head of its own");
    LlamaConfig c{.vocab = 11, .max_seq = 5, .dim = 8, .layers = 2, .heads = 2, .kv_heads = 1, .head_dim = 4,
                  .intermediate = 6, .rope_theta = 10000.0, .tie_embeddings = tied};
    auto llama = make_llama(c);
    ASSERT_TRUE(llama) << llama.error().message();
    apply_activation_checkpointing(**llama, ActivationCheckpointing{2});  // the second block recomputes
    LossOfModel m(std::move(*llama), tokens({1, 2, 3, 4, 5, 6, 7, 8}, Shape{2, 4}));
    run_check(m, tokens({0, 1, 2, 3, 10, 9, 8, 7}, Shape{2, 4}));
  }
}

}  // namespace
}  // namespace coshard::modules
