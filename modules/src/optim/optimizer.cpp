#include "coshard/modules/optimizer.hpp"

#include <cmath>
#include <cstring>
#include <map>
#include <tuple>
#include <vector>

#include "coshard/modules/parameter_store.hpp"

#include "kernels/kernels.hpp"

namespace coshard::modules {

using detail::StepState;

struct Optimizer::Impl {
  bool adam = true;
  detail::AdamArgs adam_args;
  detail::SgdArgs sgd_args;
  StepControlOptions control;
  detail::LossScaleArgs scale_args() const {
    return {.dynamic = control.loss_scaling == LossScaling::dynamic,
            .growth_factor = control.growth_factor,
            .backoff_factor = control.backoff_factor,
            .growth_interval = control.growth_interval};
  }
};

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

template <class Step>
Result<void> Optimizer::for_each_stepped_run(const Group& g, Step step) const {
  const std::int64_t n = g.grads.numel();
  // A stepped piece, cut where its elements' missed steps change.
  auto by_missed = [&](std::int64_t begin, std::int64_t end, const Segment& seg) -> Result<void> {
    for (const auto& r : g.steps_missed) {
      if (r.end <= begin) continue;
      if (r.begin >= end) break;
      if (r.begin > begin) COSHARD_TRY(step(begin, r.begin, seg, 0));
      COSHARD_TRY(step(std::max(begin, r.begin), std::min(end, r.end), seg, r.steps));
      begin = std::min(end, r.end);
    }
    if (begin < end) COSHARD_TRY(step(begin, end, seg, 0));
    return {};
  };
  // Each segment's elements less the skipped runs within it.
  auto stepped = [&](std::int64_t begin, std::int64_t end, const Segment& seg) -> Result<void> {
    for (const auto& [b, e] : g.skipped_runs) {
      if (e <= begin) continue;
      if (b >= end) break;
      if (b > begin) COSHARD_TRY(by_missed(begin, b, seg));
      begin = std::max(begin, e);
    }
    if (begin < end) COSHARD_TRY(by_missed(begin, end, seg));
    return {};
  };
  if (g.segments.empty()) return stepped(0, n, default_settings());
  for (const auto& seg : g.segments)
    if (!seg.frozen) COSHARD_TRY(stepped(seg.begin, seg.end, seg));
  return {};
}

Result<void> Optimizer::set_group_in_norm(std::size_t i, bool counted) {
  if (i >= groups_.size())
    return fail(ErrorCode::out_of_range, "Optimizer::set_group_in_norm(", i, "): ", groups_.size(), " groups");
  groups_[i].in_norm = counted;
  return {};
}

ParameterGroup ParameterGroup::by_name(std::string pattern, std::optional<float> weight_decay, float lr_scale) {
  ParameterGroup g;
  g.name = pattern;
  g.matches = [pattern = std::move(pattern)](std::string_view full_name, const Parameter&) {
    return glob_matches(pattern, full_name);
  };
  g.weight_decay = weight_decay;
  g.lr_scale = lr_scale;
  return g;
}

ParameterGroup ParameterGroup::no_decay_for_vectors() {
  ParameterGroup g;
  g.name = "no decay for vectors";
  g.matches = [](std::string_view, const Parameter& p) { return p.shape().rank() <= 1; };
  g.weight_decay = 0.0f;
  return g;
}

Result<void> Optimizer::set_parameter_groups(std::vector<ParameterGroup> rules) {
  if (!groups_.empty())
    return fail(ErrorCode::invalid_argument, "Optimizer::set_parameter_groups: ", groups_.size(),
                " groups are added already (set the rules before building a ParameterStore's group or an engine)");
  for (const auto& r : rules) {
    if (!r.matches) return fail(ErrorCode::invalid_argument, "parameter group '", r.name, "': no predicate (matches)");
    if (r.weight_decay && !(*r.weight_decay >= 0 && std::isfinite(*r.weight_decay)))
      return fail(ErrorCode::invalid_argument, "parameter group '", r.name, "': weight_decay=", *r.weight_decay,
                  ", expected a finite value >= 0");
    if (!(r.lr_scale >= 0 && std::isfinite(r.lr_scale)))
      return fail(ErrorCode::invalid_argument, "parameter group '", r.name, "': lr_scale=", r.lr_scale,
                  ", expected a finite value >= 0");
    if (!impl_->adam && (r.beta1 || r.beta2 || r.eps))
      return fail(ErrorCode::invalid_argument, "parameter group '", r.name,
                  "': beta1, beta2 and eps are AdamW's settings (this optimizer is SGD)");
    for (const auto& [what, beta] : {std::pair{"beta1", r.beta1}, std::pair{"beta2", r.beta2}})
      if (beta && !(*beta >= 0 && *beta < 1))
        return fail(ErrorCode::invalid_argument, "parameter group '", r.name, "': ", what, "=", *beta,
                    ", expected 0 <= beta < 1");
    if (r.eps && !(*r.eps > 0 && std::isfinite(*r.eps)))
      return fail(ErrorCode::invalid_argument, "parameter group '", r.name, "': eps=", *r.eps,
                  ", expected a finite value > 0");
  }
  rules_ = std::move(rules);
  return {};
}

Optimizer::Segment Optimizer::default_settings() const noexcept {
  Segment seg;
  seg.weight_decay = impl_->adam ? impl_->adam_args.weight_decay : impl_->sgd_args.weight_decay;
  if (impl_->adam) {
    seg.beta1 = impl_->adam_args.beta1;
    seg.beta2 = impl_->adam_args.beta2;
    seg.eps = impl_->adam_args.eps;
  }
  return seg;
}

Optimizer::Segment Optimizer::settings_for(std::string_view full_name, const Parameter& parameter) const {
  Segment seg = default_settings();
  if (!parameter.trainable()) {
    seg.frozen = true;
    return seg;
  }
  for (const auto& r : rules_) {
    if (!r.matches(full_name, parameter)) continue;
    if (r.weight_decay) seg.weight_decay = *r.weight_decay;
    seg.lr_scale = r.lr_scale;
    if (r.beta1) seg.beta1 = *r.beta1;
    if (r.beta2) seg.beta2 = *r.beta2;
    if (r.eps) seg.eps = *r.eps;
    break;
  }
  return seg;
}

Result<std::vector<Optimizer::Segment>> Optimizer::normalized(std::vector<Segment> segments, std::int64_t n) const {
  const Segment plain = default_settings();
  std::vector<Segment> runs;
  std::int64_t at = 0;
  auto append = [&](Segment seg) {
    if (seg.begin == seg.end) return;
    if (!runs.empty() && runs.back().same_settings(seg)) {
      runs.back().end = seg.end;
      return;
    }
    runs.push_back(seg);
  };
  for (const auto& seg : segments) {
    if (seg.begin < at || seg.end < seg.begin || seg.end > n)
      return fail(ErrorCode::invalid_argument, "Optimizer: segment [", seg.begin, ", ", seg.end,
                  ") overlaps the one before or leaves the group's ", n, " elements (expected sorted runs within it)");
    Segment gap = plain;
    gap.begin = at;
    gap.end = seg.begin;
    append(gap);
    append(seg);
    at = seg.end;
  }
  Segment tail = plain;
  tail.begin = at;
  tail.end = n;
  append(tail);
  // One run of the optimizer's own settings is no segment: the group steps as it always did.
  if (runs.size() == 1 && runs.front().same_settings(plain)) runs.clear();
  return runs;
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

std::string_view Optimizer::name() const noexcept { return impl_->adam ? "adamw" : "sgd"; }

std::size_t Optimizer::state_tensors() const noexcept {
  if (impl_->adam) return 2;
  return impl_->sgd_args.momentum != 0 ? 1 : 0;
}

Result<void> Optimizer::apply_group(Context& ctx, std::size_t i, float lr, Tensor master, Tensor state1, Tensor state2,
                                    Tensor params_out) {
  if (i < groups_.size() && !groups_[i].frozen && master && master.numel() != groups_[i].grads.numel())
    return fail(ErrorCode::invalid_argument, "Optimizer::apply_group(", i, "): master and ", state_tensors(),
                " state tensors of f32[", groups_[i].grads.numel(), "] expected");
  return apply_group_range(ctx, i, 0, lr, std::move(master), std::move(state1), std::move(state2), std::move(params_out));
}

Result<void> Optimizer::apply_group_range(Context& ctx, std::size_t i, std::int64_t begin, float lr, Tensor master,
                                          Tensor state1, Tensor state2, Tensor params_out, Tensor grads) {
  if (i >= groups_.size()) return fail(ErrorCode::out_of_range, "Optimizer::apply_group(", i, "): ", groups_.size(), " groups");
  if (!(lr >= 0)) return fail(ErrorCode::invalid_argument, "lr=", lr, ": expected >= 0");
  const Group& g = groups_[i];
  if (g.frozen) return {};  // nothing to step, nothing given
  const std::int64_t total = g.grads.numel();
  const std::int64_t n = master ? master.numel() : total;
  if (master && (begin < 0 || n <= 0 || begin + n > total))
    return fail(ErrorCode::invalid_argument, "Optimizer::apply_group(", i, "): elements [", begin, ", ", begin + n,
                ") of a group of ", total, ": expected a non-empty range within it");
  auto fits = [&](const Tensor& t) { return t && t.dtype() == DataType::f32 && t.numel() == n; };
  if (!fits(master) || (state_tensors() >= 1 && !fits(state1)) || (state_tensors() >= 2 && !fits(state2)))
    return fail(ErrorCode::invalid_argument, "Optimizer::apply_group(", i, "): master and ", state_tensors(),
                " state tensors of f32[", n, "] expected");
  if (params_out && (params_out.numel() != n || !(params_out.device() == ctx.device())))
    return fail(ErrorCode::invalid_argument, "Optimizer::apply_group(", i, "): params_out ", params_out.describe(),
                ": expected ", n, " elements on ", ctx.device().to_string());
  if (grads ? !fits(grads) || !(grads.device() == ctx.device()) : !g.grads.data())
    return fail(ErrorCode::invalid_argument, "Optimizer::apply_group(", i, "): grads ",
                grads ? grads.describe() : std::string("none"), ": expected f32[", n, "] on ", ctx.device().to_string(),
                grads ? "" : " (the group was added without gradients)");
  const DataType pdt = params_out ? params_out.dtype() : DataType::f32;
  return update(ctx, g, begin, n, lr, master.data_as<float>(), state1 ? state1.data_as<float>() : nullptr,
                state2 ? state2.data_as<float>() : nullptr, pdt, params_out ? params_out.data() : nullptr,
                grads ? grads.data_as<float>() : nullptr);
}

Result<void> Optimizer::update(Context& ctx, const Group& g, std::int64_t first, std::int64_t count, float lr,
                               float* master, float* state1, float* state2, DataType pdt, void* params_out,
                               const float* own_grads) const {
  if (g.skipped || g.frozen) return {};
  const auto& k = ctx.kernels();
  auto* st = state_.data_as<StepState>();
  const DataType gdt = own_grads ? DataType::f32 : g.grads.dtype();
  auto* grads = static_cast<const std::byte*>(g.grads.data());
  auto* out = static_cast<std::byte*>(params_out);
  const std::int64_t last = first + count;
  // One launch over elements [begin, end) with `seg`'s settings, cut to [first, last) (the kernels
  // are element-wise: a run steps each element exactly as a launch over the whole group would).
  auto run = [&](std::int64_t begin, std::int64_t end, const Segment& seg, std::int32_t missed) -> Result<void> {
    begin = std::max(begin, first);
    end = std::min(end, last);
    if (begin >= end) return {};
    const auto at = static_cast<std::size_t>(begin);
    const auto local = static_cast<std::size_t>(begin - first);
    const std::int64_t n = end - begin;
    const void* gi = own_grads ? static_cast<const void*>(own_grads + local) : grads + at * size_of(gdt);
    void* oi = out ? out + local * size_of(pdt) : nullptr;
    if (impl_->adam) {
      detail::AdamArgs a = impl_->adam_args;
      a.lr = lr * seg.lr_scale;
      a.weight_decay = seg.weight_decay;
      a.beta1 = seg.beta1;
      a.beta2 = seg.beta2;
      a.eps = seg.eps;
      a.steps_missed = missed;
      return k.adamw(ctx.stream(), master + local, gdt, gi, state1 + local, state2 + local, pdt, oi, n, a, st);
    }
    detail::SgdArgs a = impl_->sgd_args;
    a.lr = lr * seg.lr_scale;
    a.weight_decay = seg.weight_decay;
    return k.sgd(ctx.stream(), master + local, gdt, gi, state1 ? state1 + local : nullptr, pdt, oi, n, a, st);
  };
  return for_each_stepped_run(g, run);
}

Result<void> Optimizer::finish_step(Context& ctx) {
  if (!state_) return fail(ErrorCode::invalid_argument, "Optimizer: no parameter groups (call add_group)");
  return ctx.kernels().step_end(ctx.stream(), state_.data_as<StepState>(), impl_->scale_args());
}

Result<void> Optimizer::reset_masters(Context& ctx) {
  for (const auto& g : groups_)
    if (g.params && g.master && g.params.dtype() != DataType::f32)
      COSHARD_TRY(ctx.kernels().cast(ctx.stream(), g.params.dtype(), g.params.data(), DataType::f32, g.master.data(),
                                     g.params.numel()));
  return {};
}

Tensor Optimizer::loss_scale() const noexcept { return state_ ? state_.slice(2, Shape{1}) : Tensor{}; }
Tensor Optimizer::grad_stats() const noexcept { return state_ ? state_.slice(0, Shape{2}) : Tensor{}; }

// Every group's gradients in one multi-tensor call (the CPU adds them in group order as before).
Result<void> Optimizer::compute_grad_stats(Context& ctx) {
  COSHARD_TRY(begin_grad_stats(ctx));
  std::vector<detail::OptimizerTensor> tensors;
  tensors.reserve(groups_.size());
  for (const Group& g : groups_) {
    if (g.frozen || !g.in_norm) continue;
    if (!g.grads.data())
      return fail(ErrorCode::invalid_argument, "Optimizer::compute_grad_stats: a group added without gradients (give "
                  "them with each piece: add_grad_stats)");
    tensors.push_back({.grad = g.grads.data(), .n = g.grads.numel(), .gdt = static_cast<std::int32_t>(g.grads.dtype())});
  }
  return ctx.kernels().grad_stats_multi(ctx.stream(), tensors, state_.data_as<StepState>());
}

Result<void> Optimizer::begin_grad_stats(Context& ctx) {
  if (groups_.empty()) return fail(ErrorCode::invalid_argument, "Optimizer: no parameter groups (call add_group)");
  return ctx.kernels().step_begin(ctx.stream(), state_.data_as<StepState>());
}

Result<void> Optimizer::add_grad_stats(Context& ctx, std::size_t i) {
  if (i >= groups_.size()) return fail(ErrorCode::out_of_range, "Optimizer::add_grad_stats(", i, "): ", groups_.size(), " groups");
  const Group& g = groups_[i];
  if (g.frozen || !g.in_norm) return {};
  if (!g.grads.data())
    return fail(ErrorCode::invalid_argument, "Optimizer::add_grad_stats(", i, "): the group was added without gradients: "
                "give them with each piece");
  return ctx.kernels().grad_stats(ctx.stream(), g.grads.dtype(), g.grads.data(), g.grads.numel(),
                                  state_.data_as<StepState>());
}

Result<void> Optimizer::add_grad_stats(Context& ctx, std::size_t i, const Tensor& grads) {
  if (i >= groups_.size()) return fail(ErrorCode::out_of_range, "Optimizer::add_grad_stats(", i, "): ", groups_.size(), " groups");
  const Group& g = groups_[i];
  if (g.frozen || !g.in_norm) return {};
  if (!grads || grads.dtype() != DataType::f32 || grads.numel() > g.grads.numel() || !(grads.device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, "Optimizer::add_grad_stats(", i, "): grads ", grads ? grads.describe() : "empty",
                ": expected f32, at most ", g.grads.numel(), " elements, on ", ctx.device().to_string());
  return ctx.kernels().grad_stats(ctx.stream(), DataType::f32, grads.data(), grads.numel(), state_.data_as<StepState>());
}

Result<void> Optimizer::apply_one(Context& ctx, std::size_t i, float lr) {
  if (i >= groups_.size()) return fail(ErrorCode::out_of_range, "Optimizer::apply_one(", i, "): ", groups_.size(), " groups");
  if (!(lr >= 0)) return fail(ErrorCode::invalid_argument, "lr=", lr, ": expected >= 0");
  const Group& g = groups_[i];
  if (g.frozen) return {};
  if (!g.params)
    return fail(ErrorCode::invalid_argument, "Optimizer::apply: swapped groups are stepped with apply_group and finish_step");
  const bool cast_back = g.params.dtype() != DataType::f32;
  return update(ctx, g, 0, g.params.numel(), lr, g.master.data_as<float>(), g.state1 ? g.state1.data_as<float>() : nullptr,
                g.state2 ? g.state2.data_as<float>() : nullptr, g.params.dtype(), cast_back ? g.params.data() : nullptr);
}

const StepControlOptions& Optimizer::control() const noexcept { return impl_->control; }

Result<void> Optimizer::apply(Context& ctx, float lr) {
  if (groups_.empty()) return fail(ErrorCode::invalid_argument, "Optimizer: no parameter groups (call add_group)");
  if (!(lr >= 0)) return fail(ErrorCode::invalid_argument, "lr=", lr, ": expected >= 0");
  for (const auto& g : groups_)
    if (!g.params && !g.frozen)
      return fail(ErrorCode::invalid_argument, "Optimizer::apply: swapped groups are stepped with apply_group and finish_step");
  if (impl_->adam) {
    // One multi-tensor AdamW per distinct setting (one launch a bucket of tensors on CUDA): every
    // group of the optimizer's own settings in one, each other setting's runs in another.
    using Setting = std::tuple<float, float, float, float, float, std::int32_t>;  // lr scale, decay, beta1, beta2, eps, missed
    std::map<Setting, std::vector<detail::OptimizerTensor>> by_setting;
    for (const Group& g : groups_) {
      if (g.skipped || g.frozen) continue;
      const bool cast_back = g.params.dtype() != DataType::f32;
      const std::size_t gsize = size_of(g.grads.dtype()), psize = size_of(g.params.dtype());
      auto add = [&](std::int64_t begin, std::int64_t end, const Segment& seg, std::int32_t missed) -> Result<void> {
        const auto at = static_cast<std::size_t>(begin);
        by_setting[{seg.lr_scale, seg.weight_decay, seg.beta1, seg.beta2, seg.eps, missed}].push_back(
            {.master = g.master.data_as<float>() + at,
             .grad = static_cast<const std::byte*>(g.grads.data()) + at * gsize,
             .state1 = g.state1.data_as<float>() + at,
             .state2 = g.state2.data_as<float>() + at,
             .param_out = cast_back ? static_cast<std::byte*>(g.params.data()) + at * psize : nullptr,
             .n = end - begin,
             .gdt = static_cast<std::int32_t>(g.grads.dtype()),
             .pdt = static_cast<std::int32_t>(g.params.dtype())});
        return {};
      };
      COSHARD_TRY(for_each_stepped_run(g, add));
    }
    for (const auto& [setting, tensors] : by_setting) {
      detail::AdamArgs a = impl_->adam_args;
      a.lr = lr * std::get<0>(setting);
      a.weight_decay = std::get<1>(setting);
      a.beta1 = std::get<2>(setting);
      a.beta2 = std::get<3>(setting);
      a.eps = std::get<4>(setting);
      a.steps_missed = std::get<5>(setting);
      COSHARD_TRY(ctx.kernels().adamw_multi(ctx.stream(), tensors, a, state_.data_as<StepState>()));
    }
  } else {
    for (std::size_t i = 0; i < groups_.size(); ++i) COSHARD_TRY(apply_one(ctx, i, lr));
  }
  return finish_step(ctx);
}

Result<void> Optimizer::step(Context& ctx, float lr) {
  COSHARD_TRY(compute_grad_stats(ctx));
  return apply(ctx, lr);
}

async::Task<Result<OptimizerStats>> Optimizer::read_stats(Context& ctx) {
  if (!state_) co_return OptimizerStats{};
  COSHARD_CO_TRY_ASSIGN(auto bytes, co_await ctx.read_bytes(state_));
  StepState st;
  std::memcpy(&st, bytes.data(), sizeof st);
  OptimizerStats stats;
  stats.steps = st.step;
  stats.skipped_steps = st.skipped_steps;
  stats.loss_scale = st.loss_scale;
  stats.grad_norm = st.last_grad_norm;
  stats.last_skipped = st.last_skipped != 0;
  co_return stats;
}

}  // namespace coshard::modules
