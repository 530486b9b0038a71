// The optimizer's step: the gradients' norm and overflow flag, the update of every group (or of
// one, or of a piece: offloaded and swapped steps), the loss scale's step, and the stats read back.
// Every decision lives on the device: a step enqueues and never waits.
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
