// A small regression model for tests of any model and loss: an MLP with a module of the tests'
// own between two Linear layers (ScaleShift, CPU only; or, for any device, GatedLinear, written
// with the public ops), float features in and float targets out, and a
// deterministic global batch per step (features in [-1, 1], targets a smooth function of them).
#pragma once

#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "coshard/modules/layers.hpp"
#include "gated_linear.hpp"
#include "scale_shift.hpp"

namespace coshard::testing {

constexpr std::int64_t kMlpRows = 12, kMlpFeatures = 6, kMlpHidden = 32, kMlpOutputs = 2;

enum class OwnModule { scale_shift, gated_linear };

inline Result<std::unique_ptr<modules::Sequential>> make_regression_mlp(OwnModule own = OwnModule::scale_shift) {
  auto mlp = std::make_unique<modules::Sequential>();
  mlp->add("fc1", std::make_unique<modules::Linear>(kMlpFeatures, kMlpHidden, true, modules::Init::normal(0.3)));
  if (own == OwnModule::scale_shift)
    mlp->add("affine", std::make_unique<ScaleShift<float>>(kMlpHidden));
  else
    mlp->add("gate", std::make_unique<GatedLinear>(kMlpHidden));
  mlp->add("act", std::make_unique<modules::Gelu>());
  mlp->add("fc2", std::make_unique<modules::Linear>(kMlpHidden, kMlpOutputs, true, modules::Init::normal(0.3)));
  return mlp;
}

// Step `step`'s global batch of kMlpRows rows.
inline std::pair<std::vector<float>, std::vector<float>> regression_batch(int step) {
  std::vector<float> x(kMlpRows * kMlpFeatures), y(kMlpRows * kMlpOutputs);
  for (std::size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(std::sin(0.37 * static_cast<double>(i) + step));
  for (std::int64_t r = 0; r < kMlpRows; ++r) {
    double sum = 0;
    for (std::int64_t f = 0; f < kMlpFeatures; ++f) sum += x[static_cast<std::size_t>(r * kMlpFeatures + f)] * (f + 1) * 0.2;
    y[static_cast<std::size_t>(r * kMlpOutputs)] = static_cast<float>(std::tanh(sum));
    y[static_cast<std::size_t>(r * kMlpOutputs + 1)] = static_cast<float>(0.5 * std::cos(sum));
  }
  return {x, y};
}

// Rows [first, first + count) of the step's batch, uploaded.
inline Result<modules::Batch> regression_rows(modules::Context& ctx, int step, std::int64_t first, std::int64_t count) {
  const auto [x, y] = regression_batch(step);
  auto part = [&](const std::vector<float>& v, std::int64_t width) {
    return ctx.upload(std::as_bytes(std::span<const float>(v).subspan(static_cast<std::size_t>(first * width),
                                                                     static_cast<std::size_t>(count * width))),
                      modules::Shape{count, width}, modules::DataType::f32);
  };
  COSHARD_TRY_ASSIGN(modules::Tensor inputs, part(x, kMlpFeatures));
  COSHARD_TRY_ASSIGN(modules::Tensor targets, part(y, kMlpOutputs));
  return modules::Batch{inputs, targets};
}

}  // namespace coshard::testing
