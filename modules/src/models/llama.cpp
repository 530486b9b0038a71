#include "coshard/modules/llama.hpp"

#include <algorithm>
#include <array>
#include <cctype>
#include <cmath>

#include "models/config_checks.hpp"
#include "models/llama_mlp.hpp"

#include "coshard/modules/layers.hpp"
#include "coshard/modules/tensor_parallel.hpp"

namespace coshard::modules {
namespace {

// Llama 3.1's and 3.2's rope_scaling (rope_type "llama3").
constexpr RopeScaling kLlama31Scaling{.factor = 8, .low_freq_factor = 1, .high_freq_factor = 4,
                                      .original_max_positions = 8192};
constexpr RopeScaling kLlama32Scaling{.factor = 32, .low_freq_factor = 1, .high_freq_factor = 4,
                                      .original_max_positions = 8192};

// Mixtral's shape: every layer a SparseMoe of `experts` experts of the MLP's width, top 2.
constexpr LlamaConfig mixtral(LlamaConfig c, std::int64_t experts) {
  c.moe.experts = experts;
  c.moe.top_k = 2;
  c.family = HfFamily::mixtral;
  return c;
}

// Qwen3-MoE's shape: head norms, `experts` experts of `width`, top k, renormalised or not.
constexpr LlamaConfig qwen3_moe(LlamaConfig c, std::int64_t experts, std::int64_t top_k, std::int64_t width,
                                bool renormalize) {
  c.qk_norm = true;
  c.moe.experts = experts;
  c.moe.top_k = top_k;
  c.moe.intermediate = width;
  c.moe.renormalize = renormalize;
  c.family = HfFamily::qwen3_moe;
  return c;
}

const std::array<LlamaPreset, 11> kPresets{{
    {"llama-tiny", "for tests: 2 layers, dim 64",
     LlamaConfig{.vocab = 256, .max_seq = 64, .dim = 64, .layers = 2, .heads = 4, .kv_heads = 2, .head_dim = 16,
                 .intermediate = 128, .rope_theta = 10000.0}},
    {"llama-100m", "a CPU-sized Llama: 12 layers, dim 768, vocabulary 32000, tied embeddings",
     LlamaConfig{.vocab = 32000, .max_seq = 1024, .dim = 768, .layers = 12, .heads = 12, .kv_heads = 4,
                 .head_dim = 64, .intermediate = 2048, .rope_theta = 10000.0, .tie_embeddings = true}},
    {"Llama-3.2-1B", "meta-llama/Llama-3.2-1B's shape",
     LlamaConfig{.vocab = 128256, .max_seq = 131072, .dim = 2048, .layers = 16, .heads = 32, .kv_heads = 8,
                 .head_dim = 64, .intermediate = 8192, .rope_theta = 500000.0, .rope_scaling = kLlama32Scaling,
                 .tie_embeddings = true}},
    {"Llama-3.2-3B", "meta-llama/Llama-3.2-3B's shape",
     LlamaConfig{.vocab = 128256, .max_seq = 131072, .dim = 3072, .layers = 28, .heads = 24, .kv_heads = 8,
                 .head_dim = 128, .intermediate = 8192, .rope_theta = 500000.0, .rope_scaling = kLlama32Scaling,
                 .tie_embeddings = true}},
    {"Llama-3.1-8B", "meta-llama/Llama-3.1-8B's shape",
     LlamaConfig{.vocab = 128256, .max_seq = 131072, .dim = 4096, .layers = 32, .heads = 32, .kv_heads = 8,
                 .head_dim = 128, .intermediate = 14336, .rope_theta = 500000.0, .rope_scaling = kLlama31Scaling}},
    {"mixtral-tiny", "for tests: Mixtral's layout, 2 layers, dim 64, 4 experts of 64, top 2",
     mixtral(LlamaConfig{.vocab = 256, .max_seq = 64, .dim = 64, .layers = 2, .heads = 4, .kv_heads = 2, .head_dim = 16,
                         .intermediate = 64, .rope_theta = 1000000.0},
             4)},
    {"mixtral-50m", "a CPU-sized Mixtral: 8 layers, dim 512, 8 experts of 512, top 2, vocabulary 32000",
     mixtral(LlamaConfig{.vocab = 32000, .max_seq = 1024, .dim = 512, .layers = 8, .heads = 8, .kv_heads = 4,
                         .head_dim = 64, .intermediate = 512, .rope_theta = 1000000.0},
             8)},
    {"Mixtral-8x7B", "mistralai/Mixtral-8x7B-v0.1's shape (8 experts, top 2)",
     mixtral(LlamaConfig{.vocab = 32000, .max_seq = 32768, .dim = 4096, .layers = 32, .heads = 32, .kv_heads = 8,
                         .head_dim = 128, .intermediate = 14336, .rope_theta = 1000000.0},
             8)},
    {"qwen3-moe-tiny", "for tests: Qwen3-MoE's layout, 2 layers, dim 64, 8 experts of 32, top 2, head norms",
     qwen3_moe(LlamaConfig{.vocab = 256, .max_seq = 64, .dim = 64, .layers = 2, .heads = 4, .kv_heads = 2,
                           .head_dim = 16, .intermediate = 128, .rope_theta = 1000000.0, .norm_eps = 1e-6},
               8, 2, 32, true)},
    {"Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B's shape (128 experts of 768, top 8, head norms)",
     qwen3_moe(LlamaConfig{.vocab = 151936, .max_seq = 40960, .dim = 2048, .layers = 48, .heads = 32, .kv_heads = 4,
                           .head_dim = 128, .intermediate = 6144, .rope_theta = 1000000.0, .norm_eps = 1e-6},
               128, 8, 768, true)},
    {"OLMoE-1B-7B", "allenai/OLMoE-1B-7B-0924's shape in Qwen3-MoE's layout (64 experts of 1024, top 8; OLMoE's "
                    "own query and key norms span the whole projection: for --estimate)",
     qwen3_moe(LlamaConfig{.vocab = 50304, .max_seq = 4096, .dim = 2048, .layers = 16, .heads = 16, .kv_heads = 16,
                           .head_dim = 128, .intermediate = 1024, .rope_theta = 10000.0},
               64, 8, 1024, false)},
}};

bool same_name(std::string_view a, std::string_view b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin(), [](char x, char y) {
           return std::tolower(static_cast<unsigned char>(x)) == std::tolower(static_cast<unsigned char>(y));
         });
}

}  // namespace

