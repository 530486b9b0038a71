// The linear layer: y = x W^T + b, its products through weight_products.hpp.
#include "coshard/modules/layers.hpp"
#include "coshard/modules/lora.hpp"

#include "coshard/collectives/communicator.hpp"
#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"
#include "layers/output_loss.hpp"
#include "layers/weight_products.hpp"

namespace coshard::modules {
namespace {

using detail::check_activation;
using detail::check_grad;
using detail::check_param;
using detail::trains;

}  // namespace

// ---- Linear ----

Linear::Linear(std::int64_t in_features, std::int64_t out_features, bool bias, Init weight_init)
    : in_(in_features), out_(out_features) {
  register_parameter("weight", Shape{out_features, in_features}, weight_init);
  if (bias) register_parameter("bias", Shape{out_features}, Init::zeros());
}

async::Task<Result<Tensor>> Linear::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(check_activation(ctx, input, in_, "Linear"));
  const DataType dt = input.dtype();
  COSHARD_CO_TRY(check_param(weight(), dt, "Linear"));
  if (bias()) COSHARD_CO_TRY(check_param(*bias(), dt, "Linear"));
  // The output layer of a FusedCrossEntropyLoss with targets set: the loss, chunk by chunk.
  if (output_loss_ && output_loss_->armed()) {
    if (!adapters_.empty())
      co_return fail(ErrorCode::unsupported, "Linear: LoRA adapters on an output layer fused with its loss");
    co_return output_loss_->forward(ctx, std::move(input), weight(), bias(), in_, out_, "Linear");
  }
  if (output_loss_) output_loss_->forget();  // (this forward's backward is the plain one)
  COSHARD_CO_TRY_ASSIGN(Tensor out, detail::times_weight_transposed(ctx, input, weight(), in_, out_, bias()));
  input_.push(input);
  // The adapters add into their rows of the output, each through the hooks (an engine's unit).
  for (LoraAdapter* adapter : adapters_) {
    adapter->add_into_ = out;
    auto added = co_await ctx.forward(*adapter, input);
    adapter->add_into_ = {};
    COSHARD_CO_TRY(std::move(added));
  }
  co_return out;
}

async::Task<Result<Tensor>> Linear::backward(Context& ctx, Tensor grad_output) {
  if (output_loss_ && output_loss_->holds_forward())
    co_return output_loss_->backward(ctx, grad_output, weight(), bias(), in_, out_, "Linear");
  COSHARD_CO_TRY_ASSIGN(const Tensor input, input_.pop("Linear"));
  const DataType dt = input.dtype();
  COSHARD_CO_TRY(check_grad(grad_output, input.shape().with_back(out_), dt, "Linear"));
  const std::int64_t rows = input.shape().rows();
  COSHARD_CO_TRY_ASSIGN(Tensor dx, detail::weight_product_backward(ctx, input, grad_output, weight(), in_, out_));
  if (bias() && trains(*bias()))
    COSHARD_CO_TRY(ctx.kernels().bias_grad(ctx.stream(), dt, grad_output.data(), bias()->grad().data(), rows, out_));
  // The adapters' backward in reverse order of their forward, each adding its part of dx.
  for (auto it = adapters_.rbegin(); it != adapters_.rend(); ++it) {
    COSHARD_CO_TRY_ASSIGN(const Tensor part, co_await ctx.backward(**it, grad_output));
    COSHARD_CO_TRY(ctx.kernels().add(ctx.stream(), dt, dx.data(), part.data(), dx.data(), dx.numel()));
  }
  co_return dx;
}

void Linear::clear_saved_here() noexcept {
  input_.clear();
  if (output_loss_) output_loss_->clear_saved();
}

Result<LoraAdapter*> Linear::add_lora(std::string name, std::int64_t row_begin, std::int64_t row_end,
                                     const LoraOptions& options) {
  return add_lora(std::move(name),
                  LoraPlacement{.in = in_, .row_begin = row_begin, .row_end = row_end, .out = out_, .whole_in = in_,
                                .whole_row_begin = row_begin, .whole_row_end = row_end, .row_segments = {}},
                  options);
}

Result<LoraAdapter*> Linear::add_lora(std::string name, const LoraPlacement& where, const LoraOptions& options) {
  const std::int64_t row_begin = where.row_begin, row_end = where.row_end;
  if (row_begin < 0 || row_end <= row_begin || row_end > out_)
    return fail(ErrorCode::invalid_argument, "Linear::add_lora(", name, "): rows [", row_begin, ", ", row_end,
                ") of an output of ", out_, ": expected 0 <= begin < end <= ", out_);
  if (where.in != in_ || where.out != out_)
    return fail(ErrorCode::invalid_argument, "Linear::add_lora(", name, "): placed on a layer of ", where.in, " inputs and ",
                where.out, " outputs, this one has ", in_, " and ", out_);
  if (where.split != LoraSplit::none) {
    const std::int64_t parts = where.group ? where.group->size() : 0;
    const std::int64_t split_rows = where.split == LoraSplit::output_rows ? options.rank : row_end - row_begin;
    if (parts < 1 || split_rows % parts != 0)
      return fail(ErrorCode::invalid_argument, "Linear::add_lora(", name, "): split over ", parts, " tensor ranks, which ",
                  where.split == LoraSplit::output_rows ? "do not divide the rank " : "do not divide its rows ", split_rows);
  }
  for (const auto& c : children())
    if (c.name == name) return fail(ErrorCode::invalid_argument, "Linear::add_lora: a child named ", name, " already exists");
  auto adapter = std::make_unique<LoraAdapter>(where, options);
  COSHARD_TRY(adapter->split_parameters());
  LoraAdapter& ref = register_child(std::move(name), std::move(adapter));
  adapters_.push_back(&ref);
  return &ref;
}

}  // namespace coshard::modules
