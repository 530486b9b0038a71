// Low-rank adapters (lora.hpp): the adapter's products through strided GEMMs on its rows of the
// Linear's output (no copy of the rows), whole or split with a tensor-parallel layer. Which
// layers get adapters (apply_lora) is lora_apply.cpp's.
#include "coshard/modules/lora.hpp"

#include <cmath>

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/tensor_parallel.hpp"
#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"
#include "random.hpp"

namespace coshard::modules {
namespace {

using detail::GemmArgs;

// (named in the collectives of split adapters: each outlives the step)
const std::string kLoraProduct = "a LoRA adapter's product A x (tensor-parallel)";
const std::string kLoraProductGradient = "the gradient of a LoRA adapter's product A x (tensor-parallel)";

}  // namespace

// ---- LoraAdapter ----

LoraAdapter::LoraAdapter(std::int64_t in_features, std::int64_t row_begin, std::int64_t row_end,
                         std::int64_t out_features, const LoraOptions& options)
    : LoraAdapter(LoraPlacement{.in = in_features, .row_begin = row_begin, .row_end = row_end, .out = out_features,
                                .whole_in = in_features, .whole_row_begin = row_begin, .whole_row_end = row_end, .row_segments = {}},
                  options) {}

namespace {

std::int64_t parts_of(const LoraPlacement& w) noexcept { return w.split == LoraSplit::none || !w.group ? 1 : w.group->size(); }
std::int64_t index_of(const LoraPlacement& w) noexcept { return w.split == LoraSplit::none || !w.group ? 0 : w.group->rank(); }

}  // namespace

LoraAdapter::LoraAdapter(const LoraPlacement& where, const LoraOptions& options)
    : where_(where),
      in_(where.in),
      row_begin_(where.row_begin),
      row_end_(where.row_end),
      out_(where.out),
      rank_(options.rank),
      a_rows_(options.rank),
      alpha_(options.alpha),
      dropout_(options.dropout),
      seed_(options.seed) {
  const std::int64_t parts = parts_of(where), index = index_of(where);
  if (where.split == LoraSplit::output_rows) a_rows_ = rank_ / parts;
  if (where.split == LoraSplit::input_columns) {  // (this rank's rows of the adapter's, in the whole output)
    const std::int64_t rows = (where.row_end - where.row_begin) / parts;
    row_begin_ = where.row_begin + index * rows;
    row_end_ = row_begin_ + rows;
  }
  const double bound = 1.0 / std::sqrt(static_cast<double>(where.whole_in));  // kaiming_uniform_(a=sqrt(5)), the whole's fan-in
  register_parameter("A", Shape{a_rows_, in_}, Init::uniform(-bound, bound));
  register_parameter("B", Shape{row_end_ - row_begin_, rank_}, Init::zeros());
}

Result<void> LoraAdapter::split_parameters() {
  if (where_.split == LoraSplit::none) return {};
  const std::int64_t parts = parts_of(where_), index = index_of(where_);
  const std::int64_t whole_rows = where_.whole_row_end - where_.whole_row_begin;
  auto part = [&](int dim, std::int64_t along, Shape whole) {
    return TensorSplit{.dim = dim, .segments = {along}, .parts = parts, .index = index, .whole = whole};
  };
  if (where_.split == LoraSplit::output_rows) COSHARD_TRY(a().set_split(part(0, rank_, Shape{rank_, where_.whole_in})));
  else COSHARD_TRY(a().set_split(part(1, where_.whole_in, Shape{rank_, where_.whole_in})));
  if (where_.split == LoraSplit::output_rows && !where_.row_segments.empty())
    return b().set_split(TensorSplit{.dim = 0, .segments = where_.row_segments, .parts = parts, .index = index,
                                     .whole = Shape{whole_rows, rank_}});
  return b().set_split(part(0, whole_rows, Shape{whole_rows, rank_}));
}

Result<Tensor> LoraAdapter::dropout_mask(Context& ctx, const Tensor& input) {
  // A forward's ordinal decides its mask; a recompute (activation checkpointing) replays the
  // mask of the forward whose backward comes next.
  std::uint64_t ordinal = 0;
  if (ctx.recomputing() && !pending_.empty()) {
    ordinal = pending_.back();
  } else {
    ordinal = forwards_++;
    pending_.push_back(ordinal);
  }
  const std::int64_t n = input.numel();
  std::vector<float> values(static_cast<std::size_t>(n));
  const auto keep = static_cast<float>(1.0 / (1.0 - dropout_));
  detail::SplitMix64 rng{seed_ ^ detail::SplitMix64{ordinal}.next()};
  if (where_.split == LoraSplit::input_columns) {
    // This rank's columns of the whole input's mask (the unsplit run's, element for element).
    const std::int64_t rows = input.shape().rows(), first = index_of(where_) * in_;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < where_.whole_in; ++c) {
        const float v = rng.uniform01() < dropout_ ? 0.0f : keep;
        if (c >= first && c < first + in_) values[static_cast<std::size_t>(r * in_ + c - first)] = v;
      }
  } else {
    for (auto& v : values) v = rng.uniform01() < dropout_ ? 0.0f : keep;
  }
  COSHARD_TRY_ASSIGN(Tensor f32, ctx.upload(std::as_bytes(std::span<const float>(values)), input.shape(), DataType::f32));
  if (input.dtype() == DataType::f32) return f32;
  COSHARD_TRY_ASSIGN(Tensor mask, ctx.empty(input.shape(), input.dtype()));
  COSHARD_TRY(ctx.kernels().cast(ctx.stream(), DataType::f32, f32.data(), input.dtype(), mask.data(), n));
  return mask;
}

