// Incremental decoding: generating tokens one at a time with a key/value cache, so each new
// token costs one forward over that token alone, not over the whole prefix.
//
//   Decoding decoding(/*rows=*/1, /*max_length=*/prompt.size() + new_tokens);
//   Decoding::Scope scope(ctx, decoding);            // forwards on ctx now continue the sequence
//   logits = co_await ctx.forward(model, prompt);     // [1, P, V]: the prompt, its keys and values kept
//   decoding.advance(P);
//   logits = co_await ctx.forward(model, next);       // [1, 1, V]: one token at position P
//   decoding.advance(1);
//
// While a Decoding is set on a Context, the layers that depend on a token's position take it
// from position(): Embedding's learned positions and RotaryEmbedding start there, and each
// CausalSelfAttention writes the new tokens' queries, keys and values into its cache (rows
// [position, position + T) of [rows, max_length, width]) and attends over everything cached up
// to each new token. Nothing is kept for a backward pass (decoding is inference only). The caches
// are made at a layer's first forward, on the context's device, and held until the Decoding goes.
#pragma once

#include <cstdint>
#include <string_view>
#include <unordered_map>

#include "coshard/modules/module.hpp"

namespace coshard::modules {

class Decoding {
 public:
  // `rows` sequences (the batch of every forward), at most `max_length` tokens each.
  Decoding(std::int64_t rows, std::int64_t max_length) noexcept : rows_(rows), max_length_(max_length) {}
  Decoding(const Decoding&) = delete;
  Decoding& operator=(const Decoding&) = delete;

  std::int64_t rows() const noexcept { return rows_; }
  std::int64_t max_length() const noexcept { return max_length_; }
  // Tokens already in the caches: the position of the next forward's first token.
  std::int64_t position() const noexcept { return position_; }
  // After a forward of `tokens` new tokens: they are in the caches now.
  Result<void> advance(std::int64_t tokens);
  // Back to an empty sequence (the caches stay allocated and are overwritten).
  void restart() noexcept { position_ = 0; }

  // A new forward of [rows, T] tokens fits: the rows match and position() + T <= max_length.
  Result<void> check(std::int64_t rows, std::int64_t tokens, std::string_view layer) const;
  // `layer`'s cache of [rows, max_length, width] elements of `dtype`, made at its first use.
  Result<Tensor> cache(Context& ctx, const Module& layer, std::int64_t width, DataType dtype);

  // Sets a Decoding on a Context for a scope (and unsets it on every path out).
  class Scope {
   public:
    Scope(Context& ctx, Decoding& decoding) noexcept : ctx_(&ctx), before_(ctx.decoding()) {
      ctx.set_decoding(&decoding);
    }
    ~Scope() { ctx_->set_decoding(before_); }
    Scope(const Scope&) = delete;
    Scope& operator=(const Scope&) = delete;

   private:
    Context* ctx_;
    Decoding* before_;
  };

 private:
  std::int64_t rows_, max_length_, position_ = 0;
  std::unordered_map<const Module*, Tensor> caches_;
};

}  // namespace coshard::modules
