// Parameter groups (PyTorch's param_groups): the rules, by name or predicate, that give each
// parameter its weight decay, learning-rate scale and AdamW moments, and the segments of a
// group's elements they become.
#include "coshard/modules/optimizer.hpp"

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "optim/optimizer_impl.hpp"

namespace coshard::modules {

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

}  // namespace coshard::modules
