// Tensor parallelism's layers (tensor_parallel.hpp): the fork and join around a split pair, the
// split layers' constructors, and the vocabulary-parallel cross-entropy.
#include "coshard/modules/tensor_parallel.hpp"

#include <numeric>

#include "kernels/kernels.hpp"
#include "layers/collective_order.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace {

using collectives::Communicator;
using collectives::ReduceOp;

// `input` reduced over the group into `out` (the same tensor: in place), ordered between ctx's
// stream's work before and after.
Result<void> all_reduce_between(Context& ctx, Communicator& group, const Tensor& input, const Tensor& out, ReduceOp op,
                                const std::string& purpose) {
  return detail::collective_between(ctx, group, purpose, [&] {
    return group.all_reduce(input.data(), out.data(), static_cast<std::size_t>(input.numel()), input.dtype(), op, purpose);
  });
}

Result<void> reduce_in_place(Context& ctx, Communicator& group, const Tensor& t, ReduceOp op, const std::string& purpose) {
  if (group.size() == 1) return {};
  return all_reduce_between(ctx, group, t, t, op, purpose);
}

const std::string kRowMaxima = "the logits' row maxima (vocabulary-parallel)";
const std::string kSoftmaxSums = "the softmax sums (vocabulary-parallel)";

TensorSplit part_of(const Communicator& group, int dim, std::vector<std::int64_t> segments, Shape whole) {
  return TensorSplit{.dim = dim, .segments = std::move(segments), .parts = group.size(), .index = group.rank(),
                     .whole = whole};
}

}  // namespace

Result<Tensor> sum_over_tensor_ranks(Context& ctx, Communicator& group, const Tensor& input, const std::string& purpose) {
  if (!input) return fail(ErrorCode::invalid_argument, "sum over the tensor ranks (", purpose, "): an empty tensor");
  if (group.size() == 1) return input;
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(input.shape(), input.dtype()));
  COSHARD_TRY(all_reduce_between(ctx, group, input, out, ReduceOp::sum, purpose));
  return out;
}

Result<Tensor> gather_over_tensor_ranks(Context& ctx, Communicator& group, const Tensor& input, const std::string& purpose) {
  if (!input) return fail(ErrorCode::invalid_argument, "gather over the tensor ranks (", purpose, "): an empty tensor");
  if (group.size() == 1) return input;
  std::vector<std::int64_t> dims(input.shape().dims().begin(), input.shape().dims().end());
  dims.front() *= group.size();
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(Shape::from(dims), input.dtype()));
  COSHARD_TRY(detail::collective_between(ctx, group, purpose, [&] {
    return group.all_gather(input.data(), out.data(), static_cast<std::size_t>(input.numel()), input.dtype(), purpose);
  }));
  return out;
}

async::Task<Result<Tensor>> TensorParallelFork::forward(Context&, Tensor input) { co_return input; }

async::Task<Result<Tensor>> TensorParallelFork::backward(Context& ctx, Tensor grad_output) {
  if (!grad_output) co_return grad_output;  // (token ids before it: nothing to sum)
  co_return sum_over_tensor_ranks(ctx, *group_, grad_output, purpose_);
}

async::Task<Result<Tensor>> TensorParallelJoin::forward(Context& ctx, Tensor input) {
  co_return sum_over_tensor_ranks(ctx, *group_, input, purpose_);
}

async::Task<Result<Tensor>> TensorParallelJoin::backward(Context&, Tensor grad_output) { co_return grad_output; }

Result<void> check_divides(std::int64_t whole, std::int64_t parts, std::string_view what) {
  if (parts < 1 || whole % parts != 0)
    return fail(ErrorCode::invalid_argument, "tensor-parallel size ", parts, " does not divide ", what, " (", whole,
                "): expected a divisor of ", whole);
  return {};
}

Result<std::unique_ptr<Linear>> column_parallel_linear(std::int64_t in_features, std::span<const std::int64_t> out_segments,
                                                       bool bias, Init weight_init, Communicator& group) {
  const std::int64_t parts = group.size();
  std::vector<std::int64_t> segments(out_segments.begin(), out_segments.end());
  for (const auto size : segments) COSHARD_TRY(check_divides(size, parts, "a column-parallel layer's output segment"));
  const std::int64_t out = std::accumulate(segments.begin(), segments.end(), std::int64_t{0});
  auto linear = std::make_unique<Linear>(in_features, out / parts, bias, weight_init);
  COSHARD_TRY(linear->weight().set_split(part_of(group, 0, segments, Shape{out, in_features})));
  if (linear->bias()) COSHARD_TRY(linear->bias()->set_split(part_of(group, 0, segments, Shape{out})));
  return linear;
}

