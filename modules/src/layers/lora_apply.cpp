// apply_lora (lora.hpp): which linear layers get adapters (globs, transformers' names by PEFT's
// rule, a Llama's fused projections one adapter each) and where each sits in its layer, whole or
// split with a tensor-parallel one.
#include "coshard/modules/lora.hpp"
#include "coshard/modules/moe.hpp"

#include <algorithm>
#include <array>
#include <functional>
#include <set>
#include <tuple>
#include <cmath>
#include <map>
#include <optional>
#include <unordered_set>

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/llama_layers.hpp"
#include "random.hpp"

namespace coshard::modules {
namespace {

Result<void> check_options(const LoraOptions& o) {
  if (o.targets.empty())
    return fail(ErrorCode::invalid_argument, "apply_lora: no targets (which linear layers to adapt: globs over their paths)");
  if (o.rank < 1) return fail(ErrorCode::invalid_argument, "LoRA rank=", o.rank, ": expected >= 1");
  if (!std::isfinite(o.alpha) || !(o.alpha > 0))
    return fail(ErrorCode::invalid_argument, "LoRA alpha=", o.alpha, ": expected a finite value > 0");
  if (!std::isfinite(o.dropout) || o.dropout < 0 || o.dropout >= 1)
    return fail(ErrorCode::invalid_argument, "LoRA dropout=", o.dropout, ": expected a value in [0, 1)");
  return {};
}

// One adapter to make: on rows [begin, end) of the Linear at `linear`.
struct Planned {
  std::string linear;
  Linear* layer = nullptr;
  std::string name;  // the child's
  std::string hf_projection;
  std::int64_t layer_index = -1;
  std::int64_t begin = 0, end = 0;
};

// Where a planned adapter sits: on a whole layer, or split as its tensor-parallel layer is (rows
// of a column-parallel layer: whole segments of its split; a row-parallel layer's input columns).
Result<LoraPlacement> placement_of(const Planned& p, const LoraOptions& o) {
  const Linear& l = *p.layer;
  LoraPlacement w{.in = l.in_features(), .row_begin = p.begin, .row_end = p.end, .out = l.out_features(),
                  .whole_in = l.in_features(), .whole_row_begin = p.begin, .whole_row_end = p.end, .row_segments = {}};
  const TensorSplit* split = l.weight().split();
  if (!split || split->parts <= 1) return w;
  if (!o.tensor_group)
    return fail(ErrorCode::invalid_argument, "LoRA on ", p.linear, ": the layer is part ", split->index, " of ", split->parts,
                " of a tensor-parallel split; give LoraOptions::tensor_group (the tensor group it was split over)");
  if (o.tensor_group->size() != split->parts || o.tensor_group->rank() != split->index)
    return fail(ErrorCode::invalid_argument, "LoRA on ", p.linear, ": the layer is part ", split->index, " of ", split->parts,
                ", and LoraOptions::tensor_group is rank ", o.tensor_group->rank(), " of ", o.tensor_group->size());
  w.group = o.tensor_group;
  if (split->dim == 1) {  // row-parallel: its input columns
    w.split = LoraSplit::input_columns;
    w.whole_in = split->whole[1];
    return w;
  }
  // Column-parallel: the local rows [begin, end) are this rank's parts of whole segments.
  w.split = LoraSplit::output_rows;
  std::int64_t local = 0, whole = 0;
  bool started = false;
  for (const std::int64_t segment : split->segments) {
    const std::int64_t part = segment / split->parts;
    if (local == p.begin) {
      started = true;
      w.whole_row_begin = whole;
    }
    if (started) w.row_segments.push_back(segment);
    local += part;
    whole += segment;
    if (started && local == p.end) {
      w.whole_row_end = whole;
      if (w.row_segments.size() == 1) w.row_segments.clear();
      return w;
    }
  }
  return fail(ErrorCode::invalid_argument, "LoRA on ", p.linear, ": rows [", p.begin, ", ", p.end,
              ") do not cover whole segments of its tensor-parallel split");
}

// Freezes the model, then adds the planned adapters (their dropout seeds told apart by path).
Result<std::vector<LoraAdapterInfo>> make_adapters(Module& model, const std::vector<Planned>& plan, const LoraOptions& o) {
  for (const auto& p : plan)
    if (!p.layer->lora_adapters().empty())
      return fail(ErrorCode::invalid_argument, "apply_lora: ", p.linear, " already has adapters");
  COSHARD_TRY(model.set_trainable(false));
  std::vector<LoraAdapterInfo> made;
  for (const auto& p : plan) {
    const std::string path = p.linear + "." + p.name;
    LoraOptions own = o;
    own.seed = detail::SplitMix64{o.seed ^ detail::fnv1a(path)}.next();
    COSHARD_TRY_ASSIGN(const LoraPlacement where, placement_of(p, o));
    COSHARD_TRY_ASSIGN(LoraAdapter * adapter, p.layer->add_lora(p.name, where, own));
    // (an adapter on an expert-parallel expert is that expert's: held by its expert rank alone)
    if (const int experts = p.layer->parameters().front()->expert_parallel(); experts > 1)
      for (const auto& param : adapter->parameters()) COSHARD_TRY(param->set_expert_parallel(experts));
    made.push_back({path, p.linear, p.hf_projection, p.layer_index, adapter});
  }
  return made;
}

// The model's Linear layers by path, in model order (adapters' own excluded: they are not Linear).
std::vector<std::pair<std::string, Linear*>> linears_of(Module& model) {
  std::vector<std::pair<std::string, Linear*>> out;
  model.for_each_module([&](const std::string& path, Module& m) {
    if (auto* l = dynamic_cast<Linear*>(&m)) out.emplace_back(path, l);
  });
  return out;
}

// A target that matched no linear layer: its error, naming what it did match when that was not
// a linear layer.
Unexpected matched_nothing(Module& model, const std::string& target) {
  std::string others;
  model.for_each_module([&](const std::string& path, Module& m) {
    if (!path.empty() && others.size() < 200 && glob_matches(target, path))
      others += (others.empty() ? "" : ", ") + path + " (" + std::string(m.type_name()) + ")";
  });
  return fail(ErrorCode::invalid_argument, "LoRA target \"", target, "\" matches no linear layer",
              others.empty() ? std::string(" (nor any module)") : " (it matches " + others + ")");
}

// Any model: one adapter per matched Linear, over all its rows.
Result<std::vector<LoraAdapterInfo>> adapt_by_glob(Module& model, const LoraOptions& options) {
  const auto linears = linears_of(model);
  std::vector<Planned> plan;
  std::unordered_set<const Linear*> chosen;
  for (const auto& target : options.targets) {
    bool matched = false;
    for (const auto& [path, layer] : linears) {
      if (!glob_matches(target, path) && !peft_list_matches(target, path)) continue;
      matched = true;
      if (chosen.insert(layer).second) plan.push_back({path, layer, "lora", "", -1, 0, layer->out_features()});
    }
    if (!matched) return matched_nothing(model, target);
  }
  // (in model order, whatever the targets' order)
  std::vector<Planned> ordered;
  for (const auto& [path, layer] : linears)
    for (const auto& p : plan)
      if (p.layer == layer) ordered.push_back(p);
  return make_adapters(model, ordered, options);
}

// make_llama's blocks, as found in a model: h{l}.attn.rope (its heads), .attn.qkv, .attn.proj,
// and .mlp.gate_up and .mlp.down or a mixture of experts (.mlp.moe), for every l from 0.
struct LlamaLayout {
  std::int64_t layers = 0, dim = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
  std::vector<SparseMoe*> moe;  // per layer: its mixture of experts (null: a dense MLP)
};

std::optional<LlamaLayout> llama_layout(Module& model) {
  std::map<std::string, Module*> by_path;
  model.for_each_module([&](const std::string& path, Module& m) { by_path[path] = &m; });
  LlamaLayout c;
  for (;; ++c.layers) {
    const std::string h = "h" + std::to_string(c.layers) + ".";
    auto* rope = by_path.contains(h + "attn.rope") ? dynamic_cast<RotaryEmbedding*>(by_path[h + "attn.rope"]) : nullptr;
    if (!rope) break;
    auto linear = [&](const std::string& name) {
      return by_path.contains(h + name) ? dynamic_cast<Linear*>(by_path[h + name]) : nullptr;
    };
    Linear *qkv = linear("attn.qkv"), *proj = linear("attn.proj"), *gate_up = linear("mlp.gate_up"), *down = linear("mlp.down");
    auto* moe = by_path.contains(h + "mlp.moe") ? dynamic_cast<SparseMoe*>(by_path[h + "mlp.moe"]) : nullptr;
    const bool experts = moe != nullptr;
    if (!qkv || !proj || (!experts && (!gate_up || !down))) return std::nullopt;
    LlamaLayout here{0, proj->out_features(), rope->n_heads(), rope->n_kv_heads(), rope->head_dim(),
                     experts ? c.intermediate : gate_up->out_features() / 2, {}};
    if (qkv->out_features() != (here.heads + 2 * here.kv_heads) * here.head_dim || (!experts && down->out_features() != here.dim))
      return std::nullopt;
    if (c.layers > 0 && (here.dim != c.dim || here.heads != c.heads || here.kv_heads != c.kv_heads ||
                         here.head_dim != c.head_dim || (c.intermediate > 0 && here.intermediate != c.intermediate)))
      return std::nullopt;
    here.layers = c.layers;
    here.moe = std::move(c.moe);
    here.moe.push_back(moe);
    c = std::move(here);
  }
  if (c.layers == 0) return std::nullopt;
  return c;
}

// A MoE layer's experts by transformers' names (Qwen3-MoE's gate_proj, up_proj, down_proj under
// mlp.experts.E; Mixtral's w1, w3, w2 under block_sparse_moe.experts.E): gate and up are the rows
// of coshard's fused gate_up, down its down.
struct ExpertProjection {
  std::string hf;
  const char* linear;  // under h{l}.mlp.moe.experts.{e}
  std::int64_t begin, end;
};
std::array<ExpertProjection, 3> expert_projections(const SparseMoe& moe) {
  const bool mixtral = moe.options().mixtral_names;
  const std::int64_t W = moe.options().intermediate, D = moe.options().dim;
  return {{{mixtral ? "w1" : "gate_proj", "gate_up", 0, W},
           {mixtral ? "w3" : "up_proj", "gate_up", W, 2 * W},
           {mixtral ? "w2" : "down_proj", "down", 0, D}}};
}

// (layer, expert, projection) triples a target names: by transformers' name, or by the path of an
// expert's linear layer (each projection it holds).
using ExpertsWanted = std::set<std::tuple<std::int64_t, std::int64_t, std::size_t>>;
bool match_experts(const LlamaLayout& c, std::string_view bare, const std::string& target, ExpertsWanted& wanted) {
  bool matched = false;
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const SparseMoe* moe = c.moe[static_cast<std::size_t>(l)];
    if (!moe) continue;
    const auto projections = expert_projections(*moe);
    for (std::int64_t e = 0; e < moe->options().experts; ++e) {
      const std::string path = "h" + std::to_string(l) + ".mlp.moe.experts." + std::to_string(e) + ".";
      for (std::size_t j = 0; j < projections.size(); ++j)
        if (peft_list_matches(bare, llama_expert_module_name(l, e, projections[j].hf)) ||
            glob_matches(target, path + projections[j].linear)) {
          wanted.emplace(l, e, j);
          matched = true;
        }
    }
  }
  return matched;
}

Result<void> plan_experts(const LlamaLayout& c, std::int64_t l, const ExpertsWanted& wanted,
                          const std::function<Linear*(const std::string&)>& find, std::vector<Planned>& plan) {
  const SparseMoe* moe = c.moe[static_cast<std::size_t>(l)];
  if (!moe) return {};
  const auto projections = expert_projections(*moe);
  // Expert parallelism: each expert rank holds other experts in the same places, so an adapter goes
  // on every expert of the layer or on none (a few would make the ranks' models differ).
  for (std::size_t j = 0; j < projections.size() && moe->expert_parallel() > 1; ++j) {
    std::int64_t count = 0;
    for (std::int64_t e = 0; e < moe->options().experts; ++e) count += wanted.contains({l, e, j}) ? 1 : 0;
    if (count != 0 && count != moe->options().experts)
      return fail(ErrorCode::invalid_argument, "LoRA targets: ", count, " of the ", moe->options().experts,
                  " experts' ", projections[j].hf, " in layer h", l, " with the experts over ", moe->expert_parallel(),
                  " expert-parallel ranks: each rank holds other experts in the same places, so adapt every expert of a ",
                  "layer or none (", projections[j].hf, " alone adapts every expert's)");
  }
  for (std::int64_t e = 0; e < moe->options().experts; ++e)
    for (std::size_t j = 0; j < projections.size(); ++j) {
      if (!wanted.contains({l, e, j}) || !moe->expert(e)) continue;  // (another expert rank's)
      const ExpertProjection& p = projections[j];
      const std::string path = "h" + std::to_string(l) + ".mlp.moe.experts." + std::to_string(e) + "." + p.linear;
      Linear* layer = find(path);
      if (!layer || layer->out_features() < p.end)
        return fail(ErrorCode::internal, "apply_lora: no linear layer ", path, " of at least ", p.end, " outputs");
      plan.push_back({path, layer, "lora_" + p.hf, p.hf, l, p.begin, p.end});
    }
  return {};
}

// make_llama's model: Hugging Face's projection names, one adapter per projection of a fused layer.
Result<std::vector<LoraAdapterInfo>> adapt_llama(Module& model, const LlamaLayout& c, const LoraOptions& options) {
  const std::int64_t hd = c.head_dim, q = c.heads * hd, kv = c.kv_heads * hd, I = c.intermediate;
  // Each block's linear layers and the Hugging Face projections they hold (rows of the output).
  struct Projection {
    const char* hf;
    const char* linear;  // under h{l}
    std::int64_t begin, end;
  };
  constexpr std::size_t kFirstMlpProjection = 4;  // gate_proj, up_proj, down_proj from here
  const Projection projections[] = {{"q_proj", "attn.qkv", 0, q},           {"k_proj", "attn.qkv", q, q + kv},
                                    {"v_proj", "attn.qkv", q + kv, q + 2 * kv}, {"o_proj", "attn.proj", 0, c.dim},
                                    {"gate_proj", "mlp.gate_up", 0, I},        {"up_proj", "mlp.gate_up", I, 2 * I},
                                    {"down_proj", "mlp.down", 0, c.dim}};
  const auto linears = linears_of(model);
  const std::function<Linear*(const std::string&)> find = [&](const std::string& path) -> Linear* {
    for (const auto& [p, l] : linears)
      if (p == path) return l;
    return nullptr;
  };
  ExpertsWanted experts;
  // Every (layer, projection) a target asks for, then in model order.
  std::vector<std::vector<bool>> wanted(static_cast<std::size_t>(c.layers), std::vector<bool>(std::size(projections)));
  std::vector<std::pair<std::string, Linear*>> other;  // non-block layers (an untied head), by glob
  for (const auto& target : options.targets) {
    const std::string_view bare = std::string_view(target).starts_with("*.") ? std::string_view(target).substr(2) : target;
    bool matched = false;
    // transformers' module names, by PEFT's rule: "q_proj", "self_attn.q_proj",
    // "model.layers.3.self_attn.q_proj" (that block's alone), "lm_head".
    for (std::int64_t l = 0; l < c.layers; ++l)
      for (std::size_t j = 0; j < std::size(projections); ++j)
        if (!(j >= kFirstMlpProjection && c.moe[static_cast<std::size_t>(l)]) &&  // (a MoE layer: its experts')
            peft_list_matches(bare, llama_module_name(l, projections[j].hf))) {
          matched = true;
          wanted[static_cast<std::size_t>(l)][j] = true;
        }
    matched = match_experts(c, bare, target, experts) || matched;
    if (peft_list_matches(bare, "lm_head"))
      if (Linear* head = find("head")) {
        matched = true;
        if (std::find(other.begin(), other.end(), std::pair<std::string, Linear*>{"head", head}) == other.end())
          other.emplace_back("head", head);
      }
    if (matched) continue;
    for (const auto& [path, layer] : linears) {
      if (!glob_matches(target, path)) continue;
      bool in_block = false;
      for (std::int64_t l = 0; l < c.layers; ++l)
        for (std::size_t j = 0; j < std::size(projections); ++j)
          if (path == "h" + std::to_string(l) + "." + projections[j].linear) {
            wanted[static_cast<std::size_t>(l)][j] = true;
            in_block = true;
          }
      if (!in_block && std::find(other.begin(), other.end(), std::pair{path, layer}) == other.end()) other.emplace_back(path, layer);
      matched = true;
    }
    if (!matched) return matched_nothing(model, target);
  }
  std::vector<Planned> plan;
  for (std::int64_t l = 0; l < c.layers; ++l)
    for (std::size_t j = 0; j < std::size(projections); ++j) {
      if (j == kFirstMlpProjection) COSHARD_TRY(plan_experts(c, l, experts, find, plan));  // (after the attention's)
      if (!wanted[static_cast<std::size_t>(l)][j]) continue;
      const Projection& p = projections[j];
      const std::string path = "h" + std::to_string(l) + "." + p.linear;
      Linear* layer = find(path);
      if (!layer || layer->out_features() < p.end)
        return fail(ErrorCode::internal, "apply_lora: no linear layer ", path, " of at least ", p.end, " outputs");
      plan.push_back({path, layer, std::string("lora_") + p.hf, p.hf, l, p.begin, p.end});
    }
  for (const auto& [path, layer] : other) plan.push_back({path, layer, "lora", "", -1, 0, layer->out_features()});
  return make_adapters(model, plan, options);
}

}  // namespace

