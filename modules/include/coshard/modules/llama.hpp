// A Llama-family decoder built from the layers (llama_layers.hpp):
//   embed -> layers x [attn: Residual(norm, qkv, rope, core, proj),
//                      mlp:  Residual(norm, gate_up, swiglu, down)] -> norm -> head
// RMSNorm, rotary position embeddings, grouped-query attention and a SwiGLU MLP, no biases;
// the head is its own Linear or, with tied embeddings, the embedding table (TiedHead).
// Parameter names follow the module paths ("embed.weight", "h0.attn.qkv.weight",
// "h0.mlp.gate_up.weight", "norm.weight", "head.weight"); hf_llama.hpp maps them to and from
// transformers' names (q, k and v fused into qkv, gate and up into gate_up, rows in that order).
// Initialisation follows transformers: N(0, init_std) for every matrix, unit RMSNorm gains.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/modules/llama_layers.hpp"
#include "coshard/modules/module.hpp"

namespace coshard::collectives {
class Communicator;
}

namespace coshard::modules {

// Mixture of experts in the decoder's MLPs (transformers' Mixtral and Qwen3-MoE, moe.hpp):
// none with 0 experts. Layer l has a SparseMoe block when it is not in dense_layers and
// (l + 1) % sparse_step == 0 (Qwen3-MoE's decoder_sparse_step; Mixtral: every layer), a dense
// MLP of the config's intermediate width otherwise.
struct MoeConfig {
  std::int64_t experts = 0;                // num_local_experts (Mixtral), num_experts (Qwen3-MoE)
  std::int64_t top_k = 2;                  // num_experts_per_tok
  std::int64_t intermediate = 0;           // each expert's width (moe_intermediate_size); 0: the MLP's
  bool renormalize = true;                 // norm_topk_prob (Mixtral renormalises always)
  std::int64_t sparse_step = 1;            // decoder_sparse_step
  std::vector<std::int64_t> dense_layers;  // mlp_only_layers
  double aux_loss_coef = 0;                // router_aux_loss_coef when output_router_logits; 0: none
  bool every_expert_runs = false;          // SparseMoe::Options::every_expert_runs (FSDP2's fetches)

  bool enabled() const noexcept { return experts > 0; }
};

// Which transformers architecture a config names (its tensors' names and config.json's keys):
// LlamaForCausalLM, MixtralForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM.
enum class HfFamily : std::uint8_t { llama, mixtral, qwen3, qwen3_moe };
// "Llama", "Mixtral", "Qwen3", "Qwen3-MoE".
std::string_view to_string(HfFamily family) noexcept;

struct LlamaConfig {
  std::int64_t vocab = 256;
  std::int64_t max_seq = 64;       // the longest sequence a step may take (positions are rotary: no table)
  std::int64_t dim = 64;           // hidden_size
  std::int64_t layers = 2;         // num_hidden_layers
  std::int64_t heads = 4;          // num_attention_heads
  std::int64_t kv_heads = 2;       // num_key_value_heads (dividing heads)
  std::int64_t head_dim = 0;       // 0: dim / heads
  std::int64_t intermediate = 128; // intermediate_size of the MLP
  double rope_theta = 500000.0;
  RopeScaling rope_scaling{};
  double norm_eps = 1e-5;          // rms_norm_eps
  bool tie_embeddings = false;     // tie_word_embeddings
  double init_std = 0.02;          // initializer_range
  bool qk_norm = false;            // Qwen3's RMSNorm of each query and key head (HeadNorms)
  MoeConfig moe{};                 // mixture of experts (none by default)
  HfFamily family = HfFamily::llama;
  // The config.json it was read from (zero::parse_hf_llama_config), as JSON text: an export writes
  // its keys back (bos_token_id, use_cache, max_window_layers, ...) under the ones the model sets.
  // (Characters in a vector, not a std::string: a LlamaConfig stays usable in constexpr, which
  // clang with libstdc++ 12 refuses for a std::string member.)
  std::vector<char> hf_config{};