Result<std::unique_ptr<Linear>> row_parallel_linear(std::int64_t in_features, std::int64_t out_features,
                                                    Init weight_init, Communicator& group) {
  const std::int64_t parts = group.size();
  COSHARD_TRY(check_divides(in_features, parts, "a row-parallel layer's inputs"));
  auto linear = std::make_unique<Linear>(in_features / parts, out_features, false, weight_init);
  COSHARD_TRY(linear->weight().set_split(part_of(group, 1, {in_features}, Shape{out_features, in_features})));
  return linear;
}

Result<std::unique_ptr<TokenEmbedding>> vocab_parallel_embedding(std::int64_t vocab, std::int64_t dim, Init init,
                                                                 Communicator& group) {
  const std::int64_t parts = group.size();
  COSHARD_TRY(check_divides(vocab, parts, "the vocabulary"));
  const std::int64_t rows = vocab / parts;
  auto table = std::make_unique<TokenEmbedding>(rows, dim, init, rows * group.rank(), vocab);
  COSHARD_TRY(table->weight().set_split(part_of(group, 0, {vocab}, Shape{vocab, dim})));
  return table;
}

// ---- VocabParallelCrossEntropyLoss ----

async::Task<Result<Tensor>> VocabParallelCrossEntropyLoss::forward(Context& ctx, Tensor logits) {
  constexpr std::string_view who = "VocabParallelCrossEntropyLoss";
  COSHARD_CO_TRY(detail::check_activation(ctx, logits, 0, who));
  const std::int64_t N = logits.shape().rows(), V = logits.shape().back(), parts = group_->size();
  const std::int64_t vocab = vocab_ > 0 ? vocab_ : V * parts;
  if (V * parts != vocab)
    co_return fail(ErrorCode::invalid_argument, who, ": logits ", logits.describe(), " are ", V, " columns on each of ",
                   parts, " tensor ranks, expected ", vocab, " / ", parts, " (a vocabulary of ", vocab, ")");
  if (!targets_ || targets_.dtype() != DataType::i32 || targets_.numel() != N || !(targets_.device() == ctx.device()))
    co_return fail(ErrorCode::invalid_argument, who, ": targets ", targets_ ? targets_.describe() : "not set",
                   ", expected i32 with ", N, " elements (one per row of ", logits.describe(), ") on ",
                   ctx.device().to_string());
  const DataType dt = logits.dtype(), stat = detail::stat_dtype(dt);
  const std::int64_t first = V * group_->rank();
  const auto& k = ctx.kernels();
  COSHARD_CO_TRY_ASSIGN(Tensor max, ctx.empty(Shape{N}, stat));
  COSHARD_CO_TRY(k.row_max(ctx.stream(), dt, logits.data(), max.data(), N, V));
  COSHARD_CO_TRY(reduce_in_place(ctx, *group_, max, ReduceOp::max, kRowMaxima));
  COSHARD_CO_TRY_ASSIGN(Tensor sums, ctx.empty(Shape{2 * N}, stat));
  COSHARD_CO_TRY(k.vocab_ce_sums(ctx.stream(), dt, logits.data(), targets_.data_as<std::int32_t>(), max.data(),
                                 sums.data(), N, V, first, vocab));
  COSHARD_CO_TRY(reduce_in_place(ctx, *group_, sums, ReduceOp::sum, kSoftmaxSums));
  COSHARD_CO_TRY_ASSIGN(Tensor loss, ctx.empty(Shape{1}, stat));
  COSHARD_CO_TRY(k.vocab_ce_loss(ctx.stream(), dt, max.data(), sums.data(), loss.data(), N));
  saved_ = Saved{std::move(logits), std::move(max), std::move(sums)};
  co_return loss;
}

async::Task<Result<Tensor>> VocabParallelCrossEntropyLoss::backward(Context& ctx, Tensor seed) {
  if (!saved_.logits) co_return fail(ErrorCode::invalid_argument, "VocabParallelCrossEntropyLoss: backward without a forward");
  const Tensor& logits = saved_.logits;
  const DataType dt = logits.dtype();
  COSHARD_CO_TRY(detail::check_seed(ctx, seed, dt, "VocabParallelCrossEntropyLoss"));
  const std::int64_t N = logits.shape().rows(), V = logits.shape().back();
  COSHARD_CO_TRY_ASSIGN(Tensor dlogits, ctx.empty(logits.shape(), dt));
  COSHARD_CO_TRY(ctx.kernels().vocab_ce_backward(ctx.stream(), dt, logits.data(), targets_.data_as<std::int32_t>(),
                                                 saved_.max.data(), saved_.sums.data(), seed.data(), dlogits.data(), N,
                                                 V, V * group_->rank()));
  saved_ = {};
  co_return dlogits;
}

}  // namespace coshard::modules
