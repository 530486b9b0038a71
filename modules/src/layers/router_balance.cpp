// The load-balancing loss of a model's MoE layers (moe.hpp), as transformers'
// load_balancing_loss_func computes it over one forward:
//   rows = every MoE layer's tokens pooled (L x N), C_e = the top-k choices of expert e over
//   them, P_e = the softmax probabilities of e summed over them;
//   loss = E * sum_e (C_e / rows) * (P_e / rows)
// so d loss / d p[row, e] = E * C_e / rows^2 for every pooled row (the choices carry no gradient).
#include <algorithm>

#include "coshard/modules/moe.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules {
namespace {

Result<Tensor> upload_f32(Context& ctx, std::span<const double> values) {
  std::vector<float> f(values.begin(), values.end());
  return ctx.upload(std::as_bytes(std::span<const float>(f)), Shape{static_cast<std::int64_t>(f.size())}, DataType::f32);
}

}  // namespace

Result<void> RouterBalance::add_layer(Context& ctx, bool first_layer, std::span<const double> chosen_per_expert,
                                      const Tensor& probs, std::int64_t tokens) {
  if (static_cast<std::int64_t>(chosen_per_expert.size()) != experts_ || probs.numel() != experts_ ||
      probs.dtype() != DataType::f32)
    return fail(ErrorCode::invalid_argument, "RouterBalance: a layer's statistics of ", chosen_per_expert.size(),
                " experts and ", probs.describe(), " (expected ", experts_, " and f32[", experts_, "])");
  if (first_layer || !prob_sums_) {
    chosen_.assign(static_cast<std::size_t>(experts_), 0.0);
    COSHARD_TRY_ASSIGN(prob_sums_, ctx.zeros(Shape{experts_}, DataType::f32));
    rows_ = 0;
    loads_.clear();
    prob_gradient_ = {};  // (a pass without this loss's backward must not reuse the last one's)
  }
  double used = 0, largest = 0, total = 0;
  for (std::size_t e = 0; e < chosen_.size(); ++e) {
    chosen_[e] += chosen_per_expert[e];
    used += chosen_per_expert[e] > 0 ? 1 : 0;
    largest = std::max(largest, chosen_per_expert[e]);
    total += chosen_per_expert[e];
  }
  loads_.push_back({static_cast<std::int64_t>(used), total > 0 ? largest / total : 0.0,
                    std::vector<double>(chosen_per_expert.begin(), chosen_per_expert.end())});
  rows_ += tokens;
  return ctx.kernels().add(ctx.stream(), DataType::f32, prob_sums_.data(), probs.data(), prob_sums_.data(), experts_);
}

Result<Tensor> RouterBalance::loss(Context& ctx) {
  if (rows_ == 0 || !prob_sums_)
    return fail(ErrorCode::invalid_argument, "RouterAuxLoss: no mixture-of-experts layer ran in the model's forward");
  const double rows = static_cast<double>(rows_), E = static_cast<double>(experts_);
  std::vector<double> per_prob(chosen_.size());
  for (std::size_t e = 0; e < chosen_.size(); ++e) per_prob[e] = E * chosen_[e] / (rows * rows);
  gradient_factors_ = per_prob;
  for (double& f : gradient_factors_) f *= coef_;
  // loss = per_prob . P: [1, E] x [E, 1].
  COSHARD_TRY_ASSIGN(Tensor factors, upload_f32(ctx, per_prob));
  COSHARD_TRY_ASSIGN(Tensor out, ctx.empty(Shape{1}, DataType::f32));
  const detail::GemmArgs g{.m = 1, .n = 1, .k = experts_, .a = factors.data(), .lda = experts_, .b = prob_sums_.data(),
                           .ldb = 1, .c = out.data(), .ldc = 1};
  COSHARD_TRY(ctx.kernels().gemm(ctx.stream(), DataType::f32, g));
  return out;
}

Result<void> RouterBalance::set_seed(Context& ctx, const Tensor& seed) {
  prob_gradient_ = {};
  if (coef_ == 0 || gradient_factors_.empty()) return {};
  Tensor seed32 = seed;
  if (seed.dtype() != DataType::f32) {
    COSHARD_TRY_ASSIGN(seed32, ctx.empty(Shape{1}, DataType::f32));
    COSHARD_TRY(ctx.kernels().cast(ctx.stream(), seed.dtype(), seed.data(), DataType::f32, seed32.data(), 1));
  }
  // factors [E, 1] x seed [1, 1].
  COSHARD_TRY_ASSIGN(Tensor factors, upload_f32(ctx, gradient_factors_));
  COSHARD_TRY_ASSIGN(prob_gradient_, ctx.empty(Shape{experts_}, DataType::f32));
  const detail::GemmArgs g{.m = experts_, .n = 1, .k = 1, .a = factors.data(), .lda = 1, .b = seed32.data(), .ldb = 1,
                           .c = prob_gradient_.data(), .ldc = 1};
  return ctx.kernels().gemm(ctx.stream(), DataType::f32, g);
}

async::Task<Result<Tensor>> RouterAuxLoss::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(*inner_, std::move(input)));
  COSHARD_CO_TRY_ASSIGN(last_aux_, balance_->loss(ctx));
  COSHARD_CO_TRY(add_to_totals(ctx));
  if (balance_->coef() == 0) co_return value;
  const DataType dt = value.dtype();
  COSHARD_CO_TRY_ASSIGN(Tensor term, ctx.empty(Shape{1}, dt));
  if (dt == DataType::f32) {
    COSHARD_CO_TRY(ctx.stream().copy(term.data(), last_aux_.data(), 4));
  } else {
    COSHARD_CO_TRY(ctx.kernels().cast(ctx.stream(), DataType::f32, last_aux_.data(), dt, term.data(), 1));
  }
  COSHARD_CO_TRY(ctx.kernels().scale(ctx.stream(), dt, term.data(), static_cast<float>(balance_->coef()), 1));
  COSHARD_CO_TRY_ASSIGN(Tensor total, ctx.empty(value.shape(), dt));
  COSHARD_CO_TRY(ctx.kernels().add(ctx.stream(), dt, value.data(), term.data(), total.data(), 1));
  co_return total;
}

async::Task<Result<Tensor>> RouterAuxLoss::backward(Context& ctx, Tensor seed) {
  COSHARD_CO_TRY(balance_->set_seed(ctx, seed));
  co_return co_await ctx.backward(*inner_, std::move(seed));
}

Result<void> RouterAuxLoss::add_to_totals(Context& ctx) {
  const auto& loads = balance_->layer_loads();
  if (totals_.chosen.size() != loads.size()) totals_.chosen.assign(loads.size(), {});
  for (std::size_t l = 0; l < loads.size(); ++l) {
    auto& sum = totals_.chosen[l];
    if (sum.size() != loads[l].chosen.size()) sum.assign(loads[l].chosen.size(), 0.0);
    for (std::size_t e = 0; e < sum.size(); ++e) sum[e] += loads[l].chosen[e];
  }
  ++totals_.forwards;
  if (!totals_.aux_sum) {
    COSHARD_TRY_ASSIGN(totals_.aux_sum, ctx.zeros(Shape{1}, DataType::f32));
  }
  return ctx.kernels().add(ctx.stream(), DataType::f32, totals_.aux_sum.data(), last_aux_.data(), totals_.aux_sum.data(), 1);
}

void RouterAuxLoss::clear_saved() {
  inner_->clear_saved();
}

}  // namespace coshard::modules