Result<void> LlamaConfig::validate() const {
  COSHARD_TRY(detail::check_positive("LlamaConfig", "vocab", vocab));
  COSHARD_TRY(detail::check_positive("LlamaConfig", "max_seq", max_seq));
  COSHARD_TRY(detail::check_positive("LlamaConfig", "dim", dim));
  COSHARD_TRY(detail::check_positive("LlamaConfig", "layers", layers));
  COSHARD_TRY(detail::check_positive("LlamaConfig", "heads", heads));
  COSHARD_TRY(detail::check_positive("LlamaConfig", "kv_heads", kv_heads));
  COSHARD_TRY(detail::check_positive("LlamaConfig", "intermediate", intermediate));
  if (head_dim < 0) return fail(ErrorCode::invalid_argument, "LlamaConfig.head_dim=", head_dim, ": expected >= 0 (0: dim / heads)");
  if (head_dim == 0 && dim % heads != 0)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.dim=", dim, ": expected a multiple of heads=", heads,
                " (or set head_dim)");
  if (heads % kv_heads != 0)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.kv_heads=", kv_heads, ": expected a divisor of heads=", heads);
  if (vocab > std::int64_t{1} << 31)
    return fail(ErrorCode::invalid_argument, "LlamaConfig.vocab=", vocab, ": token ids are i32");
  // Sizes a machine could hold, so that the counts below never overflow (configs come from files).
  if (dim > std::int64_t{1} << 20 || intermediate > std::int64_t{1} << 24 || layers > std::int64_t{1} << 16 ||
      heads > std::int64_t{1} << 16 || head_dim > std::int64_t{1} << 16)
    return fail(ErrorCode::invalid_argument, "LlamaConfig: dim=", dim, " intermediate=", intermediate, " layers=", layers,
                " heads=", heads, " head_dim=", head_dim,
                ": expected dim <= 2^20, intermediate <= 2^24, layers, heads and head_dim <= 2^16");
  {
    const double D = static_cast<double>(dim), hd = static_cast<double>(resolved_head_dim());
    const double block = 2 * D + D * static_cast<double>(heads + 2 * kv_heads) * hd + static_cast<double>(heads) * hd * D +
                         3 * D * static_cast<double>(intermediate);
    const double total = 2 * static_cast<double>(vocab) * D + static_cast<double>(layers) * block + D;
    if (total > 1e15)
      return fail(ErrorCode::invalid_argument, "LlamaConfig: ", total, " parameters (expected at most 1e15)");
  }
  COSHARD_TRY(validate_moe());
  if (!(norm_eps > 0) || !std::isfinite(norm_eps))
    return fail(ErrorCode::invalid_argument, "LlamaConfig.norm_eps=", norm_eps, ": expected a finite value > 0");
  if (!(init_std >= 0) || !std::isfinite(init_std))
    return fail(ErrorCode::invalid_argument, "LlamaConfig.init_std=", init_std, ": expected a finite value >= 0");
  // The rotary layer names a bad theta, scaling or odd head_dim itself.
  return RotaryEmbedding(heads, kv_heads, resolved_head_dim(), rope_theta, rope_scaling).check();
}

