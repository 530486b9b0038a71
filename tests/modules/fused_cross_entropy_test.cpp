// FusedCrossEntropyLoss (fused_cross_entropy.hpp): the output layer's product and the
// cross-entropy over it a chunk of vocabulary columns at a time, against CrossEntropyLoss over the
// whole logits on the same model and values: the loss and every parameter's gradient, for a
// Linear head with a bias (GPT) and a tied one (Llama), in f64, f32 and bf16, with uneven chunks;
// runs that repeat bit for bit; the activation peak it saves; the plain path where targets come
// late; a frozen head; and the refusals that name what is wrong.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>

#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/fused_cross_entropy.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/lora.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "coshard/modules/tensor_parallel.hpp"
#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

using testing::normwise_error;
using testing::random_values;

struct Outcome {
  double loss = 0;
  std::vector<double> grads;
  std::size_t peak_bytes = 0;  // the activations' peak (the parameters' store not counted)
  bool fused = false;
  std::int64_t chunks = 0;
};

class FusedCrossEntropy : public testing::ModuleFixture {
 protected:
  std::vector<double> read(Context& ctx, const Tensor& t) {
    auto r = rt_.block_on(ctx.read(t));
    EXPECT_TRUE(r) << r.error().message();
    return r ? *r : std::vector<double>{};
  }

  // One forward and backward of `model` (parameters from seed 7) over a batch of B x T tokens
  // below `vocab`, through `loss`; `late` sets the targets after the model's forward.
  Outcome run(Module& model, Loss& loss, DataType dt, std::int64_t vocab, bool late = false) {
    return run_on(*ctx_, model, loss, dt, vocab, late);
  }
  Outcome run_on(Context& ctx, Module& model, Loss& loss, DataType dt, std::int64_t vocab, bool late = false) {
    constexpr std::int64_t B = 2, T = 8;
    Outcome out;
    auto store = ParameterStore::create(ctx, model, dt);
    EXPECT_TRUE(store) << store.error().message();
    if (!store) return out;
    EXPECT_TRUE(rt_.block_on(store->initialize(ctx, 7)));
    EXPECT_TRUE(store->zero_grad(ctx));
    std::vector<int> ids(static_cast<std::size_t>(B * T)), next(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<int>((i * 37 + 11) % static_cast<std::size_t>(vocab));
      next[i] = static_cast<int>((i * 53 + 5) % static_cast<std::size_t>(vocab));
    }
    next[3] = static_cast<int>(vocab - 1);  // the last column (in the last, shorter chunk)
    const Tensor inputs = upload_ids(ctx, ids, Shape{B, T}), targets = upload_ids(ctx, next, Shape{B, T});
    auto seed = ctx.upload(encode_values(std::vector<double>{1.0}, detail_stat(dt)), Shape{1}, detail_stat(dt));
    EXPECT_TRUE(seed);
    ctx.reset_activation_peak();
    const std::size_t before = ctx.activation_memory().live_bytes;  // the store's
    auto value = rt_.block_on([&]() -> async::Task<Result<Tensor>> {
      if (!late) loss.set_targets(targets);
      COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(model, inputs));
      if (late) loss.set_targets(targets);
      COSHARD_CO_TRY_ASSIGN(Tensor v, co_await ctx.forward(loss, std::move(logits)));
      COSHARD_CO_TRY_ASSIGN(Tensor d, co_await ctx.backward(loss, *seed));
      COSHARD_CO_TRY(co_await ctx.backward(model, std::move(d)));
      co_return v;
    }());
    EXPECT_TRUE(value) << value.error().message();
    if (!value) return out;
    out.loss = read(ctx, *value)[0];
    out.grads = read(ctx, store->grads());
    out.peak_bytes = ctx.activation_memory().peak_bytes - before;
    if (auto* f = dynamic_cast<FusedCrossEntropyLoss*>(&loss)) {
      out.fused = f->last_forward_fused();
      out.chunks = f->last_chunks();
    }
    model.clear_saved_recursive();
    return out;
  }
  Tensor upload_ids(Context& ctx, const std::vector<int>& ids, Shape shape) {
    auto t = ctx.upload(encode_values(std::vector<double>(ids.begin(), ids.end()), DataType::i32), shape, DataType::i32);
    EXPECT_TRUE(t) << t.error().message();
    return t ? *t : Tensor{};
  }
  static DataType detail_stat(DataType dt) { return dt == DataType::f64 ? DataType::f64 : DataType::f32; }
};

