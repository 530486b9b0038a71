// Making an optimizer (AdamW, SGD) and its groups: each group a flat run of parameters with its
// gradients, fp32 master and state, its segments' settings, and the runs a step leaves out
// (frozen, skipped, missing steps). The rules that pick the settings are parameter_groups.cpp's,
// the step optimizer_step.cpp's.
#include "coshard/modules/optimizer.hpp"

#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "coshard/modules/parameter_store.hpp"

#include "kernels/kernels.hpp"


#include "optim/optimizer_impl.hpp"

namespace coshard::modules {

using detail::StepState;


namespace {

Result<void> check_control(const StepControlOptions& c) {
  if (!(c.max_grad_norm >= 0))
    return fail(ErrorCode::invalid_argument, "max_grad_norm=", c.max_grad_norm, ": expected >= 0 (0: no clipping)");
  if (c.loss_scaling != LossScaling::none && !(c.initial_loss_scale > 0))
    return fail(ErrorCode::invalid_argument, "initial_loss_scale=", c.initial_loss_scale, ": expected > 0");
  if (c.loss_scaling == LossScaling::dynamic) {
    if (!(c.growth_factor > 1))
      return fail(ErrorCode::invalid_argument, "growth_factor=", c.growth_factor, ": expected > 1");
    if (!(c.backoff_factor > 0 && c.backoff_factor < 1))
      return fail(ErrorCode::invalid_argument, "backoff_factor=", c.backoff_factor, ": expected in (0, 1)");
    if (c.growth_interval < 1)
      return fail(ErrorCode::invalid_argument, "growth_interval=", c.growth_interval, ": expected >= 1");
  }
  return {};
}

}  // namespace

Optimizer::Optimizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Optimizer::~Optimizer() = default;

Result<std::unique_ptr<Optimizer>> Optimizer::empty_like() const {
  auto twin = std::unique_ptr<Optimizer>(new Optimizer(std::make_unique<Impl>(*impl_)));
  twin->rules_ = rules_;
  return twin;
}

Result<std::unique_ptr<Optimizer>> Optimizer::adamw(AdamWOptions o, StepControlOptions control) {
  if (!(o.beta1 >= 0 && o.beta1 < 1)) return fail(ErrorCode::invalid_argument, "beta1=", o.beta1, ": expected in [0, 1)");
  if (!(o.beta2 >= 0 && o.beta2 < 1)) return fail(ErrorCode::invalid_argument, "beta2=", o.beta2, ": expected in [0, 1)");
  if (!(o.eps > 0) || !std::isfinite(o.eps))
    return fail(ErrorCode::invalid_argument, "eps=", o.eps, ": expected > 0 and finite (an infinite one stops every update)");
  if (!(o.weight_decay >= 0))
    return fail(ErrorCode::invalid_argument, "weight_decay=", o.weight_decay, ": expected >= 0");
  COSHARD_TRY(check_control(control));
  auto impl = std::make_unique<Impl>();
  impl->adam = true;
  impl->adam_args = {.beta1 = o.beta1, .beta2 = o.beta2, .eps = o.eps, .weight_decay = o.weight_decay,
                     .max_grad_norm = control.max_grad_norm};
  impl->control = control;
  return std::unique_ptr<Optimizer>(new Optimizer(std::move(impl)));
}

Result<std::unique_ptr<Optimizer>> Optimizer::sgd(SgdOptions o, StepControlOptions control) {
  if (!(o.momentum >= 0 && o.momentum < 1))
    return fail(ErrorCode::invalid_argument, "momentum=", o.momentum, ": expected in [0, 1)");
  if (!(o.weight_decay >= 0))
    return fail(ErrorCode::invalid_argument, "weight_decay=", o.weight_decay, ": expected >= 0");
  if (o.nesterov && o.momentum == 0)
    return fail(ErrorCode::invalid_argument, "nesterov=true needs momentum > 0 (momentum=0)");
  COSHARD_TRY(check_control(control));
  auto impl = std::make_unique<Impl>();
  impl->adam = false;
  impl->sgd_args = {.momentum = o.momentum, .weight_decay = o.weight_decay, .nesterov = o.nesterov,
                    .max_grad_norm = control.max_grad_norm};
  impl->control = control;
  return std::unique_ptr<Optimizer>(new Optimizer(std::move(impl)));
}

Result<void> Optimizer::ensure_state(Context& ctx) {
  if (state_) return {};
  StepState initial;
  initial.loss_scale = impl_->control.loss_scaling == LossScaling::none ? 1.0f : impl_->control.initial_loss_scale;
  std::span<const std::byte> bytes(reinterpret_cast<const std::byte*>(&initial), sizeof initial);
  COSHARD_TRY_ASSIGN(state_, ctx.upload(bytes, Shape{8}, DataType::f32));
  return {};
}

Result<void> Optimizer::add_group(Context& ctx, Tensor params, Tensor grads, std::vector<Segment> segments,
                                  AllFrozen all_frozen) {
  if (!params || !grads || !(params.shape() == grads.shape()))
    return fail(ErrorCode::invalid_argument, "Optimizer: params ", params ? params.describe() : "empty",
                " and grads ", grads ? grads.describe() : "empty", " must have one shape");
  if (!(params.device() == ctx.device()) || !(grads.device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, "Optimizer: params ", params.describe(), " and grads ", grads.describe(),
                " must be on the context's device ", ctx.device().to_string());
  const auto& k = ctx.kernels();
  const DataType pdt = params.dtype();
  if (pdt != DataType::f32 && pdt != DataType::bf16 && pdt != DataType::f16)
    return fail(ErrorCode::unsupported, "Optimizer: parameters are ", async::to_string(pdt),
                "; the optimizers keep fp32 master weights for f32, bf16 or f16 parameters");
  COSHARD_TRY(detail::check_supported(k, pdt, ctx.device(), "Optimizer"));
  COSHARD_TRY(detail::check_supported(k, grads.dtype(), ctx.device(), "Optimizer"));
  COSHARD_TRY_ASSIGN(auto runs, normalized(std::move(segments), params.numel()));
  if (runs.size() == 1 && runs.front().frozen && all_frozen == AllFrozen::hold_nothing) {  // no master, no state
    COSHARD_TRY(add_frozen_group(ctx, params.numel()));
    groups_.back().params = params;
    return {};
  }
  COSHARD_TRY(ensure_state(ctx));
  Group g{params, grads, {}, {}, {}, std::move(runs), false};
  const Shape flat{params.numel()};
  if (pdt == DataType::f32) {
    g.master = params.view(flat);
  } else {
    COSHARD_TRY_ASSIGN(g.master, ctx.empty(flat, DataType::f32));
    COSHARD_TRY(k.cast(ctx.stream(), pdt, params.data(), DataType::f32, g.master.data(), params.numel()));
  }
  if (impl_->adam || impl_->sgd_args.momentum != 0) {
    COSHARD_TRY_ASSIGN(g.state1, ctx.zeros(flat, DataType::f32));
  }
  if (impl_->adam) {
    COSHARD_TRY_ASSIGN(g.state2, ctx.zeros(flat, DataType::f32));
  }
  groups_.push_back(std::move(g));
  return {};
}

Result<void> Optimizer::add_frozen_group(Context& ctx, std::int64_t numel) {
  if (numel < 0) return fail(ErrorCode::invalid_argument, "Optimizer::add_frozen_group: numel=", numel, ", expected >= 0");
  COSHARD_TRY(ensure_state(ctx));  // (the step figures exist even when nothing trains)
  Segment all = default_settings();
  all.frozen = true;
  all.end = numel;
  Group g;
  g.segments.push_back(all);
  g.frozen = true;
  groups_.push_back(std::move(g));
  return {};
}

Result<void> Optimizer::add_group(Context& ctx, const ParameterStore& store) {
  std::vector<Segment> segments;
  for (const auto& e : store.entries()) {
    Segment seg = settings_for(e.name, *e.parameter);
    seg.begin = e.offset;
    seg.end = e.offset + e.parameter->numel();
    segments.push_back(seg);
  }
  return add_group(ctx, store.values(), store.grads(), std::move(segments));
}

Result<void> Optimizer::set_group_skipped(std::size_t i, bool skipped) {
  if (i >= groups_.size())
    return fail(ErrorCode::out_of_range, "Optimizer::set_group_skipped(", i, "): ", groups_.size(), " groups");
  groups_[i].skipped = skipped;
  return {};
}

namespace {

// The first of `runs` (each [begin, end) as `bounds` gives it) that is empty, out of order, touches
// the one before, or passes n elements; null when they are all sorted and apart within n.
template <class Run, class Bounds>
const Run* first_bad_run(const std::vector<Run>& runs, std::int64_t n, Bounds bounds) {
  std::int64_t end = 0;
  for (const Run& r : runs) {
    const auto [b, e] = bounds(r);
    if (b < end || e <= b || e > n) return &r;
    end = e;
  }
  return nullptr;
}

}  // namespace

Result<void> Optimizer::set_group_skipped_runs(std::size_t i, std::vector<std::pair<std::int64_t, std::int64_t>> runs) {
  if (i >= groups_.size())
    return fail(ErrorCode::out_of_range, "Optimizer::set_group_skipped_runs(", i, "): ", groups_.size(), " groups");
  // (a swapped group's gradients may be a shape over no data: its size all the same)
  const std::int64_t n = groups_[i].frozen ? 0 : groups_[i].grads.numel();
  if (const auto* bad = first_bad_run(runs, n, [](const auto& r) { return r; }))
    return fail(ErrorCode::invalid_argument, "Optimizer::set_group_skipped_runs(", i, "): run [", bad->first, ", ",
                bad->second, "): expected sorted, non-empty runs apart from each other within the group's ", n,
                " elements");
  groups_[i].skipped_runs = std::move(runs);
  return {};
}

Result<void> Optimizer::set_group_steps_missed(std::size_t i, std::vector<MissedSteps> runs) {
  if (i >= groups_.size())
    return fail(ErrorCode::out_of_range, "Optimizer::set_group_steps_missed(", i, "): ", groups_.size(), " groups");
  const std::int64_t n = groups_[i].frozen ? 0 : groups_[i].grads.numel();
  const auto* bad = first_bad_run(runs, n, [](const MissedSteps& r) { return std::pair{r.begin, r.end}; });
  if (!bad)
    for (const auto& r : runs)
      if (r.steps < 0) bad = &r;
  if (bad)
    return fail(ErrorCode::invalid_argument, "Optimizer::set_group_steps_missed(", i, "): run [", bad->begin, ", ",
                bad->end, ") of ", bad->steps, " steps: expected sorted, non-empty runs apart from each other within "
                "the group's ", n, " elements, and steps >= 0");
  groups_[i].steps_missed = std::move(runs);
  return {};
}


Result<void> Optimizer::set_group_in_norm(std::size_t i, bool counted) {
  if (i >= groups_.size())
    return fail(ErrorCode::out_of_range, "Optimizer::set_group_in_norm(", i, "): ", groups_.size(), " groups");
  groups_[i].in_norm = counted;
  return {};
}

void Optimizer::drop_groups_from(std::size_t first) noexcept {
  if (first < groups_.size()) groups_.resize(first);
  if (groups_.empty()) state_ = {};
}

Result<void> Optimizer::add_swapped_group(Context& ctx, Tensor grads, std::vector<Segment> segments) {
  if (!grads || grads.dtype() != DataType::f32 || !(grads.device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, "Optimizer::add_swapped_group: grads ", grads ? grads.describe() : "empty",
                ": expected f32 on ", ctx.device().to_string());
  COSHARD_TRY_ASSIGN(auto runs, normalized(std::move(segments), grads.numel()));
  COSHARD_TRY(ensure_state(ctx));
  groups_.push_back(Group{{}, grads, {}, {}, {}, std::move(runs), false});
  return {};
}

Result<void> Optimizer::add_swapped_group(Context& ctx, std::int64_t numel, std::vector<Segment> segments) {
  if (numel <= 0) return fail(ErrorCode::invalid_argument, "Optimizer::add_swapped_group: numel=", numel, ": expected > 0");
  COSHARD_TRY_ASSIGN(auto runs, normalized(std::move(segments), numel));
  COSHARD_TRY(ensure_state(ctx));
  // (no gradient memory: a shape over no data, so every size reads as the group's)
  groups_.push_back(Group{{}, Tensor(nullptr, Shape{numel}, DataType::f32, ctx.device()), {}, {}, {}, std::move(runs), false});
  return {};
}

}  // namespace coshard::modules
