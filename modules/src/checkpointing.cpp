#include "coshard/modules/checkpointing.hpp"

#include <charconv>

namespace coshard::modules {

Result<ActivationCheckpointing> ActivationCheckpointing::parse(std::string_view text) {
  if (text == "none") return ActivationCheckpointing{0};
  if (text == "full") return ActivationCheckpointing{1};
  int every = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), every);
  if (ec != std::errc{} || end != text.data() + text.size() || every < 1)
    return fail(ErrorCode::invalid_argument, "activation checkpointing \"", text,
                "\": expected none, full, or N >= 1 (every N-th block)");
  return ActivationCheckpointing{every};
}

std::string ActivationCheckpointing::to_string() const {
  if (every <= 0) return "none";
  if (every == 1) return "full";
  const char* suffix = every % 10 == 2 && every % 100 != 12 ? "nd" : every % 10 == 3 && every % 100 != 13 ? "rd" : "th";
  return "every " + std::to_string(every) + suffix + " block";
}

Checkpointed::Checkpointed(std::unique_ptr<Module> inner) { register_child("", std::move(inner)); }

async::Task<Result<Tensor>> Checkpointed::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY_ASSIGN(Tensor y, co_await ctx.forward(inner(), input));
  // Only the input stays (inside a recompute too: an enclosing checkpoint rebuilds this block's
  // input, and this block recomputes its own inside when its backward comes).
  inner().clear_saved_recursive();
  input_.push(std::move(input));
  co_return y;
}

async::Task<Result<Tensor>> Checkpointed::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(Tensor input, input_.pop("Checkpointed"));
  {
    Context::RecomputeScope recompute(ctx);
    auto again = co_await ctx.forward(inner(), std::move(input));
    if (!again) {
      inner().clear_saved_recursive();
      co_return fail(std::move(again).error().with_context("recomputing a checkpointed block"));
    }
  }
  co_return co_await ctx.backward(inner(), std::move(grad_output));
}

std::int64_t apply_activation_checkpointing(Sequential& model, ActivationCheckpointing policy) {
  std::int64_t block = 0, wrapped = 0;
  const auto children = model.children();
  for (std::size_t i = 0; i < children.size(); ++i) {
    if (children[i].module->children().empty()) continue;  // a leaf: the embedding, a norm, the head
    if (dynamic_cast<const Checkpointed*>(children[i].module.get())) {  // applied before: counted, not wrapped twice
      ++block;
      continue;
    }
    if (policy.checkpoints(block++)) {
      model.wrap_child(i, [](std::unique_ptr<Module> m) -> std::unique_ptr<Module> {
        return std::make_unique<Checkpointed>(std::move(m));
      });
      ++wrapped;
    }
  }
  return wrapped;
}

}  // namespace coshard::modules
