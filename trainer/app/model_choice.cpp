#include "model_choice.hpp"

#include <algorithm>
#include <cstdio>

#include "coshard/modules/layers.hpp"
#include "coshard/zero/hf_llama.hpp"

namespace coshard::train_app {

namespace {

std::string millions(std::int64_t n) {
  char text[32];
  std::snprintf(text, sizeof text, n >= 1'000'000'000 ? "%.2fB" : "%.1fM",
                n >= 1'000'000'000 ? static_cast<double>(n) / 1e9 : static_cast<double>(n) / 1e6);
  return text;
}

// The mixture of experts' routing and its objective (the experts' shapes are the parameters'): a
// resume with another load-balancing weight, or another fetch of the experts (which moves the
// unused experts), is refused naming both.
std::string moe_identity(const modules::LlamaConfig& l) {
  if (!l.moe.enabled()) return "";
  std::string dense;
  for (const std::int64_t d : l.moe.dense_layers) dense += (dense.empty() ? "" : ",") + std::to_string(d);
  char coef[64];
  std::snprintf(coef, sizeof coef, " router_aux_loss_coef %.17g", l.moe.aux_loss_coef);
  return " experts " + std::to_string(l.moe.experts) + " top " + std::to_string(l.moe.top_k) +
         (l.moe.renormalize ? " renormalized" : "") + " sparse_step " + std::to_string(l.moe.sparse_step) +
         (dense.empty() ? "" : " dense " + dense) + coef + (l.moe.every_expert_runs ? " expert_fetch all" : "");
}

}  // namespace

std::int64_t ModelChoice::parameter_count() const noexcept {
  return kind == Kind::gpt ? gpt.parameter_count() : llama.parameter_count();
}

std::string ModelChoice::describe() const {
  if (kind == Kind::gpt)
    return "GPT (" + std::to_string(gpt.layers) + " layers, dim " + std::to_string(gpt.dim) + ", " +
           std::to_string(gpt.heads) + " heads)";
  return (preset.empty() ? std::string("Llama") : preset) + " (" + llama.describe() + ")";
}

std::string ModelChoice::identity(std::int64_t seq) const {
  if (kind == Kind::gpt)
    return "gpt layers " + std::to_string(gpt.layers) + " dim " + std::to_string(gpt.dim) + " heads " +
           std::to_string(gpt.heads) + " seq " + std::to_string(seq);
  const auto& l = llama;
  char rope[160];
  std::snprintf(rope, sizeof rope, " rope_theta %.17g scaling %.17g/%.17g/%.17g/%lld eps %.17g", l.rope_theta,
                l.rope_scaling.factor, l.rope_scaling.low_freq_factor, l.rope_scaling.high_freq_factor,
                static_cast<long long>(l.rope_scaling.original_max_positions), l.norm_eps);
  return "llama layers " + std::to_string(l.layers) + " dim " + std::to_string(l.dim) + " heads " +
         std::to_string(l.heads) + " kv_heads " + std::to_string(l.kv_heads) + " head_dim " +
         std::to_string(l.resolved_head_dim()) + " intermediate " + std::to_string(l.intermediate) +
         (l.tie_embeddings ? " tied" : "") + rope + moe_identity(l) + " seq " + std::to_string(seq);
}

Result<std::unique_ptr<modules::Sequential>> ModelChoice::build() const {
  return kind == Kind::gpt ? modules::make_gpt(gpt) : modules::make_llama(llama);
}

Result<std::unique_ptr<modules::Sequential>> ModelChoice::build(collectives::Communicator& tensor_group) const {
  if (tensor_group.size() == 1) return build();
  if (kind == Kind::gpt)
    return fail(ErrorCode::unsupported, "--tensor-parallel ", tensor_group.size(),
                " with --model gpt: tensor parallelism splits a Llama (expected --model llama, or --tensor-parallel 1)");
  auto model = modules::make_llama(llama, tensor_group);
  if (!model) return fail(std::move(model).error().with_context("--tensor-parallel"));
  return model;
}

Result<std::unique_ptr<modules::Sequential>> ModelChoice::build_expert_parallel(collectives::Communicator& expert_group) const {
  if (expert_group.size() == 1) return build();
  if (kind == Kind::gpt)
    return fail(ErrorCode::invalid_argument, "--expert-parallel ", expert_group.size(),
                " with --model gpt: the GPT has no experts (expected a mixture of experts: --experts, a Mixtral or "
                "Qwen3-MoE preset or folder)");
  auto model = modules::make_llama_expert_parallel(llama, expert_group);
  if (!model) return fail(std::move(model).error().with_context("--expert-parallel"));
  return model;
}

std::int64_t ModelChoice::head_dim() const noexcept {
  return kind == Kind::gpt ? gpt.dim / gpt.heads : llama.resolved_head_dim();
}

std::size_t ModelChoice::activation_bytes(std::int64_t rows, std::int64_t seq, modules::DataType dtype,
                                          modules::ActivationCheckpointing policy, async::Device device,
                                          modules::AttentionKernels attention,
                                          std::int64_t logits_chunk_bytes) const {
  const bool fused = modules::attention_is_fused(device, dtype, head_dim(), attention);
  if (kind == Kind::gpt)
    return modules::gpt_activation_bytes(gpt, rows, seq, dtype, policy.count(gpt.layers), fused, logits_chunk_bytes);
  return modules::llama_activation_bytes(llama, rows, seq, dtype, policy.count(llama.layers), fused,
                                         logits_chunk_bytes);
}

namespace {

// --experts, --experts-per-token, --expert-width over a preset or the flags' Llama: a Llama
// without experts takes Qwen3-MoE's layout (head norms, experts of their own width); a Mixtral
// keeps its own.
Result<void> apply_expert_flags(const ModelFlags& f, modules::LlamaConfig& l) {
  if (f.experts) l.moe.experts = *f.experts;
  if (!l.moe.enabled())
    return fail(ErrorCode::invalid_argument, f.experts_per_token ? "--experts-per-token" : "--expert-width",
                ": the model has no experts (give --experts N, or a mixture-of-experts preset)");
  if (f.experts_per_token) l.moe.top_k = *f.experts_per_token;
  if (f.expert_width) l.moe.intermediate = *f.expert_width;
  if (l.family == modules::HfFamily::llama || l.family == modules::HfFamily::qwen3) {
    l.family = modules::HfFamily::qwen3_moe;
    l.qk_norm = true;
  }
  return {};
}

Result<ModelChoice> resolve_shape(const ModelFlags& f) {
  ModelChoice m;
  const bool moe_shape_given = f.experts || f.experts_per_token || f.expert_width;
  const bool llama_shape_given = f.kv_heads || f.head_dim || f.intermediate || f.rope_theta || f.tie_embeddings ||
                                 moe_shape_given;
  if (!f.init_folder.empty()) {
    // A Hugging Face folder gives the architecture and the shape itself.
    const std::pair<bool, const char*> shape_flags[] = {
        {f.model_given, "--model"}, {!f.preset.empty(), "--preset"}, {f.layers_given, "--layers"},
        {f.dim_given, "--dim"}, {f.heads_given, "--heads"}, {f.kv_heads.has_value(), "--kv-heads"},
        {f.head_dim.has_value(), "--head-dim"}, {f.intermediate.has_value(), "--intermediate"},
        {f.rope_theta.has_value(), "--rope-theta"}, {f.tie_embeddings.has_value(), "--tie-embeddings/--untie-embeddings"},
        {f.vocab_given, "--vocab"}, {f.experts.has_value(), "--experts"},
        {f.experts_per_token.has_value(), "--experts-per-token"}, {f.expert_width.has_value(), "--expert-width"}};
    for (const auto& [given, name] : shape_flags)
      if (given)
        return fail(ErrorCode::invalid_argument, name, " with --init ", f.init_folder,
                    ": the folder's config.json gives the model's shape");
    auto config = zero::read_hf_llama_config(f.init_folder);
    if (!config) return fail(std::move(config).error().with_context("--init"));
    m.kind = ModelChoice::Kind::llama;
    m.llama = *config;
    m.llama.max_seq = std::max(m.llama.max_seq, f.seq);
    m.preset = std::string(modules::to_string(m.llama.family)) + " from " + f.init_folder;
    m.vocab_fixed = true;
    return m;
  }
  if (f.model == "gpt" && f.model_given && !f.preset.empty())
    return fail(ErrorCode::invalid_argument, "--preset ", f.preset, ": the presets are Llama shapes (use --model llama)");
  if (f.model == "gpt" && f.preset.empty()) {
    if (llama_shape_given) {
      const char* name = f.kv_heads ? "--kv-heads" : f.head_dim ? "--head-dim" : f.intermediate ? "--intermediate"
                         : f.rope_theta ? "--rope-theta" : moe_shape_given ? "--experts" : "--tie-embeddings/--untie-embeddings";
      return fail(ErrorCode::invalid_argument, name, " is an option of --model llama");
    }
    m.kind = ModelChoice::Kind::gpt;
    m.gpt = {.vocab = f.vocab, .max_seq = f.seq, .dim = f.dim, .layers = f.layers, .heads = f.heads};
    return m;
  }
  m.kind = ModelChoice::Kind::llama;
  auto& l = m.llama;
  if (!f.preset.empty()) {
    auto p = modules::llama_preset(f.preset);
    if (!p) return fail(std::move(p).error().with_context("--preset"));
    l = p->config;
    m.preset = std::string(p->name);
  } else {
    // From the flags alone: multi-head unless --kv-heads, SwiGLU's 8/3 x dim rounded up to 64.
    l = {.vocab = f.vocab, .dim = f.dim, .layers = f.layers, .heads = f.heads, .kv_heads = f.heads,
         .intermediate = (8 * f.dim / 3 + 63) / 64 * 64};
  }
  if (f.layers_given) l.layers = f.layers;
  if (f.dim_given) l.dim = f.dim;
  if (f.heads_given) {
    l.heads = f.heads;
    if (f.preset.empty()) l.kv_heads = f.heads;
  }
  if (f.kv_heads) l.kv_heads = *f.kv_heads;
  if (f.head_dim) l.head_dim = *f.head_dim;
  if (f.intermediate) l.intermediate = *f.intermediate;
  if (f.rope_theta) l.rope_theta = *f.rope_theta;
  if (f.tie_embeddings) l.tie_embeddings = *f.tie_embeddings;
  if (f.vocab_given) l.vocab = f.vocab;
  if (moe_shape_given) COSHARD_TRY(apply_expert_flags(f, l));
  l.max_seq = std::max(l.max_seq, f.seq);
  m.vocab_fixed = !f.preset.empty() || f.vocab_given;
  const bool changed = f.layers_given || f.dim_given || f.heads_given || f.kv_heads || f.head_dim || f.intermediate ||
                       f.vocab_given || f.rope_theta || f.tie_embeddings || moe_shape_given;
  if (changed && !m.preset.empty()) m.preset += " (changed)";
  if (auto ok = l.validate(); !ok) return fail(std::move(ok).error().with_context("--model llama"));
  return m;
}

}  // namespace

Result<ModelChoice> resolve_model(const ModelFlags& f) {
  COSHARD_TRY_ASSIGN(ModelChoice m, resolve_shape(f));
  if (f.router_aux_loss_coef) {
    if (m.kind != ModelChoice::Kind::llama || !m.llama.moe.enabled())
      return fail(ErrorCode::invalid_argument, "--router-aux-loss-coef ", *f.router_aux_loss_coef, ": ", m.describe(),
                  " has no experts (expected a mixture of experts: a Mixtral or Qwen3-MoE folder or preset, or --experts N)");
    m.llama.moe.aux_loss_coef = *f.router_aux_loss_coef;
  }
  if (f.expert_fetch != "routed") {
    if (m.kind != ModelChoice::Kind::llama || !m.llama.moe.enabled())
      return fail(ErrorCode::invalid_argument, "--expert-fetch ", f.expert_fetch, ": ", m.describe(), " has no experts");
    m.llama.moe.every_expert_runs = true;
  }
  return m;
}

std::string describe_presets() {
  std::string out;
  for (const auto& p : modules::llama_presets())
    out += "\n  " + std::string(p.name) + " (" + millions(p.config.parameter_count()) + " parameters): " +
           std::string(p.summary);
  return out;
}

}  // namespace coshard::train_app