bool LlamaConfig::moe_layer(std::int64_t l) const noexcept {
  if (!moe.enabled() || moe.sparse_step < 1 || (l + 1) % moe.sparse_step != 0) return false;
  return std::find(moe.dense_layers.begin(), moe.dense_layers.end(), l) == moe.dense_layers.end();
}

std::int64_t LlamaConfig::moe_layers() const noexcept {
  std::int64_t n = 0;
  for (std::int64_t l = 0; l < layers; ++l) n += moe_layer(l) ? 1 : 0;
  return n;
}

namespace {

// The parameters of everything but the MLPs, and of one dense MLP and one expert.
std::int64_t attention_and_ends(const LlamaConfig& c) {
  const std::int64_t hd = c.resolved_head_dim();
  const std::int64_t block = 2 * c.dim                                  // two RMSNorms
                             + (c.qk_norm ? 2 * hd : 0)                 // the head norms
                             + c.dim * (c.heads + 2 * c.kv_heads) * hd  // q, k, v
                             + c.heads * hd * c.dim;                    // o
  return c.vocab * c.dim + c.layers * block + c.dim + (c.tie_embeddings ? 0 : c.dim * c.vocab);
}

}  // namespace

std::int64_t LlamaConfig::parameter_count() const noexcept {
  const std::int64_t sparse = moe_layers(), dense = layers - sparse;
  return attention_and_ends(*this) + dense * 3 * dim * intermediate +
         sparse * (dim * moe.experts + moe.experts * 3 * dim * expert_width());
}

std::int64_t LlamaConfig::active_parameter_count() const noexcept {
  const std::int64_t sparse = moe_layers(), dense = layers - sparse;
  return attention_and_ends(*this) + dense * 3 * dim * intermediate +
         sparse * (dim * moe.experts + moe.top_k * 3 * dim * expert_width());
}

