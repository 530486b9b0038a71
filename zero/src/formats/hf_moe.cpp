// Mixtral's config keys and tensor names (hf_moe.hpp).
#include "formats/hf_moe.hpp"

namespace coshard::zero::detail {

using modules::HfFamily;
using modules::LlamaConfig;
using modules::Shape;

bool names_mixtral(const json& doc) {
  if (doc.contains("model_type") && doc["model_type"] == "mixtral") return true;
  if (doc.contains("architectures") && doc["architectures"].is_array())
    for (const auto& a : doc["architectures"])
      if (a == "MixtralForCausalLM") return true;
  return false;
}

Result<void> read_mixtral_fields(const Fields& f, LlamaConfig& c) {
  c.family = HfFamily::mixtral;
  COSHARD_TRY_ASSIGN(c.moe.experts, f.integer("num_local_experts"));
  COSHARD_TRY_ASSIGN(c.moe.top_k, f.integer("num_experts_per_tok", std::int64_t{2}));
  c.moe.renormalize = true;
  COSHARD_TRY_ASSIGN(const bool router_logits, f.boolean("output_router_logits", false));
  COSHARD_TRY_ASSIGN(const double coef, f.number(f.doc, "router_aux_loss_coef", 0.001));
  c.moe.aux_loss_coef = router_logits ? coef : 0.0;
  COSHARD_TRY_ASSIGN(const double jitter, f.number(f.doc, "router_jitter_noise", 0.0));
  if (jitter != 0)
    return fail(ErrorCode::unsupported, f.source, ": \"router_jitter_noise\"=", jitter,
                " (expected 0: coshard's router adds no noise)");
  if (f.doc.contains("sliding_window") && !f.doc["sliding_window"].is_null()) {
    COSHARD_TRY_ASSIGN(const std::int64_t window, f.integer("sliding_window"));
    if (window < c.max_seq)
      return fail(ErrorCode::unsupported, f.source, ": \"sliding_window\"=", window, " is shorter than ",
                  "max_position_embeddings ", c.max_seq, " (coshard's attention sees the whole causal prefix: ",
                  "expected null)");
  }
  return {};
}

void write_moe_fields(json& doc, const LlamaConfig& c) {
  if (c.family != HfFamily::mixtral) return;
  doc["architectures"] = {"MixtralForCausalLM"};
  doc["model_type"] = "mixtral";
  doc["num_local_experts"] = c.moe.experts;
  doc["num_experts_per_tok"] = c.moe.top_k;
  doc["output_router_logits"] = c.moe.aux_loss_coef > 0;
  doc["router_aux_loss_coef"] = c.moe.aux_loss_coef > 0 ? c.moe.aux_loss_coef : 0.001;
  doc["router_jitter_noise"] = 0.0;
  doc["sliding_window"] = nullptr;
  for (const char* llama_only : {"attention_bias", "mlp_bias", "pretraining_tp"}) doc.erase(llama_only);
}

void add_moe_mappings(std::vector<Mapping>& m, const LlamaConfig& c, const std::string& prefix,
                      const std::string& hf_layer) {
  const std::int64_t D = c.dim, E = c.moe.experts, W = c.expert_width();
  const std::string hf = hf_layer + "block_sparse_moe.";
  m.push_back({prefix + "router.weight", Shape{E, D}, {{hf + "gate.weight", 0}}});
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string ours = prefix + "experts." + std::to_string(e) + ".", theirs = hf + "experts." + std::to_string(e) + ".";
    m.push_back({ours + "gate_up.weight", Shape{2 * W, D}, {{theirs + "w1.weight", W}, {theirs + "w3.weight", W}}});
    m.push_back({ours + "down.weight", Shape{D, W}, {{theirs + "w2.weight", 0}}});
  }
}

}  // namespace coshard::zero::detail
