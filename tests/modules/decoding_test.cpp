// Incremental decoding (modules/decoding.hpp): the prompt in one forward, then one token at a
// time through the key/value caches, gives the logits of a forward over the whole prefix at every
// position, for a GPT (learned positions, multi-head) and a Llama (rotary positions, grouped-query
// attention), in f32 and bf16; misuse is named.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/decoding.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/modules/parameter_store.hpp"

namespace coshard::modules {
namespace {

constexpr std::int64_t kVocab = 50;

struct Harness {
  async::Runtime rt;
  std::optional<async::Stream> stream;
  std::unique_ptr<async::CachingAllocator> allocator;
  std::optional<Context> ctx;
  Harness() {
    stream.emplace(std::move(*async::Stream::create(async::Device::cpu())));
    allocator = std::move(*async::CachingAllocator::create(async::Device::cpu()));
    ctx.emplace(std::move(*Context::create(*stream, *allocator)));
  }
  ~Harness() { (void)stream->synchronize(); }
};

std::vector<std::int32_t> tokens_of(std::int64_t n) {
  std::vector<std::int32_t> ids;
  for (std::int64_t i = 0; i < n; ++i) ids.push_back(static_cast<std::int32_t>((i * 17 + 3) % kVocab));
  return ids;
}

// The last row of logits at every position from `prompt` on: by forwards over the whole prefix,
// and by decoding (the prompt at once, then one token at a time), rows [rows, 1 + extra, V].
void expect_decoding_matches(Module& model, DataType dtype, std::int64_t prompt, std::int64_t extra, double tolerance) {
  Harness h;
  Context& ctx = *h.ctx;
  const auto ids = tokens_of(prompt + extra);
  auto done = h.rt.block_on([&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(ctx, model, dtype));
    COSHARD_CO_TRY(co_await store.initialize(ctx, 7));
    auto upload = [&](std::int64_t from, std::int64_t n) {
      return ctx.upload(std::as_bytes(std::span(ids).subspan(static_cast<std::size_t>(from), static_cast<std::size_t>(n))),
                        Shape{1, n}, DataType::i32);
    };
    auto last_row = [&](const Tensor& logits) -> async::Task<Result<std::vector<double>>> {
      const std::int64_t T = logits.shape()[1], V = logits.shape()[2];
      const Tensor last = logits.slice((T - 1) * V, Shape{V});  // (named: GCC 12, a Shape across co_await)
      co_return co_await ctx.read(last);
    };
    std::vector<std::vector<double>> full;
    for (std::int64_t n = prompt; n <= prompt + extra; ++n) {
      COSHARD_CO_TRY_ASSIGN(Tensor x, upload(0, n));
      COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(model, x));
      COSHARD_CO_TRY_ASSIGN(auto row, co_await last_row(logits));
      full.push_back(std::move(row));
      model.clear_saved_recursive();
    }
    Decoding decoding(1, prompt + extra);
    const Decoding::Scope scope(ctx, decoding);
    for (std::int64_t k = 0; k <= extra; ++k) {
      const std::int64_t from = k == 0 ? 0 : prompt + k - 1, n = k == 0 ? prompt : 1;
      COSHARD_CO_TRY_ASSIGN(Tensor x, upload(from, n));
      COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(model, x));
      COSHARD_CO_TRY(decoding.advance(n));
      COSHARD_CO_TRY_ASSIGN(auto row, co_await last_row(logits));
      model.clear_saved_recursive();
      double worst = 0, scale = 0;
      for (std::size_t v = 0; v < row.size(); ++v) {
        worst = std::max(worst, std::abs(row[v] - full[static_cast<std::size_t>(k)][v]));
        scale = std::max(scale, std::abs(full[static_cast<std::size_t>(k)][v]));
      }
      EXPECT_LE(worst, tolerance * std::max(1.0, scale)) << "position " << prompt + k - 1;
    }
    // Past max_length: named.
    COSHARD_CO_TRY_ASSIGN(Tensor more, upload(0, 1));
    auto over = co_await ctx.forward(model, more);
    EXPECT_FALSE(over);
    if (!over) EXPECT_NE(over.error().message().find("pass the decoding's max_length"), std::string::npos)
        << over.error().message();
    co_return Result<void>{};
  }());
  EXPECT_TRUE(done) << done.error().message();
}

TEST(Decoding, AGptThroughItsCachesGivesTheLogitsOfTheWholePrefix) {
  auto model = make_gpt({.vocab = kVocab, .max_seq = 24, .dim = 32, .layers = 2, .heads = 4, .mlp_ratio = 2});
  ASSERT_TRUE(model);
  expect_decoding_matches(**model, DataType::f32, 5, 12, 1e-5);
}

TEST(Decoding, ALlamaWithGroupedQueryAttentionGivesTheLogitsOfTheWholePrefix) {
  LlamaConfig c;
  c.vocab = kVocab;
  c.max_seq = 32;
  c.dim = 32;
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.intermediate = 64;
  auto model = make_llama(c);
  ASSERT_TRUE(model);
  expect_decoding_matches(**model, DataType::f32, 6, 12, 1e-5);
  auto tied = make_llama([&] {
    LlamaConfig t = c;
    t.tie_embeddings = true;
    t.kv_heads = 1;
    return t;
  }());
  ASSERT_TRUE(tied);
  expect_decoding_matches(**tied, DataType::bf16, 3, 8, 3e-2);
}

TEST(Decoding, AGptsLearnedPositionsBoundTheSequenceByName) {
  auto model = make_gpt({.vocab = kVocab, .max_seq = 8, .dim = 16, .layers = 1, .heads = 2, .mlp_ratio = 2});
  ASSERT_TRUE(model);
  Harness h;
  auto done = h.rt.block_on([&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto store, ParameterStore::create(*h.ctx, **model, DataType::f32));
    COSHARD_CO_TRY(co_await store.initialize(*h.ctx, 7));
    Decoding decoding(1, 12);  // longer than the model's 8 positions
    const Decoding::Scope scope(*h.ctx, decoding);
    const auto ids = tokens_of(8);
    COSHARD_CO_TRY_ASSIGN(Tensor x, h.ctx->upload(std::as_bytes(std::span(ids)), Shape{1, 8}, DataType::i32));
    COSHARD_CO_TRY(co_await h.ctx->forward(**model, x));
    COSHARD_CO_TRY(decoding.advance(8));
    (*model)->clear_saved_recursive();
    COSHARD_CO_TRY_ASSIGN(Tensor one, h.ctx->upload(std::as_bytes(std::span(ids).first(1)), Shape{1, 1}, DataType::i32));
    auto past = co_await h.ctx->forward(**model, one);
    if (past) co_return fail(ErrorCode::internal, "a ninth position accepted");
    if (past.error().message().find("sequence length 9 exceeds max_positions 8") == std::string::npos)
      co_return fail(ErrorCode::internal, past.error().message());
    co_return Result<void>{};
  }());
  EXPECT_TRUE(done) << done.error().message();
}

}  // namespace
}  // namespace coshard::modules
