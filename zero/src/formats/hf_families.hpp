// The transformers architectures a Llama-family config can name beyond LlamaForCausalLM:
// MixtralForCausalLM, Qwen3ForCausalLM and Qwen3MoeForCausalLM; their config.json keys and the
// tensor names that differ from Llama's (private to src/formats).
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/modules/llama.hpp"
#include "formats/hf_format.hpp"

namespace coshard::zero::detail {

// "Llama", "Mixtral", "Qwen3", "Qwen3-MoE": what errors call the model.
std::string_view family_title(modules::HfFamily family);
// The family config.json names (model_type, or its architectures), or none of the four.
std::optional<modules::HfFamily> family_named(const json& doc);
// The family's own keys into c (after the Llama keys): Mixtral's num_local_experts and
// num_experts_per_tok; Qwen3's head norms; Qwen3-MoE's num_experts, num_experts_per_tok,
// moe_intermediate_size, norm_topk_prob, decoder_sparse_step and mlp_only_layers; for both MoE
// families the auxiliary loss's router_aux_loss_coef when output_router_logits. Refused by name:
// router jitter noise, a sliding window (coshard's attention sees the whole causal prefix).
Result<void> read_family_fields(const Fields& f, modules::HfFamily family, modules::LlamaConfig& c);
// The same keys from c into doc, with model_type and architectures.
void write_family_fields(json& doc, const modules::LlamaConfig& c);
// Layer l's query and key head norms, if the config has them: coshard's `prefix` ("h0.attn.")
// and transformers' `hf_layer` ("model.layers.0.").
void add_head_norm_mappings(std::vector<Mapping>& m, const modules::LlamaConfig& c, const std::string& prefix,
                            const std::string& hf_layer);
// Layer l's MoE block: coshard's `prefix` ("h0.mlp.moe.").
void add_moe_mappings(std::vector<Mapping>& m, const modules::LlamaConfig& c, const std::string& prefix,
                      const std::string& hf_layer);

}  // namespace coshard::zero::detail