  std::int64_t resolved_head_dim() const noexcept { return head_dim > 0 ? head_dim : heads > 0 ? dim / heads : 0; }
  // Whether layer l's MLP is a SparseMoe block, and each expert's width.
  bool moe_layer(std::int64_t l) const noexcept;
  std::int64_t expert_width() const noexcept { return moe.intermediate > 0 ? moe.intermediate : intermediate; }
  std::int64_t moe_layers() const noexcept;
  // The parameters one token runs through (the router's top k experts of each MoE layer, not all).
  std::int64_t active_parameter_count() const noexcept;
  // The first bad value, named with what was expected.
  Result<void> validate() const;
  Result<void> validate_moe() const;  // (the MoE part of validate)
  std::int64_t parameter_count() const noexcept;
  // "16 layers, dim 2048, 32 heads (8 key/value) of 64, MLP 8192, vocabulary 128256, tied embeddings"
  // (and "8 experts of 14336 (top 2) in 32 layers" with a mixture of experts)
  std::string describe() const;
};

// Named shapes: those of Meta's Llama 3 releases (vocabulary, rotary base and scaling as
// published in their config.json) and small ones for tests and CPU runs.
struct LlamaPreset {
  std::string_view name;
  std::string_view summary;
  LlamaConfig config;
};
std::span<const LlamaPreset> llama_presets();
// The preset called `name` (case-insensitive), or an error listing the names.
Result<LlamaPreset> llama_preset(std::string_view name);

Result<std::unique_ptr<Sequential>> make_llama(const LlamaConfig& config);

// This rank's part of the model split over `tensor_group` (tensor_parallel.hpp): the embedding
// and the output layer over the vocabulary, qkv and gate_up column-parallel (each rank its query
// heads, key/value heads and MLP slice), proj and down row-parallel, the norms replicated; a
// fork before and a join after each split pair ("h0.attn.fork", "h0.attn.join", "embed_join",
// "head_fork"). Its logits are this rank's columns: train it with VocabParallelCrossEntropyLoss.
// The parameters keep the whole model's names. A group of one rank gives make_llama(config).
// Refused by name when the group's size does not divide the heads, the key/value heads, the
// MLP's width or the vocabulary.
Result<std::unique_ptr<Sequential>> make_llama(const LlamaConfig& config, collectives::Communicator& tensor_group);
// This rank's part of a mixture-of-experts Llama whose experts are partitioned over
// `expert_group` (SparseMoe::Options::expert_group): rank q of P holds experts [q E / P, (q + 1)
// E / P) of each MoE layer under their own names, everything else whole. Train it under an
// engine whose world holds the group's ranks at a stride of world / P (collectives::Mesh's
// expert groups): the ranks holding the same experts, world / P consecutive ones, shard them. A
// group of one rank gives make_llama(config). Refused by name when P does not divide the experts
// or the model has none.
Result<std::unique_ptr<Sequential>> make_llama_expert_parallel(const LlamaConfig& config,
                                                              collectives::Communicator& expert_group);
// The checks of make_llama_expert_parallel without a group, for `ranks` expert-parallel ranks.
Result<void> check_expert_parallel(const LlamaConfig& config, std::int64_t ranks);
// The checks of that make_llama without a group: whether `tensor` ranks can split `config` (a
// mixture of experts and Qwen3's head norms are refused: neither is split over tensor ranks).
Result<void> check_tensor_parallel(const LlamaConfig& config, std::int64_t tensor);

// Device bytes one forward and backward of `rows` sequences of `seq` tokens take in `dtype`
// beyond the parameters and gradients, as gpt_activation_bytes: the activations each block saves,
// the logits and backward's largest temporaries. With `checkpointed_blocks` of the layers
// checkpointed, those keep their input only, and one block's activations come back at a time.
// With `fused_attention`, attention keeps one f32 a query row instead of its probabilities.
// With `logits_chunk_bytes` (FusedCrossEntropyLoss, fused_cross_entropy.hpp), the logits are made
// a chunk of at most that many bytes at a time and never held whole (0: held whole).
std::size_t llama_activation_bytes(const LlamaConfig& config, std::int64_t rows, std::int64_t seq, DataType dtype,
                                   std::int64_t checkpointed_blocks = 0, bool fused_attention = false,
                                   std::int64_t logits_chunk_bytes = 0);

}  // namespace coshard::modules
