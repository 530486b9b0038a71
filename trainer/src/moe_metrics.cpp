#include "moe_metrics.hpp"

#include <algorithm>

namespace coshard::trainer::detail {

async::Task<Result<void>> add_moe_stats(modules::Context& ctx, collectives::Communicator& comm,
                                        const modules::RouterAuxLoss& loss, StepStats& out) {
  const auto& totals = loss.totals();
  if (!totals.aux_sum || totals.forwards == 0) co_return Result<void>{};
  // [the mean load-balancing loss of this rank's forwards, each layer's choices of each expert]
  COSHARD_CO_TRY_ASSIGN(const auto aux_sum, co_await ctx.read(totals.aux_sum));
  std::vector<float> values{static_cast<float>(aux_sum.at(0) / static_cast<double>(totals.forwards))};
  for (const auto& layer : totals.chosen) values.insert(values.end(), layer.begin(), layer.end());
  const std::int64_t count = static_cast<std::int64_t>(values.size());
  COSHARD_CO_TRY_ASSIGN(auto send, ctx.upload(std::as_bytes(std::span<const float>(values)), modules::Shape{count},
                                              modules::DataType::f32));
  std::vector<double> summed(values.begin(), values.end());
  if (comm.size() > 1) {
    COSHARD_CO_TRY_ASSIGN(auto recv, ctx.empty(modules::Shape{count}, modules::DataType::f32));
    COSHARD_CO_TRY_ASSIGN(auto uploaded, ctx.stream().record());
    COSHARD_CO_TRY(comm.stream().wait(uploaded));
    COSHARD_CO_TRY_ASSIGN(auto reduced, comm.all_reduce(send.data(), recv.data(), static_cast<std::size_t>(count),
                                                        modules::DataType::f32, collectives::ReduceOp::sum));
    COSHARD_CO_TRY(ctx.stream().wait(reduced));
    COSHARD_CO_TRY_ASSIGN(summed, co_await ctx.read(recv));
  }
  out.aux_loss = summed.at(0) / comm.size();
  std::size_t at = 1;
  for (const auto& layer : totals.chosen) {
    const auto first = summed.begin() + static_cast<std::ptrdiff_t>(at), last = first + static_cast<std::ptrdiff_t>(layer.size());
    double total = 0, largest = 0;
    std::int64_t used = 0;
    for (auto it = first; it != last; ++it) {
      total += *it;
      largest = std::max(largest, *it);
      used += *it > 0 ? 1 : 0;
    }
    out.experts_used.push_back(used);
    out.largest_expert_share.push_back(total > 0 ? largest / total : 0.0);
    at += layer.size();
  }
  co_return Result<void>{};
}

}  // namespace coshard::trainer::detail
