// The model coshard-train trains: the GPT of make_gpt, or a Llama of make_llama (a preset, with
// the shape flags given over it), with what the run's header, its identity, the memory estimate
// and the ranks need of it.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

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
  // One micro-batch's activations (modules' estimates), with `policy`'s blocks checkpointed.
  std::size_t activation_bytes(std::int64_t rows, std::int64_t seq, modules::DataType dtype,
                               modules::ActivationCheckpointing policy) const;
};

// --help's list of the presets: "llama-tiny (0.1M parameters): for tests ...", one a line.
std::string describe_presets();

}  // namespace coshard::train_app
