// The model coshard-train trains: the GPT of make_gpt, or a Llama of make_llama (a preset, with
// the shape flags given over it), with what the run's header, its identity, the memory estimate
// and the ranks need of it.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/llama.hpp"

namespace coshard::train_app {

struct ModelChoice {
  enum class Kind : std::uint8_t { gpt, llama };
  Kind kind = Kind::gpt;
  modules::GptConfig gpt;
  modules::LlamaConfig llama;
  std::string preset;        // the Llama preset it started from ("" for none)
  bool vocab_fixed = false;  // the model fixes the vocabulary (a preset or --vocab): data follow it

  std::int64_t vocab() const noexcept { return kind == Kind::gpt ? gpt.vocab : llama.vocab; }
  void set_vocab(std::int64_t v) noexcept { (kind == Kind::gpt ? gpt.vocab : llama.vocab) = v; }
  std::int64_t parameter_count() const noexcept;
  // "GPT (4 layers, dim 128, 4 heads)", "Llama-3.2-1B (16 layers, dim 2048, ...)".
  std::string describe() const;
  // What a resume must match beyond the parameters' shapes (heads, rotary base, ...).
  std::string identity(std::int64_t seq) const;
  Result<std::unique_ptr<modules::Sequential>> build() const;
  // This rank's part of the model split over `tensor_group` (a Llama only).
  Result<std::unique_ptr<modules::Sequential>> build(collectives::Communicator& tensor_group) const;
  // This rank's part of a mixture of experts whose experts are partitioned over `expert_group`
  // (make_llama_expert_parallel); a group of one rank gives build().
  Result<std::unique_ptr<modules::Sequential>> build_expert_parallel(collectives::Communicator& expert_group) const;
  std::int64_t head_dim() const noexcept;
  // One micro-batch's activations on `device` (modules' estimates), with `policy`'s blocks
  // checkpointed and attention fused where it runs fused; the logits in chunks of at most
  // `logits_chunk_bytes` (0: whole).
  std::size_t activation_bytes(std::int64_t rows, std::int64_t seq, modules::DataType dtype,
                               modules::ActivationCheckpointing policy, async::Device device,
                               modules::AttentionKernels attention, std::int64_t logits_chunk_bytes = 0) const;
};

// The model options of coshard-train as given (an unset optional: not given).
struct ModelFlags {
  std::string model = "gpt";
  bool model_given = false;
  std::string preset;          // "" when not given
  std::string init_folder;     // --init when it names a folder: the shape comes from its config.json
  std::int64_t vocab = 256, layers = 4, dim = 128, heads = 4, seq = 64;  // the values, given or default
  bool vocab_given = false, layers_given = false, dim_given = false, heads_given = false;
  std::optional<std::int64_t> kv_heads, head_dim, intermediate;
  std::optional<double> rope_theta;
  std::optional<double> router_aux_loss_coef;  // a mixture of experts' (with --init too)
  std::optional<std::int64_t> experts, experts_per_token, expert_width;  // a mixture of experts' shape
  std::string expert_fetch = "routed";  // or "all": every expert runs each pass (with --init too)
  std::optional<bool> tie_embeddings;
};

// The model the flags ask for: a GPT; a Llama from a preset, a Hugging Face folder or the flags
// alone, with the flags given over a preset. An error names the option and the value.
Result<ModelChoice> resolve_model(const ModelFlags& flags);

// --help's list of the presets: "llama-tiny (0.1M parameters): for tests ...", one a line.
std::string describe_presets();

}  // namespace coshard::train_app
