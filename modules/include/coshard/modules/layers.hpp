// The layers of a GPT-style decoder. Activations are [..., C] tensors (rows = product of the
// leading dimensions); every layer checks what it is given and names the mismatch.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coshard/modules/module.hpp"

namespace coshard::modules {

class LoraAdapter;            // lora.hpp
struct LoraOptions;           // lora.hpp
struct LoraPlacement;         // lora.hpp
class FusedCrossEntropyLoss;  // fused_cross_entropy.hpp
namespace detail {
class OutputLoss;
}

// Token and position embeddings: tokens i32 [B, T] -> [B, T, dim] (wte[token] + wpe[position]).
class Embedding final : public Module {
 public:
  Embedding(std::int64_t vocab, std::int64_t max_positions, std::int64_t dim, Init init = Init::normal(0.02));
  std::string_view type_name() const override { return "Embedding"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor tokens) override;
  // Returns an empty tensor: token ids have no gradient.
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { tokens_.clear(); }

  Parameter& token_weight() const noexcept { return *parameters()[0]; }     // "wte" [vocab, dim]
  Parameter& position_weight() const noexcept { return *parameters()[1]; }  // "wpe" [max_positions, dim]

 private:
  std::int64_t vocab_, max_positions_, dim_;
  SavedPerCall<Tensor> tokens_;
};

// y = x W^T (+ b), W [out, in] as in PyTorch.
class Linear final : public Module {
 public:
  Linear(std::int64_t in_features, std::int64_t out_features, bool bias = true, Init weight_init = Init::normal(0.02));
  std::string_view type_name() const override { return "Linear"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { clear_saved_here(); }

  std::int64_t in_features() const noexcept { return in_; }
  std::int64_t out_features() const noexcept { return out_; }
  Parameter& weight() const noexcept { return *parameters()[0]; }
  Parameter* bias() const noexcept { return parameters().size() > 1 ? parameters()[1].get() : nullptr; }

  // A low-rank adapter on rows [row_begin, row_end) of the output (lora.hpp), a child named
  // `name`: run after the layer's own product, adding into those rows. Before any ParameterStore
  // or engine is made for the model; an error names a bad row range or rank.
  Result<LoraAdapter*> add_lora(std::string name, std::int64_t row_begin, std::int64_t row_end,
                                const LoraOptions& options);
  // The same at a placement of its own (a tensor-parallel layer's part: lora.hpp's LoraSplit).
  Result<LoraAdapter*> add_lora(std::string name, const LoraPlacement& where, const LoraOptions& options);
  std::span<LoraAdapter* const> lora_adapters() const noexcept { return adapters_; }

 private:
  friend class FusedCrossEntropyLoss;
  void clear_saved_here() noexcept;
  std::int64_t in_, out_;
  SavedPerCall<Tensor> input_;
  std::vector<LoraAdapter*> adapters_;
  std::shared_ptr<detail::OutputLoss> output_loss_;  // set by a FusedCrossEntropyLoss attached here
};

class LayerNorm final : public Module {
 public:
  explicit LayerNorm(std::int64_t dim, float eps = 1e-5f);
  std::string_view type_name() const override { return "LayerNorm"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { saved_.clear(); }

 private:
  struct Saved {
    Tensor input, mean, rstd;
  };
  std::int64_t dim_;
  float eps_;
  SavedPerCall<Saved> saved_;
};

// GELU, tanh approximation (GPT-2).
class Gelu final : public Module {
 public:
  std::string_view type_name() const override { return "Gelu"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { input_.clear(); }

 private:
  SavedPerCall<Tensor> input_;
};

// The heads of an attention: n_heads query heads of head_dim, sharing n_kv_heads key/value heads
// (grouped-query attention, as Llama's; n_kv_heads = n_heads is multi-head).
struct AttentionHeads {
  std::int64_t n_heads = 1;
  std::int64_t n_kv_heads = 1;
  std::int64_t head_dim = 1;
};

// Causal self-attention core: qkv [B, T, (n_heads + 2 n_kv_heads) * head_dim] (queries | keys |
// values) -> [B, T, n_heads * head_dim]; query head h attends with key/value head
// h / (n_heads / n_kv_heads). The projections around it are Linear modules (see make_gpt), so each
// is its own fetch unit and the core has no parameters.
// AttentionKernels::cudnn's library: "cuDNN 9.19.0 (its path)", or why it cannot be opened here
// (then the fused kernels run).
Result<std::string> cudnn_attention_library();
// Whether causal attention on `device` in `dtype` with heads of `head_dim` runs the fused kernels
// with `kernels` chosen (then it keeps one f32 a query row for backward instead of the T x T
// probabilities): CUDA, bf16/f16, head sizes 32, 64, 96, 128 (cuDNN's attention keeps the same).
bool attention_is_fused(async::Device device, DataType dtype, std::int64_t head_dim,
                        AttentionKernels kernels = AttentionKernels::fused);

class CausalSelfAttention final : public Module {
 public:
  // Multi-head: qkv [B, T, 3 * dim], `heads` heads of dim / heads.
  CausalSelfAttention(std::int64_t dim, std::int64_t heads);
  explicit CausalSelfAttention(AttentionHeads heads);
  std::string_view type_name() const override { return "CausalSelfAttention"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor qkv) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { saved_.clear(); }

