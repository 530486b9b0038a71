// Cross-entropy fused with the model's output layer: the logits are never held whole.
//
// A language model's last product gives logits [N, vocab]: for Llama 3's 128,256 tokens and
// N = 8192 rows that is 2.1 GB in bf16, and its gradient as much again, where the rest of the step
// holds far less. Attached to the output layer, this loss has that layer compute the loss itself
// a chunk of vocabulary columns at a time (each chunk's logits one product, then a pass that
// keeps only each row's running max and sum of exponentials), and its backward make each chunk's
// logits again, turn them into their gradient and add that chunk's products into the weight's and
// the input's gradients. The peak is one chunk ([N, columns], at most chunk_bytes) and the input's
// gradient in f32; the cost is the output layer's product made once more in backward.
//
//   FusedCrossEntropyLoss loss;                      // instead of CrossEntropyLoss
//   COSHARD_TRY(loss.attach(*model));                // the model's child "head" (or the layer)
//   loss.set_targets(batch.targets);                 // before the model's forward
//   value = co_await forward_backward(ctx, *model, loss, batch.inputs, batch.targets, seed);
//
// - The loss and gradients are CrossEntropyLoss's up to rounding: each weight-gradient row is one
//   product as before, the input's gradient is summed over the chunks in f32 and rounded once, and
//   the softmax sums come from the chunks' partial sums rescaled to each row's max. Runs repeat
//   bit for bit (a fixed order everywhere).
// - Targets must be set before the model's forward (forward_backward and the engine's evaluate do
//   so): the output layer takes them then, and gives the loss (one stat-dtype element) instead of
//   logits. Targets set after it, or a loss not attached, leave the layer giving logits, and this
//   loss computes the plain cross-entropy over them (correct, without the saving).
// - The model must outlive the loss's use; destroying the loss detaches it (the layer gives
//   logits again). A model's output layer takes one FusedCrossEntropyLoss.
// - Refused by name: an output layer with LoRA adapters, or split over tensor ranks (use
//   VocabParallelCrossEntropyLoss there).
#pragma once

#include <cstdint>
#include <memory>

#include "coshard/modules/layers.hpp"

namespace coshard::modules {

namespace detail {
class OutputLoss;
}

struct FusedCrossEntropyOptions {
  // The most bytes one chunk of logits [rows, columns] takes (its columns a multiple of 64 above
  // 64; at least one column).
  std::int64_t chunk_bytes = std::int64_t{256} << 20;
};

class FusedCrossEntropyLoss final : public Loss {
 public:
  explicit FusedCrossEntropyLoss(FusedCrossEntropyOptions options = {});
  ~FusedCrossEntropyLoss() override;
  FusedCrossEntropyLoss(const FusedCrossEntropyLoss&) = delete;
  FusedCrossEntropyLoss& operator=(const FusedCrossEntropyLoss&) = delete;

  // Arms the output layer: `model` itself when it is a Linear, TiedHead or TokenEmbedding (tied
  // embeddings), else its direct child named "head" (the built-in models' output layer).
  Result<void> attach(Module& model);
  bool attached() const noexcept;

  std::string_view type_name() const override { return "FusedCrossEntropyLoss"; }
  void set_targets(Tensor targets) override;
  // Given the output layer's loss: passes it on. Given logits: the plain cross-entropy over them.
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  // Passes the seed on to the output layer's backward (or the plain cross-entropy's gradient).
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor seed) override;
  void clear_saved() override;

  // The columns of one chunk for `rows` rows of `dtype` logits over a vocabulary of `vocab`.
  std::int64_t chunk_columns(std::int64_t rows, DataType dtype, std::int64_t vocab) const noexcept;
  // The chunks the output layer's last fused forward made (0 before any).
  std::int64_t last_chunks() const noexcept;
  // Whether the last forward was fused (the output layer gave the loss) rather than over logits.
  bool last_forward_fused() const noexcept { return last_fused_; }

 private:
  std::shared_ptr<detail::OutputLoss> state_;  // (holds the options' chunk_bytes)
  CrossEntropyLoss plain_;
  bool fused_pass_ = false;  // the last forward was fused and its backward is to come
  bool last_fused_ = false;
};

}  // namespace coshard::modules
