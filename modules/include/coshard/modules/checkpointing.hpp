// Activation checkpointing: a checkpointed block keeps only its input through forward and runs
// its forward again, just before its backward, to rebuild what backward needs. The recompute
// runs under the Context's recompute mark, so an engine's hooks gather the block's units again
// (inside max_live_bytes, recorded in the trace like any fetch) without counting a second use.
// The kernels are deterministic, so the recomputed activations, and the losses and gradients,
// are the same bits as without checkpointing.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>

#include "coshard/modules/module.hpp"

namespace coshard::modules {

// Which blocks are checkpointed: every = 0 none, 1 every block ("full"), N the N-th, 2N-th, ...
// (blocks N-1, 2N-1, ... counted from 0, as torchtitan's selective layer option).
struct ActivationCheckpointing {
  int every = 0;
  bool enabled() const noexcept { return every > 0; }
  bool checkpoints(std::int64_t block) const noexcept { return every > 0 && (block + 1) % every == 0; }
  // How many of `blocks` blocks it checkpoints.
  std::int64_t count(std::int64_t blocks) const noexcept { return every > 0 ? blocks / every : 0; }
  // "none", "full", or a number N >= 1 ("1" is full).
  static Result<ActivationCheckpointing> parse(std::string_view text);
  std::string to_string() const;  // "none", "full", "every 2nd block"
};

// Runs `inner` (an unnamed child: parameter names are unchanged) with its activations dropped
// after forward and recomputed before backward.
class Checkpointed final : public Module {
 public:
  explicit Checkpointed(std::unique_ptr<Module> inner);
  std::string_view type_name() const override { return "Checkpointed"; }
  Module& inner() const noexcept { return *children().front().module; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { input_.clear(); }

 private:
  SavedPerCall<Tensor> input_;
};

// Wraps the blocks of `model` that `policy` picks in Checkpointed (an engine then never puts
// modules of a checkpointed block and modules outside it into one fetch unit). The blocks are the children
// of `model` that are containers (the repeated layers of a GPT or a Llama: "h0", "h1", ...,
// not the embedding, the final norm or the head), counted in order. Call it before an engine or
// a ParameterStore is made for the model. Returns how many blocks were wrapped.
std::int64_t apply_activation_checkpointing(Sequential& model, ActivationCheckpointing policy);

}  // namespace coshard::modules
