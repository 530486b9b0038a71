// Mixtral's, Qwen3's and Qwen3-MoE's config keys and tensor names (hf_families.hpp).
#include "formats/hf_families.hpp"

#include <algorithm>

namespace coshard::zero::detail {

using modules::HfFamily;
using modules::LlamaConfig;
using modules::Shape;

namespace {

struct Named {
  HfFamily family;
  const char* model_type;
  const char* architecture;
};
constexpr Named kFamilies[] = {{HfFamily::llama, "llama", "LlamaForCausalLM"},
                               {HfFamily::mixtral, "mixtral", "MixtralForCausalLM"},
                               {HfFamily::qwen3, "qwen3", "Qwen3ForCausalLM"},
                               {HfFamily::qwen3_moe, "qwen3_moe", "Qwen3MoeForCausalLM"}};

const Named& named(HfFamily family) {
  return *std::find_if(std::begin(kFamilies), std::end(kFamilies), [&](const Named& n) { return n.family == family; });
}

bool is_moe(HfFamily family) { return family == HfFamily::mixtral || family == HfFamily::qwen3_moe; }

Result<void> read_aux_loss(const Fields& f, LlamaConfig& c) {
  COSHARD_TRY_ASSIGN(const bool router_logits, f.boolean("output_router_logits", false));
  COSHARD_TRY_ASSIGN(const double coef, f.number(f.doc, "router_aux_loss_coef", 0.001));
  c.moe.aux_loss_coef = router_logits ? coef : 0.0;
  return {};
}

Result<void> refuse_sliding_window(const Fields& f, const LlamaConfig& c) {
  COSHARD_TRY_ASSIGN(const bool sliding, f.boolean("use_sliding_window", false));
  if (sliding)
    return fail(ErrorCode::unsupported, f.source, ": \"use_sliding_window\"=true (coshard's attention sees the whole ",
                "causal prefix: expected false)");
  if (c.family == HfFamily::mixtral && f.doc.contains("sliding_window") && !f.doc["sliding_window"].is_null()) {
    COSHARD_TRY_ASSIGN(const std::int64_t window, f.integer("sliding_window"));
    if (window < c.max_seq)
      return fail(ErrorCode::unsupported, f.source, ": \"sliding_window\"=", window, " is shorter than ",
                  "max_position_embeddings ", c.max_seq, " (coshard's attention sees the whole causal prefix: ",
                  "expected null)");
  }
  return {};
}

// num_experts_per_tok, or transformers' default when absent (refused by name where the experts
// are fewer: the key was needed).
Result<std::int64_t> experts_per_token(const Fields& f, std::int64_t experts, std::int64_t fallback) {
  if ((!f.doc.contains("num_experts_per_tok") || f.doc["num_experts_per_tok"].is_null()) && fallback > experts)
    return fail(ErrorCode::invalid_argument, f.source, ": \"num_experts_per_tok\" is missing, and transformers' default ",
                fallback, " exceeds the ", experts, " experts (expected it set, 1 to ", experts, ")");
  return f.integer("num_experts_per_tok", fallback);
}

Result<void> read_qwen3_moe(const Fields& f, LlamaConfig& c) {
  COSHARD_TRY_ASSIGN(c.moe.experts, f.integer("num_experts"));
  COSHARD_TRY_ASSIGN(c.moe.top_k, experts_per_token(f, c.moe.experts, 8));
  COSHARD_TRY_ASSIGN(c.moe.intermediate, f.integer("moe_intermediate_size"));
  COSHARD_TRY_ASSIGN(c.moe.renormalize, f.boolean("norm_topk_prob", false));
  COSHARD_TRY_ASSIGN(c.moe.sparse_step, f.integer("decoder_sparse_step", std::int64_t{1}));
  c.moe.dense_layers.clear();
  if (f.doc.contains("mlp_only_layers") && !f.doc["mlp_only_layers"].is_null()) {
    const json& layers = f.doc["mlp_only_layers"];
    if (!layers.is_array())
      return fail(ErrorCode::invalid_argument, f.source, ": \"mlp_only_layers\"=", async::bounded_echo(layers.dump()),
                  " (expected a list of layer indices)");
    for (const auto& l : layers) {
      if (!l.is_number_integer())
        return fail(ErrorCode::invalid_argument, f.source, ": \"mlp_only_layers\" holds ", async::bounded_echo(l.dump()),
                    " (expected layer indices)");
      c.moe.dense_layers.push_back(l.get<std::int64_t>());
    }
  }
  return {};
}

}  // namespace

std::string_view family_title(HfFamily family) { return modules::to_string(family); }

std::optional<HfFamily> family_named(const json& doc) {
  for (const auto& n : kFamilies) {
    if (doc.contains("model_type") && doc["model_type"] == n.model_type) return n.family;
    if (doc.contains("architectures") && doc["architectures"].is_array())
      for (const auto& a : doc["architectures"])
        if (a == n.architecture) return n.family;
  }
  return std::nullopt;
}

Result<void> read_family_fields(const Fields& f, HfFamily family, LlamaConfig& c) {
  c.family = family;
  c.qk_norm = family == HfFamily::qwen3 || family == HfFamily::qwen3_moe;
  if (family != HfFamily::llama) COSHARD_TRY(refuse_sliding_window(f, c));
  if (family == HfFamily::mixtral) {
    COSHARD_TRY_ASSIGN(c.moe.experts, f.integer("num_local_experts"));
    COSHARD_TRY_ASSIGN(c.moe.top_k, experts_per_token(f, c.moe.experts, 2));
    c.moe.renormalize = true;
    COSHARD_TRY_ASSIGN(const double jitter, f.number(f.doc, "router_jitter_noise", 0.0));
    if (jitter != 0)
      return fail(ErrorCode::unsupported, f.source, ": \"router_jitter_noise\"=", jitter,
                  " (expected 0: coshard's router adds no noise)");
  } else if (family == HfFamily::qwen3_moe) {
    COSHARD_TRY(read_qwen3_moe(f, c));
  }
  if (is_moe(family)) COSHARD_TRY(read_aux_loss(f, c));
  return {};
}

void write_family_fields(json& doc, const LlamaConfig& c) {
  if (c.family == HfFamily::llama) return;
  const Named& n = named(c.family);
  doc["architectures"] = {n.architecture};
  doc["model_type"] = n.model_type;
  for (const char* llama_only : {"mlp_bias", "pretraining_tp"}) doc.erase(llama_only);
  // (a window the folder gives is kept: read, it is no shorter than the positions or not used)
  if (!doc.contains("sliding_window")) doc["sliding_window"] = nullptr;
  if (c.family == HfFamily::mixtral) {
    doc.erase("attention_bias");
    doc["num_local_experts"] = c.moe.experts;
    doc["router_jitter_noise"] = 0.0;
  } else {
    doc["use_sliding_window"] = false;
  }
  if (c.family == HfFamily::qwen3_moe) {
    doc["num_experts"] = c.moe.experts;
    doc["moe_intermediate_size"] = c.expert_width();
    doc["norm_topk_prob"] = c.moe.renormalize;
    doc["decoder_sparse_step"] = c.moe.sparse_step;
    doc["mlp_only_layers"] = c.moe.dense_layers;
  }
  if (is_moe(c.family)) {
    doc["num_experts_per_tok"] = c.moe.top_k;
    doc["output_router_logits"] = c.moe.aux_loss_coef > 0;
    // Without the loss the weight is the folder's (unused while output_router_logits is false).
    if (c.moe.aux_loss_coef > 0 || !doc.contains("router_aux_loss_coef"))
      doc["router_aux_loss_coef"] = c.moe.aux_loss_coef > 0 ? c.moe.aux_loss_coef : 0.001;
  }
}

void add_head_norm_mappings(std::vector<Mapping>& m, const LlamaConfig& c, const std::string& prefix,
                            const std::string& hf_layer) {
  if (!c.qk_norm) return;
  const Shape shape{c.resolved_head_dim()};
  m.push_back({prefix + "qk_norm.q.weight", shape, {{hf_layer + "self_attn.q_norm.weight", 0}}});
  m.push_back({prefix + "qk_norm.k.weight", shape, {{hf_layer + "self_attn.k_norm.weight", 0}}});
}

void add_moe_mappings(std::vector<Mapping>& m, const LlamaConfig& c, const std::string& prefix,
                      const std::string& hf_layer) {
  const std::int64_t D = c.dim, E = c.moe.experts, W = c.expert_width();
  const bool mixtral = c.family == HfFamily::mixtral;
  const std::string hf = hf_layer + (mixtral ? "block_sparse_moe." : "mlp.");
  const char* gate = mixtral ? "w1.weight" : "gate_proj.weight";
  const char* up = mixtral ? "w3.weight" : "up_proj.weight";
  const char* down = mixtral ? "w2.weight" : "down_proj.weight";
  m.push_back({prefix + "router.weight", Shape{E, D}, {{hf + "gate.weight", 0}}});
  for (std::int64_t e = 0; e < E; ++e) {
    const std::string ours = prefix + "experts." + std::to_string(e) + ".", theirs = hf + "experts." + std::to_string(e) + ".";
    m.push_back({ours + "gate_up.weight", Shape{2 * W, D}, {{theirs + gate, W}, {theirs + up, W}}});
    m.push_back({ours + "down.weight", Shape{D, W}, {{theirs + down, 0}}});
  }
}

}  // namespace coshard::zero::detail
