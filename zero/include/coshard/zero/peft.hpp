// LoRA adapters (modules/lora.hpp) in and out of Hugging Face PEFT's adapter folders, and the
// adapted model merged for export.
//
// A PEFT folder holds adapter_config.json (peft_type "LORA", r, lora_alpha, lora_dropout,
// target_modules, base_model_name_or_path) and adapter_model.safetensors with one lora_A.weight
// [r, in] and one lora_B.weight [out, r] per adapted projection. For a Llama the tensors take
// PEFT's names over transformers' modules
// (base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight, ...mlp.down_proj..., and
// base_model.model.lm_head... for an untied head), so the folder loads in PEFT over the exported
// base; for any other model, base_model.model.<coshard's module path>.lora_A.weight.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "coshard/modules/lora.hpp"
#include "coshard/modules/llama.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero {

inline constexpr std::string_view kPeftConfigName = "adapter_config.json";
inline constexpr std::string_view kPeftWeightsName = "adapter_model.safetensors";

struct PeftAdapterConfig {
  std::int64_t r = 0;
  double lora_alpha = 0;
  double lora_dropout = 0;
  // A list of names, or (target_modules_regex) one regular expression matched in full, as PEFT
  // takes either; "all-linear" as a string is PEFT's every linear layer but the output layer.
  std::vector<std::string> target_modules;
  bool target_modules_regex = false;
  // PEFT's narrowing of a list's matches to some blocks: layers_to_transform (an int or a list;
  // empty: every block) under layers_pattern (the blocks' container names; empty: any).
  std::vector<std::int64_t> layers_to_transform;
  std::vector<std::string> layers_pattern;
  // PEFT's exclude_modules: a list, or one regular expression (exclude_modules_regex).
  std::vector<std::string> exclude_modules;
  bool exclude_modules_regex = false;
  std::string base_model_name_or_path;  // empty: null (a base that is no Hugging Face folder)
};

// Whether PEFT adapts the module named `key` (transformers' name, "model.layers.0.self_attn.q_proj")
// under `config`: PEFT's check_target_module_exists (exclusions first; a list entry equal to the
// name or its last names, narrowed by layers_to_transform; a string matched in full).
bool peft_targets_module(const PeftAdapterConfig& config, std::string_view key);

// The Llama modules PEFT adapts under `config`, by transformers' names, in model order, for a
// Llama of `layers` blocks (with an untied output layer, lm_head): the targets that make the same
// adapters in coshard (modules::LoraOptions::targets). An error when it selects none.
Result<std::vector<std::string>> peft_llama_targets(const PeftAdapterConfig& config, std::int64_t layers, bool untied_head);
// The same for the Llama `model` describes: its mixture-of-experts layers' experts by their names
// (modules::llama_expert_module_name) where their MLP is one.
Result<std::vector<std::string>> peft_llama_targets(const PeftAdapterConfig& config, const modules::LlamaConfig& model);

// The model's adapters, in model order, with the PEFT name of their A and B (`llama`: the model is
// make_llama's, named as transformers' modules).
struct PeftTensorNames {
  std::string path;  // the adapter's module path ("h0.attn.qkv.lora_q_proj")
  std::string a, b;  // "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", ...lora_B.weight
  modules::LoraAdapter* adapter = nullptr;
};
// Each adapter of `model` (under expert parallelism also those of the experts other expert ranks
// hold, in the same places: `adapter` is this rank's in that place, of the same settings and shapes).
std::vector<PeftTensorNames> peft_names(modules::Module& model, bool llama);

// The config a folder of `model`'s adapters says: its rank and alpha (every adapter's: an error
// names the first that differs), and the target modules (a Llama's projection names, or the
// adapted layers' paths). An error when the model has no adapters.
Result<PeftAdapterConfig> peft_config_of(modules::Module& model, bool llama, std::string base_model_name_or_path);
std::string peft_config_json(const PeftAdapterConfig& config);
// FOLDER/adapter_config.json: a LORA config of r >= 1 and lora_alpha > 0; anything else refused
// by name (`source` in errors).
Result<PeftAdapterConfig> parse_peft_config(std::string_view json, std::string_view source);
Result<PeftAdapterConfig> read_peft_config(const std::filesystem::path& folder);

// Every parameter with each adapter folded into its layer's weight (W[rows] += alpha / r * B A,
// in double, rounded once to `dtype`), the adapters' own tensors removed: the fine-tuned model
// for a tool that knows no adapters. `params` are whole values in `dtype` (gather_parameters').
Result<std::vector<GatheredParameter>> merge_lora(modules::Module& model, std::vector<GatheredParameter> params,
                                                  modules::DataType dtype);

// Writes FOLDER/adapter_config.json and FOLDER/adapter_model.safetensors (rank 0 writes, every
// rank gathers), the folder created when absent; other files there stay.
async::Task<Result<void>> export_peft_adapter(Engine& engine, modules::Module& model, const std::filesystem::path& folder,
                                              bool llama, std::string base_model_name_or_path);
// Loads a PEFT folder's adapters into `model`'s (under `engine`): its r and lora_alpha must be the
// model's, and its tensors exactly the model's adapters, each of its whole shape (a missing, extra
// or reshaped one is refused by name, nothing loaded; under tensor parallelism each rank takes its
// parts); the rest of the model keeps its values.
async::Task<Result<void>> load_peft_adapter(Engine& engine, modules::Module& model, const std::filesystem::path& folder,
                                            bool llama);

}  // namespace coshard::zero
