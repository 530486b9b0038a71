// A module written the way a user writes one, with the public API only: parameters registered
// in the constructor, forward/backward enqueue their loops on the context's stream (CPU) and
// keep the input for backward. y = x * scale + shift, per feature, in T (double or float).
#pragma once

#include "coshard/modules/module.hpp"

namespace coshard::testing {

template <class T>
class ScaleShift final : public modules::Module {
 public:
  explicit ScaleShift(std::int64_t dim) : dim_(dim) {
    register_parameter("scale", modules::Shape{dim}, modules::Init::ones());
    register_parameter("shift", modules::Shape{dim}, modules::Init::zeros());
  }
  std::string_view type_name() const override { return "ScaleShift"; }
  async::Task<Result<modules::Tensor>> forward(modules::Context& ctx, modules::Tensor x) override {
    if (x.dtype() != kDtype || x.shape().back() != dim_)
      co_return fail(ErrorCode::invalid_argument, "ScaleShift: input ", x.describe());
    COSHARD_CO_TRY_ASSIGN(modules::Tensor y, ctx.empty(x.shape(), x.dtype()));
    const T* in = x.data_as<T>();
    const T* a = parameters()[0]->value().template data_as<T>();
    const T* b = parameters()[1]->value().template data_as<T>();
    T* out = y.data_as<T>();
    const std::int64_t rows = x.shape().rows(), dim = dim_;
    COSHARD_CO_TRY(ctx.stream().launch([=] {
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < dim; ++c) out[r * dim + c] = in[r * dim + c] * a[c] + b[c];
    }));
    input_ = std::move(x);
    co_return y;
  }
  async::Task<Result<modules::Tensor>> backward(modules::Context& ctx, modules::Tensor dy) override {
    COSHARD_CO_TRY_ASSIGN(modules::Tensor dx, ctx.empty(input_.shape(), input_.dtype()));
    const T* in = input_.data_as<T>();
    const T* g = dy.data_as<T>();
    const T* a = parameters()[0]->value().template data_as<T>();
    T* da = parameters()[0]->grad().template data_as<T>();
    T* db = parameters()[1]->grad().template data_as<T>();
    T* out = dx.data_as<T>();
    const std::int64_t rows = input_.shape().rows(), dim = dim_;
    COSHARD_CO_TRY(ctx.stream().launch([=] {
      for (std::int64_t r = 0; r < rows; ++r)
        for (std::int64_t c = 0; c < dim; ++c) {
          const std::int64_t i = r * dim + c;
          out[i] = g[i] * a[c];
          da[c] += g[i] * in[i];
          db[c] += g[i];
        }
    }));
    input_ = {};
    co_return dx;
  }
  void clear_saved() override { input_ = {}; }

 private:
  static constexpr modules::DataType kDtype = sizeof(T) == 8 ? modules::DataType::f64 : modules::DataType::f32;
  std::int64_t dim_;
  modules::Tensor input_;
};

}  // namespace coshard::testing