 private:
  struct Saved {
    Tensor qkv, stats, out;  // stats: the probabilities, or the fused kernels' row statistics
  };
  Result<void> check() const;
  // A forward while ctx.decoding() is set: through this layer's key/value cache (decoding.hpp).
  async::Task<Result<Tensor>> decode(Context& ctx, Decoding& decoding, Tensor qkv);
  std::int64_t dim_;  // multi-head form; 0 for AttentionHeads
  AttentionHeads heads_;
  SavedPerCall<Saved> saved_;
};

// A loss: a module without parameters whose targets are set before its forward. Forward takes
// the model's output and gives the loss (one element, the stat dtype of the output: f32, or f64
// for f64); backward takes a seed of that dtype and shape (1, or the loss scale) and gives the
// gradient of the output. Derive from it for a loss of your own; the engine and the trainer
// take any Loss.
class Loss : public Module {
 public:
  virtual void set_targets(Tensor targets) = 0;
};

// Mean softmax cross-entropy of logits [B, T, V] (or [N, V]) against targets i32 [B, T] (or [N]).
class CrossEntropyLoss final : public Loss {
 public:
  std::string_view type_name() const override { return "CrossEntropyLoss"; }
  void set_targets(Tensor targets) override { targets_ = std::move(targets); }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor logits) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor seed) override;
  void clear_saved() override { logits_ = {}; }

 private:
  Tensor targets_, logits_;
};

// Mean squared error, (1/n) sum (pred - target)^2 over all n elements (PyTorch's MSELoss with
// reduction "mean"): targets of the prediction's shape and dtype (f32, bf16, f16 or f64).
class MeanSquaredErrorLoss final : public Loss {
 public:
  std::string_view type_name() const override { return "MeanSquaredErrorLoss"; }
  void set_targets(Tensor targets) override { targets_ = std::move(targets); }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor pred) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor seed) override;
  void clear_saved() override { pred_ = {}; }

 private:
  Tensor targets_, pred_;
};

// One micro-batch on the compute device: the model's input and the loss's targets, of whatever
// shape and dtype they take (token ids i32 [B, T] and i32 targets for a GPT and its
// cross-entropy; float features and float targets for a regression and its mean squared error).
struct Batch {
  Tensor inputs;
  Tensor targets;
};

// One micro-batch: forward through `model` and `loss`, then backward
// seeded with `seed` (a one-element tensor: 1, or the loss scale), adding into the bound
// parameter gradients. Returns the loss (one element on the device).
async::Task<Result<Tensor>> forward_backward(Context& ctx, Module& model, Loss& loss, Tensor inputs, Tensor targets,
                                             Tensor seed);

}  // namespace coshard::modules
