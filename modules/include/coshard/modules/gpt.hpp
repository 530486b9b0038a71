// A GPT-style decoder built from the layers:
//   embed -> layers x [attn: Residual(ln, qkv, core, proj), mlp: Residual(ln, fc, gelu, proj)]
//         -> ln_f -> head (logits over the vocabulary)
// Parameter names follow the module paths: "embed.wte", "h0.attn.qkv.weight", "ln_f.bias", ...
// Initialisation follows GPT-2: N(0, 0.02) weights, zero biases, unit LayerNorm gains, and the
// residual projections scaled by 1/sqrt(2 * layers).
#pragma once

#include <cstdint>
#include <memory>

#include "coshard/modules/layers.hpp"

namespace coshard::modules {

struct GptConfig {
  std::int64_t vocab = 256;
  std::int64_t max_seq = 64;
  std::int64_t dim = 64;
  std::int64_t layers = 2;
  std::int64_t heads = 4;
  std::int64_t mlp_ratio = 4;

  Result<void> validate() const;
  std::int64_t parameter_count() const noexcept;
};

Result<std::unique_ptr<Sequential>> make_gpt(const GptConfig& config);

// Device bytes one forward and backward of `rows` sequences of `seq` tokens take in `dtype`,
// beyond the parameters and gradients: the activations every layer saves for backward (16 x dim
// values a token a layer, the attention probabilities, LayerNorm statistics, the logits), and
// backward's largest temporaries (the logits' gradient, or attention's). The activations item of
// a memory estimate (memory_estimate.hpp). With `checkpointed_blocks` of the layers checkpointed
// (checkpointing.hpp), those keep their input only, and one block's activations come back at a time.
// With `fused_attention` (attention_is_fused, layers.hpp), attention keeps one f32 a query row
// instead of its probabilities.
// With `logits_chunk_bytes` (FusedCrossEntropyLoss, fused_cross_entropy.hpp), the logits are made
// a chunk of at most that many bytes at a time and never held whole (0: held whole).
std::size_t gpt_activation_bytes(const GptConfig& config, std::int64_t rows, std::int64_t seq, DataType dtype,
                                 std::int64_t checkpointed_blocks = 0, bool fused_attention = false,
                                 std::int64_t logits_chunk_bytes = 0);

}  // namespace coshard::modules
