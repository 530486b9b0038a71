#include "model_choice.hpp"

#include <cstdio>

namespace coshard::train_app {

namespace {

std::int64_t checkpointed_blocks(std::int64_t layers, modules::ActivationCheckpointing policy) {
  std::int64_t n = 0;
  for (std::int64_t l = 0; l < layers; ++l) n += policy.checkpoints(l) ? 1 : 0;
  return n;
}

std::string millions(std::int64_t n) {
  char text[32];
  std::snprintf(text, sizeof text, n >= 1'000'000'000 ? "%.2fB" : "%.1fM",
                n >= 1'000'000'000 ? static_cast<double>(n) / 1e9 : static_cast<double>(n) / 1e6);
  return text;
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
         (l.tie_embeddings ? " tied" : "") + rope + " seq " + std::to_string(seq);
}

Result<std::unique_ptr<modules::Sequential>> ModelChoice::build() const {
  return kind == Kind::gpt ? modules::make_gpt(gpt) : modules::make_llama(llama);
}

std::size_t ModelChoice::activation_bytes(std::int64_t rows, std::int64_t seq, modules::DataType dtype,
                                          modules::ActivationCheckpointing policy) const {
  if (kind == Kind::gpt)
    return modules::gpt_activation_bytes(gpt, rows, seq, dtype, checkpointed_blocks(gpt.layers, policy));
  return modules::llama_activation_bytes(llama, rows, seq, dtype, checkpointed_blocks(llama.layers, policy));
}

std::string describe_presets() {
  std::string out;
  for (const auto& p : modules::llama_presets())
    out += "\n  " + std::string(p.name) + " (" + millions(p.config.parameter_count()) + " parameters): " +
           std::string(p.summary);
  return out;
}

}  // namespace coshard::train_app
