// transformers' mixture-of-experts Llamas (MixtralForCausalLM): config.json's MoE keys and the
// experts' tensor names (private to src/formats).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "coshard/modules/llama.hpp"
#include "formats/hf_format.hpp"

namespace coshard::zero::detail {

// Whether config.json names a Mixtral (model_type "mixtral" or a MixtralForCausalLM architecture).
bool names_mixtral(const json& doc);
// Mixtral's keys into c.moe (num_local_experts, num_experts_per_tok, the auxiliary loss's
// router_aux_loss_coef when output_router_logits), c.family = mixtral. Refused by name: router
// jitter noise (training noise transformers adds, not reproduced), a sliding window shorter than
// max_position_embeddings (coshard's attention sees the whole causal prefix).
Result<void> read_mixtral_fields(const Fields& f, modules::LlamaConfig& c);
// The same keys from c into doc (with model_type and architectures).
void write_moe_fields(json& doc, const modules::LlamaConfig& c);
// Layer l's MoE block: coshard's `prefix` ("h0.mlp.moe.") and transformers' `hf_layer`
// ("model.layers.0.").
void add_moe_mappings(std::vector<Mapping>& m, const modules::LlamaConfig& c, const std::string& prefix,
                      const std::string& hf_layer);

}  // namespace coshard::zero::detail