async::Task<Result<Tensor>> LoraAdapter::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(detail::check_activation(ctx, input, in_, "LoraAdapter"));
  const DataType dt = input.dtype();
  COSHARD_CO_TRY(detail::check_param(a(), dt, "LoraAdapter"));
  COSHARD_CO_TRY(detail::check_param(b(), dt, "LoraAdapter"));
  Tensor out = add_into_;
  if (!out || out.shape() != input.shape().with_back(out_) || out.dtype() != dt)
    co_return fail(ErrorCode::invalid_argument, "LoraAdapter: run by its Linear only (no output of shape ",
                   input.shape().with_back(out_).to_string(), " to add into)");
  const std::int64_t rows = input.shape().rows();
  auto& k = ctx.kernels();
  Saved saved;
  saved.input = input;
  if (dropout_ > 0) {
    COSHARD_CO_TRY_ASSIGN(saved.mask, dropout_mask(ctx, input));
    COSHARD_CO_TRY_ASSIGN(saved.input, ctx.empty(input.shape(), dt));
    COSHARD_CO_TRY(k.mul(ctx.stream(), dt, input.data(), saved.mask.data(), saved.input.data(), input.numel()));
  }
  if (where_.split == LoraSplit::output_rows) {
    COSHARD_CO_TRY(forward_output_rows(ctx, saved, out));
    saved_.push(std::move(saved));
    co_return out;
  }
  // product [rows, rank] = x A^T; out[:, begin:end] += scale * product B^T (ldc: the whole row).
  COSHARD_CO_TRY_ASSIGN(saved.product, ctx.empty(Shape{rows, rank_}, dt));
  COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                        GemmArgs{.trans_b = true, .m = rows, .n = rank_, .k = in_, .a = saved.input.data(), .lda = in_,
                                 .b = a().value().data(), .ldb = in_, .c = saved.product.data(), .ldc = rank_}));
  // (split by input columns: each rank's columns gave a part of the product)
  if (where_.split == LoraSplit::input_columns) {
    COSHARD_CO_TRY_ASSIGN(saved.product, sum_over_tensor_ranks(ctx, *where_.group, saved.product, kLoraProduct));
  }
  auto* rows_out = static_cast<std::byte*>(out.data()) + static_cast<std::size_t>(row_begin_) * size_of(dt);
  COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                        GemmArgs{.trans_b = true, .m = rows, .n = row_end_ - row_begin_, .k = rank_,
                                 .a = saved.product.data(), .lda = rank_, .b = b().value().data(), .ldb = rank_,
                                 .c = rows_out, .ldc = out_, .alpha = scale(), .beta = 1.0f}));
  saved_.push(std::move(saved));
  co_return out;
}

