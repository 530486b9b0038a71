// Hugging Face model folders of the Llama family (transformers' LlamaForCausalLM): config.json and
// its safetensors (one model.safetensors, or shards with model.safetensors.index.json), into and
// out of a coshard Llama (modules::make_llama) under the engine.
//
// transformers' names and layouts: model.embed_tokens.weight, model.layers.N.input_layernorm.weight,
// model.layers.N.self_attn.{q,k,v,o}_proj.weight, model.layers.N.post_attention_layernorm.weight,
// model.layers.N.mlp.{gate,up,down}_proj.weight, model.norm.weight, lm_head.weight (absent with
// tied embeddings). coshard fuses q, k and v into one qkv matrix and gate and up into gate_up (rows
// stacked in that order), so a load stacks them and an export splits them; q and k are already in
// transformers' rotary convention (no permutation either way).
#pragma once

#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/modules/llama.hpp"
#include "coshard/modules/safetensors_folder.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero {

inline constexpr std::string_view kHfConfigName = "config.json";

// config.json as a LlamaConfig: model_type "llama" (or a LlamaForCausalLM architecture), its
// shape, rope_theta and rope_scaling ("llama3" or none), rms_norm_eps, tie_word_embeddings,
// initializer_range. Refused by name: another model type, attention or MLP biases, an activation
// other than silu, another rope scaling, a missing or mistyped field. `source` names the file.
Result<modules::LlamaConfig> parse_hf_llama_config(std::string_view json, std::string_view source);
// FOLDER/config.json.
Result<modules::LlamaConfig> read_hf_llama_config(const std::filesystem::path& folder);
// The config.json of `config` with weights in `dtype` (torch_dtype).
std::string hf_llama_config_json(const modules::LlamaConfig& config, modules::DataType dtype);

// coshard's parameters of make_llama(config) (whole values, as gather_parameters gives them) as
// transformers' tensors, in transformers' order; `element_bytes` is the size of one element.
Result<std::vector<GatheredParameter>> to_hf_llama(const modules::LlamaConfig& config,
                                                   std::vector<GatheredParameter> params, std::size_t element_bytes);
// The reverse: every tensor of transformers' Llama, none missing or extra (lm_head.weight of a
// tied model is accepted only when it equals the embedding), each of its shape.
Result<std::vector<GatheredParameter>> from_hf_llama(const modules::LlamaConfig& config,
                                                     std::vector<GatheredParameter> tensors, std::size_t element_bytes);

// Loads the weights of FOLDER (any float dtype, converted) into the engine's make_llama(config).
async::Task<Result<void>> load_hf_llama(Engine& engine, const std::filesystem::path& folder,
                                        const modules::LlamaConfig& config);
// Writes config.json and the weights (sharded above options.max_shard_bytes) into FOLDER, created
// when absent (rank 0 writes, every rank gathers). Weight files of an earlier export there that
// the new set lacks are removed; other files stay.
async::Task<Result<void>> export_hf_llama(Engine& engine, const std::filesystem::path& folder,
                                          const modules::LlamaConfig& config,
                                          modules::SafetensorsFolderOptions options = {});
// The same for a model with LoRA adapters (modules/lora.hpp): each folded into its layer's weight
// first (zero/peft.hpp's merge_lora), so the folder is the fine-tuned model, as transformers reads
// it. `adapted` is the engine's model.
async::Task<Result<void>> export_hf_llama(Engine& engine, const std::filesystem::path& folder,
                                          const modules::LlamaConfig& config, modules::SafetensorsFolderOptions options,
                                          modules::Module& adapted);

}  // namespace coshard::zero
