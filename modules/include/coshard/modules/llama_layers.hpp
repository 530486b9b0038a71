// The layers a Llama-family decoder adds to the GPT ones (layers.hpp): RMSNorm, the SwiGLU
// activation of its MLP, and rotary position embeddings with grouped-query heads. Parameter
// names and layouts are transformers' (LlamaRMSNorm's "weight"; q and k in its rotary convention,
// dimension i of a head paired with i + head_dim/2).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "coshard/modules/module.hpp"

namespace coshard::modules {

class FusedCrossEntropyLoss;  // fused_cross_entropy.hpp
namespace detail {
class OutputLoss;
}

// Token embeddings without positions (transformers' embed_tokens: rotary embeddings place the
// tokens): tokens i32 [B, T] -> [B, T, dim]; its one parameter is "weight" [vocab, dim].
// With tied output embeddings the same table also projects hidden states onto the vocabulary: a
// TiedHead runs this module on floating [..., dim] activations, giving logits [..., vocab] =
// x weight^T. Both uses go through this module's hooks, so an engine fetches its unit for each
// and adds both gradients; backward undoes the uses in reverse order of their forwards.
class TokenEmbedding final : public Module {
 public:
  TokenEmbedding(std::int64_t vocab, std::int64_t dim, Init init = Init::normal(0.02));
  // Rows [first, first + rows) of a table of `whole_vocab` (a vocabulary-parallel part,
  // tensor_parallel.hpp): tokens outside them give zero rows forward and nothing backward; as the
  // output layer it gives those columns of the logits.
  TokenEmbedding(std::int64_t rows, std::int64_t dim, Init init, std::int64_t first, std::int64_t whole_vocab);
  std::string_view type_name() const override { return "TokenEmbedding"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  // The gradient of the last use's input: empty for token ids, dL/dx for the projection.
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { clear_saved_here(); }
  bool runs_more_than_once_per_pass() const noexcept override { return true; }

  std::int64_t vocab() const noexcept { return vocab_; }  // this table's rows
  std::int64_t first_row() const noexcept { return first_; }
  std::int64_t whole_vocab() const noexcept { return whole_; }
  std::int64_t dim() const noexcept { return dim_; }
  Parameter& weight() const noexcept { return *parameters()[0]; }

 private:
  async::Task<Result<Tensor>> project(Context& ctx, Tensor hidden);
  async::Task<Result<Tensor>> project_backward(Context& ctx, const Tensor& hidden, const Tensor& grad_output);
  std::int64_t vocab_, dim_;
  friend class FusedCrossEntropyLoss;
  void clear_saved_here() noexcept;
  std::int64_t first_ = 0, whole_ = 0;
  std::vector<Tensor> saved_;  // the inputs of uses whose backward is still to come, last on top
  std::shared_ptr<detail::OutputLoss> output_loss_;  // set by a FusedCrossEntropyLoss attached here
};

// The output layer of tied embeddings: logits = x embed^T through `table` (which another part
// of the model owns and runs first). No parameters of its own.
class TiedHead final : public Module {
 public:
  explicit TiedHead(TokenEmbedding& table) : table_(&table) {}
  std::string_view type_name() const override { return "TiedHead"; }
  TokenEmbedding& table() const noexcept { return *table_; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;

 private:
  TokenEmbedding* table_;
};

// RMSNorm (Llama): y = x / sqrt(mean(x^2) + eps) * weight over the last dimension; no bias and
// no mean, as `transformers`' LlamaRMSNorm (its one parameter is "weight", ones at init).
class RmsNorm final : public Module {
 public:
  explicit RmsNorm(std::int64_t dim, float eps = 1e-5f);
  std::string_view type_name() const override { return "RmsNorm"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { saved_.clear(); }

 private:
  struct Saved {
    Tensor input, rstd;
  };
  std::int64_t dim_;
  float eps_;
  SavedPerCall<Saved> saved_;
};

// SwiGLU, the activation of Llama's MLP: input [..., 2I] holds gate | up (the outputs of
// transformers' gate_proj and up_proj, fused into one Linear); output [..., I] = silu(gate) * up.
class SwiGlu final : public Module {
 public:
  std::string_view type_name() const override { return "SwiGlu"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { input_.clear(); }

 private:
  SavedPerCall<Tensor> input_;
};

// Qwen3's RMSNorm of each query and key head (transformers' q_norm and k_norm, one gain of
// head_dim each, shared by the heads) on the fused projection qkv [..., (n_heads + 2 n_kv_heads)
// * head_dim], before the rotary embedding; the value heads pass unchanged. Its children "q" and
// "k" are RmsNorms over rows of head_dim: the heads are gathered into rows of theirs, normed
// through the hooks, and put back.
class HeadNorms final : public Module {
 public:
  HeadNorms(std::int64_t n_heads, std::int64_t n_kv_heads, std::int64_t head_dim, float eps);
  std::string_view type_name() const override { return "HeadNorms"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { saved_.clear(); }

 private:
  // Head rows of `rows` tokens, queries first, then keys, then values: the place of each (order,
  // and its inverse), uploaded.
  struct Places {
    Tensor order, inverse;
  };
  Result<Places> places(Context& ctx, std::int64_t rows);
  std::int64_t n_heads_, n_kv_heads_, head_dim_;
  Module* q_ = nullptr;
  Module* k_ = nullptr;
  struct Saved {
    Shape shape;
    Places places;
  };
  SavedPerCall<Saved> saved_;
};

// Llama 3's scaling of the rotary frequencies (transformers' rope_scaling with rope_type "llama3"):
// wavelengths longer than original_max_positions / low_freq_factor are stretched by `factor`,
// shorter than original_max_positions / high_freq_factor are kept, and those between are blended.
// factor 0 (the default): no scaling.
struct RopeScaling {
  double factor = 0;
  double low_freq_factor = 1;
  double high_freq_factor = 4;
  std::int64_t original_max_positions = 8192;
};

// Rotary position embeddings on the fused projection of queries, keys and values:
// qkv [B, T, (n_heads + 2 n_kv_heads) * head_dim] (the query heads, then the key heads, then the
// value heads). The query and key heads at position t turn by t * inv_freq[i] (inv_freq[i] =
// theta^(-2i/head_dim), scaled); the value heads pass unchanged. No parameters.
class RotaryEmbedding final : public Module {
 public:
  RotaryEmbedding(std::int64_t n_heads, std::int64_t n_kv_heads, std::int64_t head_dim, double theta = 500000.0,
                  RopeScaling scaling = {});
  std::string_view type_name() const override { return "RotaryEmbedding"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { saved_.clear(); }
  // The head_dim / 2 frequencies, in f32 as the kernels use them.
  const std::vector<float>& inv_freq() const noexcept { return inv_freq_; }
  std::int64_t n_heads() const noexcept { return n_heads_; }
  std::int64_t n_kv_heads() const noexcept { return n_kv_heads_; }
  std::int64_t head_dim() const noexcept { return head_dim_; }
  // An error naming the first bad value (heads, head_dim odd, n_kv_heads not dividing n_heads,
  // theta or the scaling out of range); the layer refuses to run until fixed.
  Result<void> check() const;

 private:
  std::int64_t n_heads_, n_kv_heads_, head_dim_;
  double theta_;
  RopeScaling scaling_;
  std::vector<float> inv_freq_;
  struct Saved {
    Shape shape;
    Tensor freq;  // inv_freq on the device, kept for backward
  };
  SavedPerCall<Saved> saved_;
};

}  // namespace coshard::modules