GptConfig gpt_config() { return GptConfig{.vocab = 1000, .max_seq = 16, .dim = 32, .layers = 1, .heads = 2}; }
LlamaConfig llama_config() {
  LlamaConfig c = llama_preset("llama-tiny")->config;
  c.vocab = 1000;
  c.layers = 1;
  return c;
}

struct Case {
  DataType dt;
  double loss_tolerance, grad_tolerance;
};

class FusedCrossEntropyDtypes : public FusedCrossEntropy, public ::testing::WithParamInterface<Case> {};

// 16 rows of a 1000-token vocabulary in chunks of at most 16,096 bytes: f64 64 columns (16
// chunks, the last of 40), f32 192 (6, the last of 40), bf16 448 (3, the last of 104).
TEST_P(FusedCrossEntropyDtypes, GivesCrossEntropysLossAndGradientsForALinearAndATiedHead) {
  const Case c = GetParam();
  const FusedCrossEntropyOptions options{.chunk_bytes = 16 * 1000 * 4 / 4 + 96};
  for (const bool tied : {false, true}) {
    SCOPED_TRACE(tied ? "a tied head (Llama)" : "a Linear head with a bias (GPT)");
    auto make = [&]() -> std::unique_ptr<Module> {
      if (tied) return std::move(*make_llama(llama_config()));
      return std::move(*make_gpt(gpt_config()));
    };
    auto plain_model = make(), fused_model = make();
    CrossEntropyLoss plain;
    FusedCrossEntropyLoss fused(options);
    ASSERT_TRUE(fused.attach(*fused_model));
    const Outcome want = run(*plain_model, plain, c.dt, 1000);
    const Outcome got = run(*fused_model, fused, c.dt, 1000);
    EXPECT_TRUE(got.fused);
    const std::int64_t columns = fused.chunk_columns(16, c.dt, 1000);
    EXPECT_EQ(columns, c.dt == DataType::f64 ? 64 : c.dt == DataType::f32 ? 192 : 448);
    EXPECT_EQ(got.chunks, (1000 + columns - 1) / columns);
    EXPECT_GE(got.chunks, 2);
    EXPECT_NEAR(got.loss, want.loss, c.loss_tolerance * want.loss);
    ASSERT_EQ(got.grads.size(), want.grads.size());
    EXPECT_LT(normwise_error(got.grads, want.grads), c.grad_tolerance);
    // Again: the same bits.
    fused_model->clear_saved_recursive();
    const Outcome again = run(*fused_model, fused, c.dt, 1000);
    EXPECT_EQ(again.loss, got.loss);
    EXPECT_EQ(again.grads, got.grads);
  }
}

INSTANTIATE_TEST_SUITE_P(Dtypes, FusedCrossEntropyDtypes,
                         ::testing::Values(Case{DataType::f64, 1e-12, 1e-12}, Case{DataType::f32, 1e-6, 1e-5},
                                           Case{DataType::bf16, 1e-3, 2e-2}),
                         [](const auto& info) { return std::string(async::to_string(info.param.dt)); });

