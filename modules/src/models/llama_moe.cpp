// The mixture-of-experts part of a Llama-family config (MoeConfig) and of make_llama: which
// layers get a SparseMoe block, and the checks of its settings.
#include <cmath>
#include <set>

#include "models/llama_mlp.hpp"

#include "coshard/modules/layers.hpp"

namespace coshard::modules {

Result<void> LlamaConfig::validate_moe() const {
  const MoeConfig& m = moe;
  if ((family == HfFamily::mixtral || family == HfFamily::qwen3_moe) && !m.enabled())
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.experts=0: a ", to_string(family),
                " has experts (expected at least 1)");
  if ((family == HfFamily::llama || family == HfFamily::qwen3) && m.enabled())
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.experts=", m.experts, ": the family (", to_string(family),
                ") has no experts: name a Mixtral or Qwen3-MoE family");
  if (!m.enabled()) {
    if (m.experts < 0) return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.experts=", m.experts, ": expected >= 0");
    return {};
  }
  if (m.experts > std::int64_t{1} << 16)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.experts=", m.experts, ": expected at most 65536");
  if (m.top_k < 1 || m.top_k > m.experts)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.top_k=", m.top_k, " (num_experts_per_tok): expected 1 to ",
                m.experts, " (the experts)");
  if (m.intermediate < 0 || m.intermediate > std::int64_t{1} << 24)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.intermediate=", m.intermediate,
                ": expected 0 (the MLP's width) to 2^24");
  if (m.sparse_step < 1 || m.sparse_step > layers)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.sparse_step=", m.sparse_step,
                " (decoder_sparse_step): expected 1 to the layers, ", layers);
  std::set<std::int64_t> seen;
  for (const std::int64_t l : m.dense_layers) {
    if (l < 0 || l >= layers)
      return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.dense_layers: layer ", l,
                  " (mlp_only_layers): expected 0 to ", layers - 1);
    if (!seen.insert(l).second)
      return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.dense_layers: layer ", l, " twice");
  }
  if (moe_layers() == 0)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe: ", m.experts, " experts but no layer takes them ",
                "(sparse_step ", m.sparse_step, ", ", m.dense_layers.size(), " dense layers of ", layers, ")");
  if (!(m.aux_loss_coef >= 0) || !std::isfinite(m.aux_loss_coef))
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.aux_loss_coef=", m.aux_loss_coef,
                " (router_aux_loss_coef): expected a finite value >= 0");
  if (family == HfFamily::mixtral) {
    // Mixtral's block has no such settings: a config with them is not a Mixtral.
    if (!m.renormalize)
      return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.renormalize=false: a Mixtral renormalises its top k ",
                  "(a Qwen3-MoE need not: norm_topk_prob)");
    if (m.sparse_step != 1 || !m.dense_layers.empty())
      return fail(ErrorCode::invalid_argument, "LlamaConfig.moe: sparse_step=", m.sparse_step, " and ",
                  m.dense_layers.size(), " dense layers: a Mixtral has experts in every layer (a Qwen3-MoE need not)");
    if (m.intermediate != 0 && m.intermediate != intermediate)
      return fail(ErrorCode::invalid_argument, "LlamaConfig.moe.intermediate=", m.intermediate,
                  ": a Mixtral's experts have the MLP's width, intermediate=", intermediate,
                  " (set the MLP's width instead, --intermediate, or take a Qwen3-MoE, whose experts have their own)");
  }
  const double total = static_cast<double>(moe_layers()) * static_cast<double>(m.experts) * 3.0 *
                       static_cast<double>(dim) * static_cast<double>(expert_width());
  if (total > 1e15)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.moe: ", total, " expert parameters (expected at most 1e15)");
  return {};
}

Result<void> check_expert_parallel(const LlamaConfig& c, std::int64_t ranks) {
  COSHARD_TRY(c.validate());
  if (ranks < 1) return fail(ErrorCode::invalid_argument, "expert-parallel size ", ranks, ": expected at least 1");
  if (ranks == 1) return {};
  if (!c.moe.enabled())
    return fail(ErrorCode::invalid_argument, "expert-parallel size ", ranks,
                ": the model has no experts (a dense model: use data parallelism, expert-parallel size 1)");
  if (c.moe.experts % ranks != 0)
    return fail(ErrorCode::invalid_argument, "expert-parallel size ", ranks, " does not divide the experts (",
                c.moe.experts, "): expected a divisor of ", c.moe.experts);
  return {};
}

std::string_view to_string(HfFamily family) noexcept {
  switch (family) {
    case HfFamily::mixtral: return "Mixtral";
    case HfFamily::qwen3: return "Qwen3";
    case HfFamily::qwen3_moe: return "Qwen3-MoE";
    default: return "Llama";
  }
}

namespace detail {

Result<std::unique_ptr<Module>> make_llama_mlp(const LlamaConfig& c, std::int64_t layer,
                                               const std::shared_ptr<RouterBalance>& balance,
                                               collectives::Communicator* expert_group) {
  const Init weight = Init::normal(c.init_std);
  auto mlp = std::make_unique<Sequential>();
  mlp->add("norm", std::make_unique<RmsNorm>(c.dim, static_cast<float>(c.norm_eps)));
  if (c.moe_layer(layer)) {
    const SparseMoe::Options o{.dim = c.dim, .experts = c.moe.experts, .top_k = c.moe.top_k,
                               .intermediate = c.expert_width(), .renormalize = c.moe.renormalize, .init = weight,
                               .every_expert_runs = c.moe.every_expert_runs,
                               .mixtral_names = c.family == HfFamily::mixtral, .expert_group = expert_group};
    COSHARD_TRY_ASSIGN(auto moe, SparseMoe::create(o, balance));
    mlp->add("moe", std::move(moe));
  } else {
    mlp->add("gate_up", std::make_unique<Linear>(c.dim, 2 * c.intermediate, false, weight));
    mlp->add("swiglu", std::make_unique<SwiGlu>());
    mlp->add("down", std::make_unique<Linear>(c.intermediate, c.dim, false, weight));
  }
  return std::unique_ptr<Module>(std::make_unique<Residual>(std::move(mlp)));
}

std::shared_ptr<RouterBalance> make_router_balance(const LlamaConfig& c) {
  if (!c.moe.enabled()) return nullptr;
  return std::make_shared<RouterBalance>(c.moe.experts, c.moe.top_k, c.moe.aux_loss_coef);
}

}  // namespace detail
}  // namespace coshard::modules
