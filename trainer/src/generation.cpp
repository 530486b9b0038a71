// Generating tokens (Trainer::generate) with the model's key/value caches (modules/decoding.hpp):
// the prompt in one forward, then one forward per new token, each an inference pass of the
// engine (at stage 3 every unit is gathered for it), every rank taking rank 0's choice.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "coshard/modules/decoding.hpp"
#include "coshard/trainer/sampling.hpp"
#include "trainer_impl.hpp"

namespace coshard::trainer {

using modules::DataType;
using modules::Tensor;

Result<void> SampleOptions::validate() const {
  if (tokens < 1 || tokens > (std::int64_t{1} << 20))
    return fail(ErrorCode::invalid_argument, "sample tokens=", tokens, ": expected 1 to 2^20");
  if (!(temperature >= 0) || !std::isfinite(temperature))
    return fail(ErrorCode::invalid_argument, "temperature=", temperature, ": expected a finite value >= 0 (0: greedy)");
  if (top_k < 0) return fail(ErrorCode::invalid_argument, "top_k=", top_k, ": expected >= 0 (0: every token)");
  if (vocab < 0) return fail(ErrorCode::invalid_argument, "vocab=", vocab, ": expected >= 0 (0: not checked)");
  return {};
}

Result<std::int32_t> choose_token(std::span<const double> logits, const SampleOptions& o, std::mt19937_64& rng) {
  if (logits.empty()) return fail(ErrorCode::invalid_argument, "sampling: an empty row of logits");
  std::vector<std::int32_t> ids(logits.size());
  std::iota(ids.begin(), ids.end(), 0);
  // Most likely first; equal logits by id (a NaN counts as the least likely).
  auto value = [&](std::int32_t i) {
    const double v = logits[static_cast<std::size_t>(i)];
    return std::isnan(v) ? -std::numeric_limits<double>::infinity() : v;
  };
  const auto keep = static_cast<std::size_t>(o.top_k > 0 ? std::min<std::int64_t>(o.top_k, std::ssize(logits))
                                                           : std::ssize(logits));
  std::partial_sort(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep), ids.end(),
                    [&](std::int32_t a, std::int32_t b) { return value(a) > value(b) || (value(a) == value(b) && a < b); });
  const double top = value(ids.front());
  if (!std::isfinite(top))
    return fail(ErrorCode::invalid_argument, "sampling: no finite logit in a row of ", logits.size(),
                " (the model's outputs overflowed)");
  if (o.temperature == 0.0f) return ids.front();
  std::vector<double> weights(keep);
  for (std::size_t k = 0; k < keep; ++k) {
    const double v = value(ids[k]);
    weights[k] = std::isfinite(v) ? std::exp((v - top) / static_cast<double>(o.temperature)) : 0.0;
  }
  std::discrete_distribution<std::size_t> pick(weights.begin(), weights.end());
  return ids[pick(rng)];
}

async::Task<Result<std::vector<std::int32_t>>> Trainer::Impl::generate(std::span<const std::int32_t> prompt,
                                                                         const SampleOptions& o) {
  COSHARD_CO_TRY(o.validate());
  if (prompt.empty()) co_return fail(ErrorCode::invalid_argument, "generate: an empty prompt (give at least one token)");
  for (std::size_t i = 0; i < prompt.size(); ++i)
    if (prompt[i] < 0 || (o.vocab > 0 && prompt[i] >= o.vocab))
      co_return fail(ErrorCode::invalid_argument, "generate: prompt token ", i, " is id ", prompt[i],
                     o.vocab > 0 ? ", not below the model's vocabulary of " + std::to_string(o.vocab) : ", below 0");
  const auto P = static_cast<std::int64_t>(prompt.size());
  modules::Decoding decoding(1, P + o.tokens);
  const modules::Decoding::Scope scope(*ctx, decoding);
  std::mt19937_64 rng(o.seed);
  std::vector<std::int32_t> input(prompt.begin(), prompt.end()), out;
  for (std::int64_t k = 0; k < o.tokens; ++k) {
    const auto T = static_cast<std::int64_t>(input.size());
    COSHARD_CO_TRY_ASSIGN(Tensor tokens, ctx->upload(std::as_bytes(std::span<const std::int32_t>(input)),
                                                    modules::Shape{1, T}, DataType::i32));
    // One inference pass: the forward over the new tokens, the last one's logits read.
    COSHARD_CO_TRY(engine->begin_inference());
    auto logits = co_await ctx->forward(*model, tokens);
    auto ended = co_await engine->end_inference();  // (whether the forward worked or not)
    if (!logits) co_return fail(std::move(logits).error().with_context("generating token " + std::to_string(k + 1)));
    COSHARD_CO_TRY(ended);
    const modules::Shape& shape = logits->shape();
    if (shape.rank() != 3 || shape[0] != 1 || shape[1] != T)
      co_return fail(ErrorCode::invalid_argument, "generate: the model gave ", logits->describe(), " for ", T,
                     " tokens; expected logits [1, ", T, ", vocab]");
    const std::int64_t V = shape[2];
    // (named: GCC 12 cannot keep a Shape temporary across a co_await: "array used as initializer")
    Tensor last = logits->slice((T - 1) * V, modules::Shape{V});
    if (tensor) {  // each tensor rank holds its columns of the vocabulary, in rank order
      COSHARD_CO_TRY_ASSIGN(Tensor whole, ctx->empty(modules::Shape{V * tensor->size()}, last.dtype()));
      COSHARD_CO_TRY_ASSIGN(auto ready, ctx->stream().record());
      COSHARD_CO_TRY(tensor->stream().wait(ready));
      COSHARD_CO_TRY_ASSIGN(auto gathered, tensor->all_gather(last.data(), whole.data(), static_cast<std::size_t>(V),
                                                             last.dtype(), "the sampled row's logits"));
      COSHARD_CO_TRY(ctx->stream().wait(gathered));
      last = std::move(whole);
    }
    auto row = co_await ctx->read(last);
    if (!row) co_return fail(std::move(row).error());
    COSHARD_CO_TRY(decoding.advance(T));
    COSHARD_CO_TRY_ASSIGN(std::int32_t next, choose_token(*row, o, rng));
    // Every rank continues with rank 0's token (their logits agree; this makes it certain).
    const std::int32_t mine = comm->rank() == 0 ? next : -1;
    COSHARD_CO_TRY_ASSIGN(Tensor chosen, ctx->upload(std::as_bytes(std::span<const std::int32_t>(&mine, 1)),
                                                    modules::Shape{1}, DataType::i32));
    COSHARD_CO_TRY_ASSIGN(auto uploaded, ctx->stream().record());
    COSHARD_CO_TRY(comm->stream().wait(uploaded));
    COSHARD_CO_TRY_ASSIGN(auto reduced, comm->all_reduce(chosen.data(), chosen.data(), 1, DataType::i32,
                                                        collectives::ReduceOp::max, "the sampled token"));
    COSHARD_CO_TRY(ctx->stream().wait(reduced));
    COSHARD_CO_TRY_ASSIGN(auto agreed, co_await ctx->read(chosen));
    next = static_cast<std::int32_t>(agreed.at(0));
    out.push_back(next);
    input.assign(1, next);
  }
  co_return out;
}

async::Task<Result<std::vector<std::int32_t>>> Trainer::generate(std::span<const std::int32_t> prompt,
                                                                 const SampleOptions& options) {
  co_return co_await impl_->generate(prompt, options);
}

}  // namespace coshard::trainer