// On a GPU (skipped without one): the CUDA kernels (chunk_ce_sums, the bf16 products summed in
// f32 by cuBLAS) against CrossEntropyLoss on the same device, a tied and a Linear head.
TEST_F(FusedCrossEntropy, OnCudaGivesCrossEntropysLossAndGradients) {
  COSHARD_SKIP_WITHOUT_CUDA();
  auto stream = async::Stream::create(async::Device::cuda(0), {.name = "fused_ce"});
  ASSERT_TRUE(stream) << stream.error().message();
  auto allocator = async::CachingAllocator::create(async::Device::cuda(0));
  ASSERT_TRUE(allocator) << allocator.error().message();
  auto ctx = Context::create(*stream, **allocator);
  ASSERT_TRUE(ctx) << ctx.error().message();
  for (const DataType dt : {DataType::f32, DataType::bf16})
    for (const bool tied : {false, true}) {
      SCOPED_TRACE(std::string(async::to_string(dt)) + (tied ? " tied" : " Linear"));
      auto make = [&]() -> std::unique_ptr<Module> {
        if (tied) return std::move(*make_llama(llama_config()));
        return std::move(*make_gpt(gpt_config()));
      };
      auto plain_model = make(), fused_model = make();
      CrossEntropyLoss plain;
      FusedCrossEntropyLoss fused({.chunk_bytes = 16096});
      ASSERT_TRUE(fused.attach(*fused_model));
      const Outcome want = run_on(*ctx, *plain_model, plain, dt, 1000);
      const Outcome got = run_on(*ctx, *fused_model, fused, dt, 1000);
      EXPECT_TRUE(got.fused);
      EXPECT_GE(got.chunks, 3);
      EXPECT_NEAR(got.loss, want.loss, (dt == DataType::f32 ? 1e-5 : 1e-2) * want.loss);
      EXPECT_LT(normwise_error(got.grads, want.grads), dt == DataType::f32 ? 1e-4 : 3e-2);
    }
  (void)stream->synchronize();
}

TEST_F(FusedCrossEntropy, TheActivationPeakDropsByTheLogitsAndTheirGradient) {
  // A vocabulary large against the rest: the logits [16, 8192] f32 are 512 KiB, the rest of the
  // model's activations a few KiB; chunks of 64 KiB.
  GptConfig cfg = gpt_config();
  cfg.vocab = 8192;
  auto plain_model = std::move(*make_gpt(cfg)), fused_model = std::move(*make_gpt(cfg));
  CrossEntropyLoss plain;
  FusedCrossEntropyLoss fused({.chunk_bytes = 64 << 10});
  ASSERT_TRUE(fused.attach(*fused_model));
  const Outcome want = run(*plain_model, plain, DataType::f32, 8192);
  const Outcome got = run(*fused_model, fused, DataType::f32, 8192);
  EXPECT_TRUE(got.fused);
  EXPECT_EQ(got.chunks, 8);
  EXPECT_NEAR(got.loss, want.loss, 1e-6 * want.loss);
  EXPECT_LT(normwise_error(got.grads, want.grads), 1e-5);
  const std::size_t logits = 16 * 8192 * 4;
  // Today's path holds the logits and their gradient together; the fused one a chunk.
  EXPECT_GE(want.peak_bytes, 2 * logits);
  EXPECT_LE(got.peak_bytes + 2 * logits, want.peak_bytes + (64 << 10) + 4096)
      << "fused peak " << got.peak_bytes << " B, over the logits " << want.peak_bytes << " B";
  EXPECT_LT(got.peak_bytes * 3, want.peak_bytes) << got.peak_bytes << " B against " << want.peak_bytes << " B";
  // The estimates (gpt_activation_bytes) come within 5% of both measured peaks (the small
  // tensors they leave out: the loss's, the targets'), and drop with the chunks.
  const auto whole_estimate = static_cast<double>(gpt_activation_bytes(cfg, 2, 8, DataType::f32));
  const auto chunked_estimate = static_cast<double>(gpt_activation_bytes(cfg, 2, 8, DataType::f32, 0, false, 64 << 10));
  EXPECT_NEAR(whole_estimate, static_cast<double>(want.peak_bytes), 0.05 * whole_estimate);
  EXPECT_NEAR(chunked_estimate, static_cast<double>(got.peak_bytes), 0.05 * chunked_estimate);
  EXPECT_LT(chunked_estimate + logits, whole_estimate);
}

// Llama-3.2-1B's 128,256-token vocabulary over 8 x 1024 rows in bf16: the estimate drops by the
// logits and their gradient (2 x 2 GiB) less one 256 MiB chunk and the head input's f32 gradient.
TEST(FusedCrossEntropyEstimates, LlamaDropsTheLogits) {
  const LlamaConfig c = llama_preset("Llama-3.2-1B")->config;
  const auto whole = llama_activation_bytes(c, 8, 1024, DataType::bf16, 0, true);
  const auto chunked = llama_activation_bytes(c, 8, 1024, DataType::bf16, 0, true, std::int64_t{256} << 20);
  EXPECT_GT(whole - chunked, std::size_t{3} << 30) << whole << " against " << chunked;
}

