// The sparse MoE block's experts on their rows (moe.hpp): this rank's experts one by one through
// the hooks, and with expert parallelism the rows' trip to their experts' ranks and back.
#include "coshard/modules/moe.hpp"

#include <numeric>

#include "coshard/async/json_limits.hpp"
#include "layers/collective_order.hpp"

namespace coshard::modules {
namespace {

// rows [first, first + count) of a [rows, width] tensor.
Tensor row_range(const Tensor& t, std::int64_t first, std::int64_t count, std::int64_t width) {
  return t.slice(first * width, Shape{count, width});
}

const std::string kCounts = "the rows each rank sends each expert (expert parallelism)";
const std::string kRowsOut = "the routed rows to their experts' ranks";
const std::string kRowsBack = "the experts' rows back to their tokens' ranks";

// `send`'s rows to the group's ranks (send_rows[q] to rank q, in rank order) and theirs into
// `recv` (recv_rows[q] from rank q), ordered between the compute stream's work before and after.
Result<void> exchange_rows(Context& ctx, collectives::Communicator& group, const Tensor& send,
                           const std::vector<std::int64_t>& send_rows, const Tensor& recv,
                           const std::vector<std::int64_t>& recv_rows, std::int64_t width, const std::string& purpose) {
  std::vector<std::size_t> out, in;
  for (const auto r : send_rows) out.push_back(static_cast<std::size_t>(r * width));
  for (const auto r : recv_rows) in.push_back(static_cast<std::size_t>(r * width));
  return detail::collective_between(ctx, group, purpose, [&] {
    return group.all_to_allv(send.data(), out, recv.data(), in, send.dtype(), purpose);
  });
}

// Rows laid out [rank][expert] (as they arrive) into [expert][rank] (each expert's rows
// together), or back when `back`. counts[p * L + j]: the rows rank p has for expert j.
Result<void> regroup(Context& ctx, const Tensor& from, const Tensor& to, const std::vector<std::int64_t>& counts,
                     std::int64_t ranks, std::int64_t experts, std::int64_t width, bool back) {
  std::vector<std::int64_t> by_rank(counts.size()), by_expert(counts.size());  // each chunk's first row
  std::int64_t at = 0;
  for (std::int64_t p = 0; p < ranks; ++p)
    for (std::int64_t j = 0; j < experts; ++j) {
      by_rank[static_cast<std::size_t>(p * experts + j)] = at;
      at += counts[static_cast<std::size_t>(p * experts + j)];
    }
  at = 0;
  for (std::int64_t j = 0; j < experts; ++j)
    for (std::int64_t p = 0; p < ranks; ++p) {
      by_expert[static_cast<std::size_t>(p * experts + j)] = at;
      at += counts[static_cast<std::size_t>(p * experts + j)];
    }
  const std::size_t row_bytes = static_cast<std::size_t>(width) * size_of(from.dtype());
  for (std::size_t c = 0; c < counts.size(); ++c) {
    if (counts[c] == 0) continue;
    const std::int64_t src = back ? by_expert[c] : by_rank[c], dst = back ? by_rank[c] : by_expert[c];
    COSHARD_TRY(ctx.stream().copy(static_cast<std::byte*>(to.data()) + static_cast<std::size_t>(dst) * row_bytes,
                                  static_cast<const std::byte*>(from.data()) + static_cast<std::size_t>(src) * row_bytes,
                                  static_cast<std::size_t>(counts[c]) * row_bytes));
  }
  return {};
}

}  // namespace

async::Task<Result<void>> SparseMoe::run_local_experts(Context& ctx, bool forward, const Tensor& rows, const Tensor& out,
                                                       const std::vector<std::int64_t>& counts,
                                                       const std::vector<bool>& runs) {
  const std::int64_t D = o_.dim, L = local_;
  const DataType dt = rows.dtype();
  if (ctx.hooks()) {  // (an engine gathers them ahead, in the order they run)
    std::vector<Module*> next;
    for (std::int64_t i = 0; i < L; ++i) {
      const std::int64_t j = forward ? i : L - 1 - i;
      if (runs[static_cast<std::size_t>(j)]) next.push_back(experts_[static_cast<std::size_t>(first_local_ + j)]);
    }
    ctx.hooks()->announce_next(ctx, next);
  }
  std::vector<std::int64_t> first(static_cast<std::size_t>(L), 0);
  for (std::int64_t j = 1; j < L; ++j)
    first[static_cast<std::size_t>(j)] = first[static_cast<std::size_t>(j - 1)] + counts[static_cast<std::size_t>(j - 1)];
  for (std::int64_t i = 0; i < L; ++i) {
    const std::int64_t j = forward ? i : L - 1 - i, e = first_local_ + j;
    if (!runs[static_cast<std::size_t>(j)]) continue;
    const std::int64_t count = counts[static_cast<std::size_t>(j)], at = first[static_cast<std::size_t>(j)];
    Module& expert = *experts_[static_cast<std::size_t>(e)];
    // (named: GCC 12 destroys a class-type temporary argument of a coroutine in co_await twice)
    const Tensor expert_rows = row_range(rows, at, count, D);
    // (not `forward ? co_await a : co_await b`: GCC 12 destroys that conditional's result twice)
    Tensor y;
    if (forward) {
      COSHARD_CO_TRY_ASSIGN(y, co_await ctx.forward(expert, expert_rows));
    } else {
      COSHARD_CO_TRY_ASSIGN(y, co_await ctx.backward(expert, expert_rows));
    }
    if (!(y.shape() == Shape{count, D}) || y.dtype() != dt)
      co_return fail(ErrorCode::invalid_argument, "SparseMoe: expert ", e, forward ? " gave " : "'s backward gave ",
                     y.describe(), " for ", count, " rows of ", D, " (expected ", async::to_string(dt),
                     Shape{count, D}.to_string(), ")");
    const Tensor out_rows = row_range(out, at, count, D);
    COSHARD_CO_TRY(ctx.stream().copy(out_rows.data(), y.data(), y.bytes()));
  }
  co_return Result<void>{};
}

async::Task<Result<void>> SparseMoe::exchange_counts(Context& ctx, Saved& saved) {
  auto& group = *o_.expert_group;
  const std::int64_t P = group.size(), L = local_;
  std::vector<std::int32_t> mine(saved.counts.begin(), saved.counts.end());  // block q: rank q's experts
  COSHARD_CO_TRY_ASSIGN(Tensor send, ctx.upload(std::as_bytes(std::span<const std::int32_t>(mine)), Shape{P * L}, DataType::i32));
  COSHARD_CO_TRY_ASSIGN(Tensor recv, ctx.empty(Shape{P * L}, DataType::i32));
  COSHARD_CO_TRY(detail::collective_between(ctx, group, kCounts, [&] {
    return group.all_to_all(send.data(), recv.data(), static_cast<std::size_t>(L), DataType::i32, kCounts);
  }));
  COSHARD_CO_TRY_ASSIGN(const std::vector<double> received, co_await ctx.read(recv));
  saved.received.assign(received.begin(), received.end());
  saved.sent.assign(static_cast<std::size_t>(P), 0);
  for (std::int64_t e = 0; e < o_.experts; ++e) saved.sent[static_cast<std::size_t>(e / L)] += saved.counts[static_cast<std::size_t>(e)];
  co_return Result<void>{};
}

async::Task<Result<void>> SparseMoe::run_exchanged(Context& ctx, bool forward, const Tensor& rows, const Tensor& out,
                                                   Saved& saved) {
  auto& group = *o_.expert_group;
  const std::int64_t P = group.size(), L = local_, D = o_.dim;
  const DataType dt = rows.dtype();
  std::vector<std::int64_t> from(static_cast<std::size_t>(P), 0), local_counts(static_cast<std::size_t>(L), 0);
  for (std::int64_t p = 0; p < P; ++p)
    for (std::int64_t j = 0; j < L; ++j) {
      const std::int64_t c = saved.received[static_cast<std::size_t>(p * L + j)];
      from[static_cast<std::size_t>(p)] += c;
      local_counts[static_cast<std::size_t>(j)] += c;
    }
  const std::int64_t arrived = std::accumulate(from.begin(), from.end(), std::int64_t{0});
  std::vector<bool> local_runs(saved.runs.begin() + first_local_, saved.runs.begin() + first_local_ + L);
  COSHARD_CO_TRY_ASSIGN(Tensor by_rank, ctx.empty(Shape{arrived, D}, dt));
  COSHARD_CO_TRY_ASSIGN(Tensor by_expert, ctx.empty(Shape{arrived, D}, dt));
  COSHARD_CO_TRY(exchange_rows(ctx, group, rows, saved.sent, by_rank, from, D, forward ? kRowsOut : kRowsBack));
  COSHARD_CO_TRY(regroup(ctx, by_rank, by_expert, saved.received, P, L, D, false));
  COSHARD_CO_TRY_ASSIGN(Tensor results, ctx.empty(Shape{arrived, D}, dt));
  COSHARD_CO_TRY(co_await run_local_experts(ctx, forward, by_expert, results, local_counts, local_runs));
  COSHARD_CO_TRY(regroup(ctx, results, by_rank, saved.received, P, L, D, true));
  COSHARD_CO_TRY(exchange_rows(ctx, group, by_rank, from, out, saved.sent, D, forward ? kRowsBack : kRowsOut));
  co_return Result<void>{};
}

std::vector<ExpertPlace> expert_places(Module& model) {
  std::vector<ExpertPlace> out;
  model.for_each_module([&](const std::string& path, Module& m) {
    auto* moe = dynamic_cast<SparseMoe*>(&m);
    if (!moe || moe->expert_parallel() == 1) return;
    const std::string prefix = (path.empty() ? "" : path + ".") + "experts.";
    const std::int64_t first = moe->first_local_expert(), local = moe->local_experts();
    for (std::int64_t j = 0; j < local; ++j)
      moe->expert(first + j)->for_each_parameter([&](const std::string& sub, Parameter& p) {
        ExpertPlace e{.name = prefix + std::to_string(first + j) + "." + sub, .numel = p.numel(), .names_by_rank = {}};
        for (int q = 0; q < moe->expert_parallel(); ++q)
          e.names_by_rank.push_back(prefix + std::to_string(q * local + j) + "." + sub);
        out.push_back(std::move(e));
      });
  });
  return out;
}

Result<void> check_same_on_every_expert_rank(Module& model, std::string_view pattern, std::string_view what) {
  for (const auto& place : expert_places(model)) {
    std::size_t matched = 0;
    for (const auto& name : place.names_by_rank) matched += glob_matches(pattern, name) ? 1 : 0;
    if (matched != 0 && matched != place.names_by_rank.size()) {
      std::string others;
      for (const auto& name : place.names_by_rank)
        if (!glob_matches(pattern, name)) others += (others.empty() ? "" : ", ") + name;
      return fail(ErrorCode::invalid_argument, what, " '", async::bounded_echo(pattern, 256), "' selects ", matched, " of the ",
                  place.names_by_rank.size(), " experts' parameters in one place (not ", others,
                  "): with expert parallelism each expert rank holds other experts in the same places, so a pattern "
                  "must select every expert of a layer or none (a projection of every expert: 'h*.mlp.moe.experts.*.down.*')");
    }
  }
  return {};
}

}  // namespace coshard::modules
