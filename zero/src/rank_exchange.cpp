// Small exchanges between the ranks (rank_exchange.hpp).
#include "rank_exchange.hpp"

#include <cstring>

#include "stream_order.hpp"

namespace coshard::zero::detail {

using collectives::ReduceOp;
using modules::DataType;
using modules::Shape;
using modules::Tensor;
using modules::encode_values;

async::Task<Result<std::vector<std::int64_t>>> RankExchange::all_ranks(std::vector<std::int64_t> mine) {
  const auto n = static_cast<std::int64_t>(mine.size());
  std::span<const std::byte> bytes = std::as_bytes(std::span<const std::int64_t>(mine));
  // As i32 pairs: the collectives' integer type.
  COSHARD_CO_TRY_ASSIGN(Tensor src, ctx_->upload(bytes, Shape{2 * n}, DataType::i32));
  COSHARD_CO_TRY_ASSIGN(Tensor all, ctx_->empty(Shape{2 * n * world_->size()}, DataType::i32));
  auto& compute = ctx_->stream();
  COSHARD_CO_TRY(order(compute, world_->stream()));
  auto done = world_->all_gather(src.data(), all.data(), static_cast<std::size_t>(2 * n), DataType::i32);
  if (!done) co_return fail(std::move(done).error().with_context("exchanging checkpoint status between ranks"));
  COSHARD_CO_TRY(compute.wait(*done));
  COSHARD_CO_TRY_ASSIGN(auto out_bytes, co_await ctx_->read_bytes(all));
  std::vector<std::int64_t> out(static_cast<std::size_t>(n * world_->size()));
  std::memcpy(out.data(), out_bytes.data(), out.size() * sizeof(std::int64_t));
  co_return out;
}

async::Task<Result<void>> RankExchange::every_rank_can_load(bool ok, std::string what) {
  co_return co_await every_rank_agrees(ok, std::move(what), "nothing was loaded");
}

async::Task<Result<void>> RankExchange::every_rank_agrees(bool ok, std::string what, std::string consequence) {
  std::vector<std::int64_t> outcome{ok ? 1 : 0};  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY_ASSIGN(auto oks, co_await all_ranks(std::move(outcome)));
  for (int r = 0; r < world_->size(); ++r)
    if (oks[static_cast<std::size_t>(r)] != 1)
      co_return fail(ErrorCode::invalid_argument, what, ": rank ", r, " refused it (its error says why); ", consequence);
  co_return Result<void>{};
}

async::Task<Result<std::vector<double>>> RankExchange::all_reduce_values(std::span<const double> values,
                                                                          ReduceOp op, std::string_view purpose) {
  auto bytes = encode_values(values, DataType::f32);
  COSHARD_CO_TRY_ASSIGN(Tensor t, ctx_->upload(bytes, Shape{static_cast<std::int64_t>(values.size())}, DataType::f32));
  COSHARD_CO_TRY(order(ctx_->stream(), world_->stream()));
  COSHARD_CO_TRY(world_->all_reduce(t.data(), t.data(), values.size(), DataType::f32, op, purpose));
  COSHARD_CO_TRY(order(world_->stream(), ctx_->stream()));
  COSHARD_CO_TRY_ASSIGN(auto reduced, co_await ctx_->read(t));
  co_return std::vector<double>(reduced.begin(), reduced.end());
}

}  // namespace coshard::zero::detail
