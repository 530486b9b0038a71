// The CPU kernels that split their rows across the rank's math threads (parallel_rows: attention's
// softmax, the norms and their weight gradients' columns, GELU, SwiGLU, rotary, the cross-entropy
// whole and in chunks) give the bits of one thread: a forward and backward of a GPT and a Llama,
// with the plain and the fused cross-entropy, in f32, f64 and bf16, at one math thread and at
// four (the pool starts workers beyond the cores if it must), the loss and every gradient equal
// (OpenBLAS's products at one thread in both).
// The shapes are chosen so that every one of those kernels splits at four threads.
#include <gtest/gtest.h>
#include <cblas.h>

#include <memory>
#include <string>

#include "coshard/modules/cpu_threads.hpp"
#include "coshard/modules/fused_cross_entropy.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "module_fixture.hpp"
#include "support/sanitizers.hpp"

namespace coshard::modules {
namespace {

constexpr std::int64_t kBatch = 4, kSeq = 64, kVocab = 2048;

struct Outcome {
  std::vector<double> loss, grads;
};

class CpuSplit : public testing::ModuleFixture {
 protected:
  void TearDown() override {
    set_cpu_math_threads(threads_before_);
    ModuleFixture::TearDown();
  }

  Outcome run(bool llama, bool fused, DataType dt, int threads) {
    set_cpu_math_threads(threads);
    // OpenBLAS's products at one thread in both runs: its sgemm's bits depend on its own thread
    // count (here f32 products differ at 1 and 4), which is OpenBLAS's, not what this checks.
    openblas_set_num_threads(1);
    Outcome out;
    std::unique_ptr<Module> model;
    if (llama) {
      LlamaConfig c{.vocab = kVocab, .max_seq = kSeq, .dim = 256, .layers = 1, .heads = 4, .kv_heads = 2,
                    .intermediate = 512};
      auto m = make_llama(c);
      EXPECT_TRUE(m) << m.error().message();
      if (!m) return out;
      model = std::move(*m);
    } else {
      GptConfig c{.vocab = kVocab, .max_seq = kSeq, .dim = 256, .layers = 1, .heads = 2};
      auto m = make_gpt(c);
      EXPECT_TRUE(m) << m.error().message();
      if (!m) return out;
      model = std::move(*m);
    }
    CrossEntropyLoss plain;
    FusedCrossEntropyLoss chunked({.chunk_bytes = kBatch * kSeq * 512 * 4});  // 512-column chunks in f32
    if (fused) EXPECT_TRUE(chunked.attach(*model));
    Loss& loss = fused ? static_cast<Loss&>(chunked) : static_cast<Loss&>(plain);
    auto store = ParameterStore::create(*ctx_, *model, dt);
    EXPECT_TRUE(store) << store.error().message();
    if (!store) return out;
    EXPECT_TRUE(rt_.block_on(store->initialize(*ctx_, 11)));
    EXPECT_TRUE(store->zero_grad(*ctx_));
    std::vector<double> ids(static_cast<std::size_t>(kBatch * kSeq)), next(ids.size());
    for (std::size_t i = 0; i < ids.size(); ++i) {
      ids[i] = static_cast<double>((i * 37 + 11) % kVocab);
      next[i] = static_cast<double>((i * 53 + 5) % kVocab);
    }
    auto inputs = ctx_->upload(encode_values(ids, DataType::i32), Shape{kBatch, kSeq}, DataType::i32);
    auto targets = ctx_->upload(encode_values(next, DataType::i32), Shape{kBatch, kSeq}, DataType::i32);
    const DataType stat = dt == DataType::f64 ? DataType::f64 : DataType::f32;
    auto seed = ctx_->upload(encode_values(std::vector<double>{1.0}, stat), Shape{1}, stat);
    EXPECT_TRUE(inputs && targets && seed);
    if (!inputs || !targets || !seed) return out;
    auto value = rt_.block_on([&]() -> async::Task<Result<Tensor>> {
      loss.set_targets(*targets);
      COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx_->forward(*model, *inputs));
      COSHARD_CO_TRY_ASSIGN(Tensor v, co_await ctx_->forward(loss, std::move(logits)));
      COSHARD_CO_TRY_ASSIGN(Tensor d, co_await ctx_->backward(loss, *seed));
      COSHARD_CO_TRY(co_await ctx_->backward(*model, std::move(d)));
      co_return v;
    }());
    EXPECT_TRUE(value) << value.error().message();
    if (!value) return out;
    if (fused) EXPECT_TRUE(chunked.last_forward_fused());
    auto l = rt_.block_on(ctx_->read(*value));
    auto g = rt_.block_on(ctx_->read(store->grads()));
    EXPECT_TRUE(l && g);
    if (l) out.loss = *l;
    if (g) out.grads = *g;
    return out;
  }

  const int threads_before_ = cpu_math_threads();
};

TEST_F(CpuSplit, EveryLayerGivesTheBitsOfOneThread) {
  for (const bool llama : {false, true}) {
    for (const bool fused : {false, true}) {
      for (const DataType dt : {DataType::f32, DataType::f64, DataType::bf16}) {
        if (::coshard::testing::kSanitized && dt == DataType::f64) continue;  // (f32's kernels, the same code)
        SCOPED_TRACE(std::string(llama ? "llama" : "gpt") + (fused ? ", fused cross-entropy" : "") + ", " +
                     std::string(async::to_string(dt)));
        const Outcome one = run(llama, fused, dt, 1);
        const Outcome four = run(llama, fused, dt, 4);
        ASSERT_EQ(one.loss.size(), 1u);
        ASSERT_FALSE(one.grads.empty());
        EXPECT_EQ(four.loss, one.loss);
        EXPECT_EQ(four.grads, one.grads);
      }
    }
  }
}

}  // namespace
}  // namespace coshard::modules