std::string LlamaConfig::describe() const {
  std::string s = std::to_string(layers) + " layers, dim " + std::to_string(dim) + ", " + std::to_string(heads) +
                  " heads (" + std::to_string(kv_heads) + " key/value) of " + std::to_string(resolved_head_dim()) +
                  ", MLP " + std::to_string(intermediate) + ", vocabulary " + std::to_string(vocab);
  if (moe.enabled())
    s += ", " + std::to_string(moe.experts) + " experts of " + std::to_string(expert_width()) + " (top " +
         std::to_string(moe.top_k) + ") in " + std::to_string(moe_layers()) + " layers";
  if (tie_embeddings) s += ", tied embeddings";
  return s;
}

std::span<const LlamaPreset> llama_presets() { return kPresets; }

Result<LlamaPreset> llama_preset(std::string_view name) {
  for (const auto& p : kPresets)
    if (same_name(p.name, name)) return p;
  std::string names;
  for (const auto& p : kPresets) names += (names.empty() ? "" : ", ") + std::string(p.name);
  return fail(ErrorCode::invalid_argument, "Llama preset \"", name, "\": expected one of ", names);
}

std::size_t llama_activation_bytes(const LlamaConfig& c, std::int64_t rows, std::int64_t seq, DataType dtype,
                                   std::int64_t checkpointed_blocks, bool fused_attention,
                                   std::int64_t logits_chunk_bytes) {
  const auto e = static_cast<double>(size_of(dtype));
  const double N = static_cast<double>(rows) * static_cast<double>(seq);  // tokens
  const double D = static_cast<double>(c.dim), V = static_cast<double>(c.vocab);
  const double I = static_cast<double>(c.intermediate);
  const double hd = static_cast<double>(c.resolved_head_dim());
  const double qkv = static_cast<double>(c.heads + 2 * c.kv_heads) * hd, attn = static_cast<double>(c.heads) * hd;
  // Attention's saved probabilities (or the fused kernels' f32 row statistics), in elements of dtype.
  const double probs = static_cast<double>(rows) * static_cast<double>(c.heads) * static_cast<double>(seq) *
                       (fused_attention ? 4.0 / e : static_cast<double>(seq));
  const double stats = N * 4;  // an RMSNorm's rstd, f32 a row
  // A block saves its input, the norm's output, qkv (before and after rotation), attention's
  // output and probabilities, the residual's output, the norm's output, gate | up and SwiGLU's;
  // a MoE block instead the router's logits, its probabilities, weights and places (f32, i32),
  // and for each of a token's k experts its row, gate | up, SwiGLU's and the output (the mean
  // over the layers here).
  const double Ex = static_cast<double>(c.moe.experts), k = static_cast<double>(c.moe.top_k);
  const double W = static_cast<double>(c.expert_width());
  const double moe_mlp = Ex + k * (2 * D + 3 * W) + (4 * Ex + 12 * k) / e;
  const double sparse = c.layers > 0 ? static_cast<double>(c.moe_layers()) / static_cast<double>(c.layers) : 0;
  const double mlp = (1 - sparse) * 3 * I + sparse * moe_mlp;
  const double block = (4 * D + 2 * qkv + attn + mlp) * N * e + probs * e + 2 * stats;
  const double kept = D * N * e;  // a checkpointed block keeps its input only
  const auto L = static_cast<double>(c.layers), K = static_cast<double>(std::clamp<std::int64_t>(checkpointed_blocks, 0, c.layers));
  // The logits held and their gradient beside the head input's (or one chunk of them, its rows'
  // running max and sums, and the head input's gradient summed in f32).
  const double chunk = std::min(static_cast<double>(logits_chunk_bytes), V * N * e);
  const double logits = logits_chunk_bytes > 0 ? 3 * N * 4 : V * N * e;
  const double head_grad = logits_chunk_bytes > 0 ? chunk + D * N * (4 + e) : (V + D) * N * e;
  const double saved = (L - K) * block + K * kept + (K > 0 ? block : 0) + 2 * D * N * e + logits + stats;
  const double working = std::max({head_grad, (2 * probs + 2 * qkv * N) * e, (4 * I + 2 * D) * N * e,
                                   sparse > 0 ? (k * (4 * W + 3 * D) + D) * N * e : 0.0});
  return static_cast<std::size_t>(saved + working);
}