bool peft_list_matches(std::string_view entry, std::string_view name) noexcept {
  return name == entry || (name.size() > entry.size() && name.ends_with(entry) && name[name.size() - entry.size() - 1] == '.');
}

std::string llama_expert_module_name(std::int64_t layer, std::int64_t expert, std::string_view projection) {
  const bool mixtral = projection == "w1" || projection == "w2" || projection == "w3";
  return "model.layers." + std::to_string(layer) + (mixtral ? ".block_sparse_moe" : ".mlp") + ".experts." +
         std::to_string(expert) + "." + std::string(projection);
}

std::string llama_module_name(std::int64_t layer, std::string_view projection) {
  const bool attention = projection == "q_proj" || projection == "k_proj" || projection == "v_proj" || projection == "o_proj";
  return "model.layers." + std::to_string(layer) + (attention ? ".self_attn." : ".mlp.") + std::string(projection);
}

std::vector<std::string> default_lora_targets(Module& model) {
  if (llama_layout(model)) return {"q_proj", "v_proj"};
  bool gpt = false;
  model.for_each_module([&](const std::string& path, Module& m) {
    gpt = gpt || (path.ends_with(".attn.qkv") && dynamic_cast<Linear*>(&m) != nullptr);
  });
  if (gpt) return {"*.attn.qkv"};
  return {};
}

Result<std::vector<LoraAdapterInfo>> apply_lora(Module& model, const LoraOptions& options) {
  COSHARD_TRY(check_options(options));
  if (const auto llama = llama_layout(model)) return adapt_llama(model, *llama, options);
  return adapt_by_glob(model, options);
}

}  // namespace coshard::modules
