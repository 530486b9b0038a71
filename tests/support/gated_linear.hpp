// A module written the way a user writes one that runs on any device: the public ops only
// (coshard/modules/ops.hpp), no loop of its own. y = gelu(x W^T + b) * x, W [dim, dim], b [dim]
// (a gate on the input, in whatever dtype the model runs).
#pragma once

#include "coshard/modules/module.hpp"
#include "coshard/modules/ops.hpp"

namespace coshard::testing {

class GatedLinear final : public modules::Module {
 public:
  explicit GatedLinear(std::int64_t dim) : dim_(dim) {
    register_parameter("weight", modules::Shape{dim, dim}, modules::Init::normal(0.02));
    register_parameter("bias", modules::Shape{dim}, modules::Init::zeros());
  }
  std::string_view type_name() const override { return "GatedLinear"; }

  async::Task<Result<modules::Tensor>> forward(modules::Context& ctx, modules::Tensor x) override {
    namespace ops = modules::ops;
    COSHARD_CO_TRY_ASSIGN(modules::Tensor h, ops::matmul(ctx, x, weight().value(), {.trans_b = true}));
    COSHARD_CO_TRY(ops::add_bias(ctx, h, bias().value()));
    COSHARD_CO_TRY_ASSIGN(modules::Tensor g, ops::gelu(ctx, h));
    COSHARD_CO_TRY_ASSIGN(modules::Tensor y, ops::mul(ctx, g, x));
    input_ = std::move(x);
    pre_ = std::move(h);
    gate_ = std::move(g);
    co_return y;
  }

  // dL/dg = dy * x; dL/dx = dy * g + dh W with dh = gelu'(h) dL/dg; dW += dh^T x; db += sum_rows(dh).
  async::Task<Result<modules::Tensor>> backward(modules::Context& ctx, modules::Tensor dy) override {
    namespace ops = modules::ops;
    if (!input_) co_return fail(ErrorCode::invalid_argument, "GatedLinear: backward without a forward");
    COSHARD_CO_TRY_ASSIGN(modules::Tensor dg, ops::mul(ctx, dy, input_));
    COSHARD_CO_TRY_ASSIGN(modules::Tensor dh, ops::gelu_backward(ctx, pre_, dg));
    if (weight().grad())
      COSHARD_CO_TRY(ops::matmul_into(ctx, dh, input_, weight().grad(), {.trans_a = true, .beta = 1.0f}));
    if (bias().grad()) COSHARD_CO_TRY(ops::sum_rows_into(ctx, dh, bias().grad()));
    COSHARD_CO_TRY_ASSIGN(modules::Tensor dx, ops::mul(ctx, dy, gate_));
    COSHARD_CO_TRY(ops::matmul_into(ctx, dh, weight().value(), dx, {.beta = 1.0f}));
    clear_saved();
    co_return dx;
  }
  void clear_saved() override { input_ = pre_ = gate_ = {}; }

 private:
  modules::Parameter& weight() const { return *parameters()[0]; }
  modules::Parameter& bias() const { return *parameters()[1]; }
  std::int64_t dim_;
  modules::Tensor input_, pre_, gate_;
};

}  // namespace coshard::testing