Result<std::unique_ptr<Sequential>> make_llama(const LlamaConfig& c) { return detail::build_llama(c, nullptr); }

Result<std::unique_ptr<Sequential>> make_llama_expert_parallel(const LlamaConfig& c, collectives::Communicator& group) {
  COSHARD_TRY(check_expert_parallel(c, group.size()));
  return detail::build_llama(c, group.size() > 1 ? &group : nullptr);
}

Result<std::unique_ptr<Sequential>> detail::build_llama(const LlamaConfig& c, collectives::Communicator* expert_group) {
  COSHARD_TRY(c.validate());
  const Init weight = Init::normal(c.init_std);
  const std::int64_t hd = c.resolved_head_dim();
  const auto eps = static_cast<float>(c.norm_eps);
  auto model = std::make_unique<Sequential>();
  const auto balance = detail::make_router_balance(c);
  auto& embed = model->add("embed", std::make_unique<TokenEmbedding>(c.vocab, c.dim, weight));
  for (std::int64_t l = 0; l < c.layers; ++l) {
    auto attn = std::make_unique<Sequential>();
    attn->add("norm", std::make_unique<RmsNorm>(c.dim, eps));
    attn->add("qkv", std::make_unique<Linear>(c.dim, (c.heads + 2 * c.kv_heads) * hd, false, weight));
    if (c.qk_norm) attn->add("qk_norm", std::make_unique<HeadNorms>(c.heads, c.kv_heads, hd, eps));
    attn->add("rope", std::make_unique<RotaryEmbedding>(c.heads, c.kv_heads, hd, c.rope_theta, c.rope_scaling));
    attn->add("core", std::make_unique<CausalSelfAttention>(AttentionHeads{c.heads, c.kv_heads, hd}));
    attn->add("proj", std::make_unique<Linear>(c.heads * hd, c.dim, false, weight));
    COSHARD_TRY_ASSIGN(auto mlp, detail::make_llama_mlp(c, l, balance, expert_group));
    auto block = std::make_unique<Sequential>();
    block->add("attn", std::make_unique<Residual>(std::move(attn)));
    block->add("mlp", std::move(mlp));
    model->add("h" + std::to_string(l), std::move(block));
  }
  model->add("norm", std::make_unique<RmsNorm>(c.dim, eps));
  if (c.tie_embeddings) {
    model->add("head", std::make_unique<TiedHead>(embed));
  } else {
    model->add("head", std::make_unique<Linear>(c.dim, c.vocab, false, weight));
  }
  return model;
}

Result<void> check_tensor_parallel(const LlamaConfig& c, std::int64_t tensor) {
  COSHARD_TRY(c.validate());
  if (tensor < 1) return fail(ErrorCode::invalid_argument, "tensor-parallel size ", tensor, ": expected at least 1");
  if (tensor > 1 && c.qk_norm)
    return fail(ErrorCode::unsupported, "tensor-parallel size ", tensor, ": the query and key head norms (Qwen3's ",
                "q_norm and k_norm) are not split over tensor ranks (use data parallelism: tensor size 1)");
  if (tensor > 1 && c.moe.enabled())
    return fail(ErrorCode::unsupported, "tensor-parallel size ", tensor, ": a mixture of experts (", c.moe.experts,
                " experts) is not split over tensor ranks (use data parallelism: tensor size 1)");
  COSHARD_TRY(check_divides(c.heads, tensor, "the attention heads"));
  COSHARD_TRY(check_divides(c.kv_heads, tensor, "the key/value heads"));
  COSHARD_TRY(check_divides(c.intermediate, tensor, "the MLP width"));
  return check_divides(c.vocab, tensor, "the vocabulary");
}

