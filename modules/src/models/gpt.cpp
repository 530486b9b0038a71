#include "coshard/modules/gpt.hpp"

#include <algorithm>
#include <cmath>

#include "models/config_checks.hpp"

namespace coshard::modules {

Result<void> GptConfig::validate() const {
  COSHARD_TRY(detail::check_positive("GptConfig", "vocab", vocab));
  COSHARD_TRY(detail::check_positive("GptConfig", "max_seq", max_seq));
  COSHARD_TRY(detail::check_positive("GptConfig", "dim", dim));
  COSHARD_TRY(detail::check_positive("GptConfig", "layers", layers));
  COSHARD_TRY(detail::check_positive("GptConfig", "heads", heads));
  COSHARD_TRY(detail::check_positive("GptConfig", "mlp_ratio", mlp_ratio));
  if (dim % heads != 0)
    return fail(ErrorCode::invalid_argument, "GptConfig.dim=", dim, ": expected a multiple of heads=", heads);
  if (vocab > std::int64_t{1} << 31)
    return fail(ErrorCode::invalid_argument, "GptConfig.vocab=", vocab, ": token ids are i32");
  return {};
}

std::int64_t GptConfig::parameter_count() const noexcept {
  const std::int64_t hidden = mlp_ratio * dim;
  const std::int64_t block = 2 * (2 * dim)                 // two LayerNorms
                             + dim * 3 * dim + 3 * dim      // qkv
                             + dim * dim + dim              // attention projection
                             + dim * hidden + hidden        // fc
                             + hidden * dim + dim;          // mlp projection
  return vocab * dim + max_seq * dim + layers * block + 2 * dim + dim * vocab + vocab;
}

std::size_t gpt_activation_bytes(const GptConfig& c, std::int64_t rows, std::int64_t seq, DataType dtype,
                                 std::int64_t checkpointed_blocks, bool fused_attention,
                                 std::int64_t logits_chunk_bytes) {
  const auto e = static_cast<double>(size_of(dtype));
  const double N = static_cast<double>(rows) * static_cast<double>(seq);  // tokens
  const double D = static_cast<double>(c.dim), V = static_cast<double>(c.vocab);
  const double hidden = static_cast<double>(c.mlp_ratio) * D;
  // Attention's saved probabilities (or the fused kernels' f32 row statistics), in elements of dtype.
  const double probs = static_cast<double>(rows) * static_cast<double>(c.heads) * static_cast<double>(seq) *
                       (fused_attention ? 4.0 / e : static_cast<double>(seq));
  const double stats = 2 * N * 4;  // a LayerNorm's mean and rstd, f32 a row
  // A block saves its input, ln's output, qkv's (3D), attention's output and probabilities, the
  // residual's output, ln's output, fc's and gelu's (hidden each); the next block's input is its.
  const double block = (6 * D + 2 * hidden) * N * e + probs * e + 2 * stats;
  // A checkpointed block keeps its input only; one block's activations come back in backward.
  const auto L = static_cast<double>(c.layers), K = static_cast<double>(std::clamp<std::int64_t>(checkpointed_blocks, 0, c.layers));
  const double blocks = (L - K) * block + K * D * N * e + (K > 0 ? block : 0);
  // The logits held (or, chunked, the rows' running max and sums), ln_f's output and the head's input.
  const double chunk = std::min(static_cast<double>(logits_chunk_bytes), V * N * e);
  const double logits = logits_chunk_bytes > 0 ? 3 * N * 4 : V * N * e;
  const double saved = blocks + 2 * D * N * e + logits + stats;
  // Backward's temporaries beside them: the logits' gradient with the head's input gradient (or
  // one chunk and that gradient summed in f32), or attention's scratch and its qkv gradient, or
  // the MLP's.
  const double head_grad = logits_chunk_bytes > 0 ? chunk + D * N * (4 + e) : (V + D) * N * e;
  const double working = std::max({head_grad, (2 * probs + 4 * D * N) * e, (2 * hidden + 2 * D) * N * e});
  return static_cast<std::size_t>(saved + working);
}

Result<std::unique_ptr<Sequential>> make_gpt(const GptConfig& c) {
  COSHARD_TRY(c.validate());
  const Init weight = Init::normal(0.02);
  const Init residual_weight = Init::normal(0.02 / std::sqrt(2.0 * static_cast<double>(c.layers)));
  auto model = std::make_unique<Sequential>();
  model->add("embed", std::make_unique<Embedding>(c.vocab, c.max_seq, c.dim, weight));
  for (std::int64_t l = 0; l < c.layers; ++l) {
    auto attn = std::make_unique<Sequential>();
    attn->add("ln", std::make_unique<LayerNorm>(c.dim));
    attn->add("qkv", std::make_unique<Linear>(c.dim, 3 * c.dim, true, weight));
    attn->add("core", std::make_unique<CausalSelfAttention>(c.dim, c.heads));
    attn->add("proj", std::make_unique<Linear>(c.dim, c.dim, true, residual_weight));
    auto mlp = std::make_unique<Sequential>();
    mlp->add("ln", std::make_unique<LayerNorm>(c.dim));
    mlp->add("fc", std::make_unique<Linear>(c.dim, c.mlp_ratio * c.dim, true, weight));
    mlp->add("gelu", std::make_unique<Gelu>());
    mlp->add("proj", std::make_unique<Linear>(c.mlp_ratio * c.dim, c.dim, true, residual_weight));
    auto block = std::make_unique<Sequential>();
    block->add("attn", std::make_unique<Residual>(std::move(attn)));
    block->add("mlp", std::make_unique<Residual>(std::move(mlp)));
    model->add("h" + std::to_string(l), std::move(block));
  }
  model->add("ln_f", std::make_unique<LayerNorm>(c.dim));
  model->add("head", std::make_unique<Linear>(c.dim, c.vocab, true, weight));
  return model;
}

}  // namespace coshard::modules