async::Task<Result<Tensor>> LoraAdapter::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(Saved saved, saved_.pop("LoraAdapter"));
  if (dropout_ > 0 && !pending_.empty()) pending_.pop_back();
  const DataType dt = saved.input.dtype();
  COSHARD_CO_TRY(detail::check_grad(grad_output, saved.input.shape().with_back(out_), dt, "LoraAdapter"));
  if (where_.split == LoraSplit::output_rows) co_return backward_output_rows(ctx, saved, grad_output);
  const std::int64_t rows = saved.input.shape().rows(), width = row_end_ - row_begin_;
  auto& k = ctx.kernels();
  const auto* dy = static_cast<const std::byte*>(grad_output.data()) + static_cast<std::size_t>(row_begin_) * size_of(dt);
  // dB += scale * dy[:, rows]^T product; dproduct = scale * dy[:, rows] B.
  if (b().grad())
    COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                          GemmArgs{.trans_a = true, .m = width, .n = rank_, .k = rows, .a = dy, .lda = out_,
                                   .b = saved.product.data(), .ldb = rank_, .c = b().grad().data(), .ldc = rank_,
                                   .alpha = scale(), .beta = 1.0f}));
  COSHARD_CO_TRY_ASSIGN(Tensor dproduct, ctx.empty(Shape{rows, rank_}, dt));
  COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                        GemmArgs{.m = rows, .n = rank_, .k = width, .a = dy, .lda = out_, .b = b().value().data(),
                                 .ldb = rank_, .c = dproduct.data(), .ldc = rank_, .alpha = scale()}));
  // (split by input columns: each rank's rows of B gave a part of it)
  if (where_.split == LoraSplit::input_columns) {
    COSHARD_CO_TRY_ASSIGN(dproduct, sum_over_tensor_ranks(ctx, *where_.group, dproduct, kLoraProductGradient));
  }
  // dA += dproduct^T x; dx = dproduct A (times the dropout's mask).
  if (a().grad())
    COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                          GemmArgs{.trans_a = true, .m = rank_, .n = in_, .k = rows, .a = dproduct.data(), .lda = rank_,
                                   .b = saved.input.data(), .ldb = in_, .c = a().grad().data(), .ldc = in_,
                                   .beta = 1.0f}));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(saved.input.shape(), dt));
  COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                        GemmArgs{.m = rows, .n = in_, .k = rank_, .a = dproduct.data(), .lda = rank_,
                                 .b = a().value().data(), .ldb = in_, .c = dx.data(), .ldc = in_}));
  if (saved.mask) COSHARD_CO_TRY(k.mul(ctx.stream(), dt, dx.data(), saved.mask.data(), dx.data(), dx.numel()));
  co_return dx;
}