Result<std::unique_ptr<Sequential>> make_llama(const LlamaConfig& c, collectives::Communicator& group) {
  if (group.size() == 1) return make_llama(c);
  const std::int64_t tp = group.size();
  COSHARD_TRY(check_tensor_parallel(c, tp));
  const Init weight = Init::normal(c.init_std);
  const std::int64_t hd = c.resolved_head_dim();
  const auto eps = static_cast<float>(c.norm_eps);
  const std::int64_t heads = c.heads / tp, kv_heads = c.kv_heads / tp;
  auto model = std::make_unique<Sequential>();
  COSHARD_TRY_ASSIGN(auto table, vocab_parallel_embedding(c.vocab, c.dim, weight, group));
  auto& embed = model->add("embed", std::move(table));
  model->add("embed_join", std::make_unique<TensorParallelJoin>(group, "the embedding's rows (tensor-parallel)"));
  const std::int64_t qkv_rows[] = {c.heads * hd, c.kv_heads * hd, c.kv_heads * hd};
  const std::int64_t gate_up_rows[] = {c.intermediate, c.intermediate};
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::string h = "h" + std::to_string(l);
    auto attn = std::make_unique<Sequential>();
    attn->add("norm", std::make_unique<RmsNorm>(c.dim, eps));
    attn->add("fork", std::make_unique<TensorParallelFork>(group, "the gradient into " + h + ".attn.qkv"));
    COSHARD_TRY_ASSIGN(auto qkv, column_parallel_linear(c.dim, qkv_rows, false, weight, group));
    attn->add("qkv", std::move(qkv));
    attn->add("rope", std::make_unique<RotaryEmbedding>(heads, kv_heads, hd, c.rope_theta, c.rope_scaling));
    attn->add("core", std::make_unique<CausalSelfAttention>(AttentionHeads{heads, kv_heads, hd}));
    COSHARD_TRY_ASSIGN(auto proj, row_parallel_linear(c.heads * hd, c.dim, weight, group));
    attn->add("proj", std::move(proj));
    attn->add("join", std::make_unique<TensorParallelJoin>(group, "the output of " + h + ".attn.proj"));
    auto mlp = std::make_unique<Sequential>();
    mlp->add("norm", std::make_unique<RmsNorm>(c.dim, eps));
    mlp->add("fork", std::make_unique<TensorParallelFork>(group, "the gradient into " + h + ".mlp.gate_up"));
    COSHARD_TRY_ASSIGN(auto gate_up, column_parallel_linear(c.dim, gate_up_rows, false, weight, group));
    mlp->add("gate_up", std::move(gate_up));
    mlp->add("swiglu", std::make_unique<SwiGlu>());
    COSHARD_TRY_ASSIGN(auto down, row_parallel_linear(c.intermediate, c.dim, weight, group));
    mlp->add("down", std::move(down));
    mlp->add("join", std::make_unique<TensorParallelJoin>(group, "the output of " + h + ".mlp.down"));
    auto block = std::make_unique<Sequential>();
    block->add("attn", std::make_unique<Residual>(std::move(attn)));
    block->add("mlp", std::make_unique<Residual>(std::move(mlp)));
    model->add(h, std::move(block));
  }
  model->add("norm", std::make_unique<RmsNorm>(c.dim, eps));
  model->add("head_fork", std::make_unique<TensorParallelFork>(group, "the gradient into the output layer"));
  if (c.tie_embeddings) {
    model->add("head", std::make_unique<TiedHead>(embed));
  } else {
    const std::int64_t vocab_rows[] = {c.vocab};
    COSHARD_TRY_ASSIGN(auto head, column_parallel_linear(c.dim, vocab_rows, false, weight, group));
    model->add("head", std::move(head));
  }
  return model;
}

}  // namespace coshard::modules