TEST_F(FusedCrossEntropy, TargetsSetAfterTheModelsForwardTakeThePlainPathWithTheSameNumbers) {
  auto plain_model = std::move(*make_gpt(gpt_config())), fused_model = std::move(*make_gpt(gpt_config()));
  CrossEntropyLoss plain;
  FusedCrossEntropyLoss fused({.chunk_bytes = 4096});
  ASSERT_TRUE(fused.attach(*fused_model));
  const Outcome want = run(*plain_model, plain, DataType::f32, 1000);
  const Outcome late = run(*fused_model, fused, DataType::f32, 1000, /*late=*/true);
  EXPECT_FALSE(late.fused);
  EXPECT_EQ(late.loss, want.loss);
  EXPECT_EQ(late.grads, want.grads);
  // Not attached: the plain path too.
  auto other = std::move(*make_gpt(gpt_config()));
  FusedCrossEntropyLoss unattached;
  const Outcome alone = run(*other, unattached, DataType::f32, 1000);
  EXPECT_FALSE(alone.fused);
  EXPECT_EQ(alone.loss, want.loss);
  // A model forward without targets gives logits (sampling after training).
  auto store = ParameterStore::create(*ctx_, *fused_model, DataType::f32);
  ASSERT_TRUE(store) << store.error().message();
  ASSERT_TRUE(rt_.block_on(store->initialize(*ctx_, 1)));
  auto logits = rt_.block_on(ctx_->forward(*fused_model, tokens({1, 2, 3}, Shape{1, 3})));
  ASSERT_TRUE(logits) << logits.error().message();
  EXPECT_EQ(logits->shape(), (Shape{1, 3, 1000}));
  fused_model->clear_saved_recursive();
}

TEST_F(FusedCrossEntropy, AFrozenHeadGivesTheOtherGradients) {
  auto plain_model = std::move(*make_gpt(gpt_config())), fused_model = std::move(*make_gpt(gpt_config()));
  for (Module* m : {plain_model.get(), fused_model.get()})
    m->for_each_parameter([](const std::string& name, Parameter& p) {
      if (name.rfind("head.", 0) == 0) EXPECT_TRUE(p.set_trainable(false));
    });
  CrossEntropyLoss plain;
  FusedCrossEntropyLoss fused({.chunk_bytes = 4096});
  ASSERT_TRUE(fused.attach(*fused_model));
  const Outcome want = run(*plain_model, plain, DataType::f32, 1000);
  const Outcome got = run(*fused_model, fused, DataType::f32, 1000);
  EXPECT_TRUE(got.fused);
  EXPECT_NEAR(got.loss, want.loss, 1e-6 * want.loss);
  EXPECT_LT(normwise_error(got.grads, want.grads), 1e-5);
}