// Split by output rows, the product kept transposed ([rank, rows]): each rank makes its rows of the
// rank dimension (A's rows here), gathered rank-major into the whole, then its own output rows.
Result<void> LoraAdapter::forward_output_rows(Context& ctx, Saved& saved, const Tensor& out) {
  const DataType dt = saved.input.dtype();
  const std::int64_t rows = saved.input.shape().rows();
  auto& k = ctx.kernels();
  COSHARD_TRY_ASSIGN(Tensor part, ctx.empty(Shape{a_rows_, rows}, dt));  // A x^T, this rank's rows of it
  COSHARD_TRY(k.gemm(ctx.stream(), dt,
                     GemmArgs{.trans_b = true, .m = a_rows_, .n = rows, .k = in_, .a = a().value().data(), .lda = in_,
                              .b = saved.input.data(), .ldb = in_, .c = part.data(), .ldc = rows}));
  COSHARD_TRY_ASSIGN(saved.product, gather_over_tensor_ranks(ctx, *where_.group, part, kLoraProduct));
  auto* rows_out = static_cast<std::byte*>(out.data()) + static_cast<std::size_t>(row_begin_) * size_of(dt);
  return k.gemm(ctx.stream(), dt,
                GemmArgs{.trans_a = true, .trans_b = true, .m = rows, .n = row_end_ - row_begin_, .k = rank_,
                         .a = saved.product.data(), .lda = rows, .b = b().value().data(), .ldb = rank_, .c = rows_out,
                         .ldc = out_, .alpha = scale(), .beta = 1.0f});
}

Result<Tensor> LoraAdapter::backward_output_rows(Context& ctx, const Saved& saved, const Tensor& grad_output) {
  const DataType dt = saved.input.dtype();
  const std::int64_t rows = saved.input.shape().rows(), width = row_end_ - row_begin_;
  auto& k = ctx.kernels();
  const auto* dy = static_cast<const std::byte*>(grad_output.data()) + static_cast<std::size_t>(row_begin_) * size_of(dt);
  // dB += scale * dy[:, rows]^T product; the product's gradient (transposed) = scale * B^T dy^T,
  // a part from each rank's rows, summed.
  if (b().grad())
    COSHARD_TRY(k.gemm(ctx.stream(), dt,
                       GemmArgs{.trans_a = true, .trans_b = true, .m = width, .n = rank_, .k = rows, .a = dy, .lda = out_,
                                .b = saved.product.data(), .ldb = rows, .c = b().grad().data(), .ldc = rank_,
                                .alpha = scale(), .beta = 1.0f}));
  COSHARD_TRY_ASSIGN(Tensor dproduct, ctx.empty(Shape{rank_, rows}, dt));
  COSHARD_TRY(k.gemm(ctx.stream(), dt,
                     GemmArgs{.trans_a = true, .trans_b = true, .m = rank_, .n = rows, .k = width, .a = b().value().data(),
                              .lda = rank_, .b = dy, .ldb = out_, .c = dproduct.data(), .ldc = rows, .alpha = scale()}));
  COSHARD_TRY_ASSIGN(dproduct, sum_over_tensor_ranks(ctx, *where_.group, dproduct, kLoraProductGradient));
  // This rank's rows of it: dA += mine x; dx = mine^T A (a part: the layer's fork sums dx).
  const auto* mine = static_cast<const std::byte*>(dproduct.data()) +
                     static_cast<std::size_t>(index_of(where_) * a_rows_ * rows) * size_of(dt);
  if (a().grad())
    COSHARD_TRY(k.gemm(ctx.stream(), dt,
                       GemmArgs{.m = a_rows_, .n = in_, .k = rows, .a = mine, .lda = rows, .b = saved.input.data(),
                                .ldb = in_, .c = a().grad().data(), .ldc = in_, .beta = 1.0f}));
  COSHARD_TRY_ASSIGN(Tensor dx, ctx.empty(saved.input.shape(), dt));
  COSHARD_TRY(k.gemm(ctx.stream(), dt,
                     GemmArgs{.trans_a = true, .m = rows, .n = in_, .k = a_rows_, .a = mine, .lda = rows,
                              .b = a().value().data(), .ldb = in_, .c = dx.data(), .ldc = in_}));
  if (saved.mask) COSHARD_TRY(k.mul(ctx.stream(), dt, dx.data(), saved.mask.data(), dx.data(), dx.numel()));
  return dx;
}

}  // namespace coshard::modules