TEST_F(FusedCrossEntropy, RefusalsNameWhatIsWrong) {
  auto message = [](const Result<void>& r) { return r ? std::string("(accepted)") : r.error().message(); };
  {
    Sequential none;
    none.add("norm", std::make_unique<LayerNorm>(4));
    FusedCrossEntropyLoss loss;
    EXPECT_NE(message(loss.attach(none)).find("no child named \"head\""), std::string::npos);
    none.add("head", std::make_unique<LayerNorm>(4));
    EXPECT_NE(message(loss.attach(none)).find("the model's \"head\" is a LayerNorm"), std::string::npos);
  }
  {
    auto model = std::move(*make_gpt(gpt_config()));
    ASSERT_TRUE(apply_lora(*model, LoraOptions{.targets = {"head"}}));
    FusedCrossEntropyLoss loss;
    EXPECT_NE(message(loss.attach(*model)).find("1 LoRA adapter(s)"), std::string::npos);
  }
  {
    auto model = std::move(*make_gpt(gpt_config()));
    FusedCrossEntropyLoss first, second;
    ASSERT_TRUE(first.attach(*model));
    EXPECT_NE(message(first.attach(*model)).find("already attached"), std::string::npos);
    EXPECT_NE(message(second.attach(*model)).find("already has a FusedCrossEntropyLoss"), std::string::npos);
  }
  {
    TokenEmbedding part(500, 8, Init::normal(0.02), 500, 1000);  // rows [500, 1000) of a vocabulary-parallel table
    FusedCrossEntropyLoss loss;
    EXPECT_NE(message(loss.attach(part)).find("rows [500, 1000) of a vocabulary of 1000"), std::string::npos);
    FusedCrossEntropyLoss zero({.chunk_bytes = 0});
    Linear head(8, 16, false);
    EXPECT_NE(message(zero.attach(head)).find("chunk_bytes=0"), std::string::npos);
  }
  {
    // Targets that are not one per row: named with the input's shape.
    auto model = std::move(*make_gpt(gpt_config()));
    FusedCrossEntropyLoss loss;
    ASSERT_TRUE(loss.attach(*model));
    auto store = ParameterStore::create(*ctx_, *model, DataType::f32);
    ASSERT_TRUE(store);
    ASSERT_TRUE(rt_.block_on(store->initialize(*ctx_, 1)));
    loss.set_targets(tokens({1, 2, 3}, Shape{3}));
    auto out = rt_.block_on(ctx_->forward(*model, tokens({1, 2, 3, 4}, Shape{1, 4})));
    ASSERT_FALSE(out);
    EXPECT_NE(out.error().message().find("expected i32 with 4 elements"), std::string::npos) << out.error().message();
    model->clear_saved_recursive();
  }
  {
    // An output layer inside a checkpointed block (which drops its saved state after forward, and
    // would recompute without targets): the loss's forward fails naming that, never trains on a
    // wrong gradient.
    Sequential model;
    auto& wrapped = model.add("block", std::make_unique<Checkpointed>(std::make_unique<Linear>(8, 40, false)));
    FusedCrossEntropyLoss loss({.chunk_bytes = 256});
    ASSERT_TRUE(loss.attach(wrapped.inner()));
    auto store = ParameterStore::create(*ctx_, model, DataType::f32);
    ASSERT_TRUE(store);
    ASSERT_TRUE(rt_.block_on(store->initialize(*ctx_, 1)));
    ASSERT_TRUE(store->zero_grad(*ctx_));
    const Tensor x = host_tensor(random_values(4 * 8, 9), Shape{4, 8}, DataType::f32);
    auto seed = ctx_->upload(encode_values(std::vector<double>{1.0}, DataType::f32), Shape{1}, DataType::f32);
    ASSERT_TRUE(seed);
    auto r = rt_.block_on([&]() -> async::Task<Result<Tensor>> {
      loss.set_targets(tokens({1, 2, 3, 39}, Shape{4}));
      COSHARD_CO_TRY_ASSIGN(Tensor v, co_await ctx_->forward(model, x));
      COSHARD_CO_TRY_ASSIGN(Tensor l, co_await ctx_->forward(loss, std::move(v)));
      COSHARD_CO_TRY_ASSIGN(Tensor d, co_await ctx_->backward(loss, *seed));
      co_return co_await ctx_->backward(model, std::move(d));
    }());
    ASSERT_FALSE(r);
    EXPECT_NE(r.error().message().find("the output layer's loss was dropped before this forward"), std::string::npos)
        << r.error().message();
    model.clear_saved_recursive();
  }
  {
    // Destroyed first: the layer gives logits again.
    auto model = std::move(*make_gpt(gpt_config()));
    auto store = ParameterStore::create(*ctx_, *model, DataType::f32);
    ASSERT_TRUE(store);
    ASSERT_TRUE(rt_.block_on(store->initialize(*ctx_, 1)));
    {
      FusedCrossEntropyLoss loss;
      ASSERT_TRUE(loss.attach(*model));
      loss.set_targets(tokens({1, 2}, Shape{1, 2}));
    }
    auto out = rt_.block_on(ctx_->forward(*model, tokens({1, 2}, Shape{1, 2})));
    ASSERT_TRUE(out) << out.error().message();
    EXPECT_EQ(out->shape(), (Shape{1, 2, 1000}));
    model->clear_saved_recursive();
  }
}

}  // namespace
}  // namespace coshard::modules
