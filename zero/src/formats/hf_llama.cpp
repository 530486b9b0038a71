#include "coshard/zero/hf_llama.hpp"

#include <cmath>
#include <map>
#include <set>

#include <nlohmann/json.hpp>

#include "coshard/async/files.hpp"
#include "coshard/async/json_limits.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/zero/peft.hpp"
#include "formats/hf_format.hpp"
#include "formats/hf_families.hpp"
#include "formats/parameter_decode.hpp"

namespace coshard::zero {

using namespace modules;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

std::vector<detail::Mapping> llama_mappings(const LlamaConfig& c) {
  const std::int64_t D = c.dim, hd = c.resolved_head_dim(), H = c.heads, K = c.kv_heads, I = c.intermediate;
  std::vector<detail::Mapping> m;
  m.push_back({"embed.weight", Shape{c.vocab, D}, {{"model.embed_tokens.weight", 0}}});
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const std::string h = "h" + std::to_string(l) + ".", hf = "model.layers." + std::to_string(l) + ".";
    m.push_back({h + "attn.norm.weight", Shape{D}, {{hf + "input_layernorm.weight", 0}}});
    m.push_back({h + "attn.qkv.weight", Shape{(H + 2 * K) * hd, D},
                 {{hf + "self_attn.q_proj.weight", H * hd}, {hf + "self_attn.k_proj.weight", K * hd},
                  {hf + "self_attn.v_proj.weight", K * hd}}});
    detail::add_head_norm_mappings(m, c, h + "attn.", hf);
    m.push_back({h + "attn.proj.weight", Shape{D, H * hd}, {{hf + "self_attn.o_proj.weight", 0}}});
    m.push_back({h + "mlp.norm.weight", Shape{D}, {{hf + "post_attention_layernorm.weight", 0}}});
    if (c.moe_layer(l)) {
      detail::add_moe_mappings(m, c, h + "mlp.moe.", hf);
      continue;
    }
    m.push_back({h + "mlp.gate_up.weight", Shape{2 * I, D}, {{hf + "mlp.gate_proj.weight", I}, {hf + "mlp.up_proj.weight", I}}});
    m.push_back({h + "mlp.down.weight", Shape{D, I}, {{hf + "mlp.down_proj.weight", 0}}});
  }
  m.push_back({"norm.weight", Shape{D}, {{"model.norm.weight", 0}}});
  if (!c.tie_embeddings) m.push_back({"head.weight", Shape{c.vocab, D}, {{"lm_head.weight", 0}}});
  return m;
}

Shape piece_shape(const detail::Mapping& m, const detail::Piece& p) {
  if (p.rows == 0) return m.shape;
  return Shape{p.rows, m.shape[1]};
}

std::string_view torch_dtype_name(DataType dt) {
  switch (dt) {
    case DataType::bf16: return "bfloat16";
    case DataType::f16: return "float16";
    case DataType::f64: return "float64";
    default: return "float32";
  }
}

}  // namespace

Result<LlamaConfig> parse_hf_llama_config(std::string_view text, std::string_view source) {
  COSHARD_TRY(async::check_json_nesting(text, source));
  const json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object()) return fail(ErrorCode::invalid_argument, source, ": not a JSON object");
  const detail::Fields f{doc, source};
  const std::string model_type = doc.contains("model_type") && doc["model_type"].is_string() ? doc["model_type"].get<std::string>() : "";
  const auto family = detail::family_named(doc);
  if (!family)
    return fail(ErrorCode::unsupported, source, ": model_type \"", model_type,
                "\" (expected \"llama\", \"mixtral\", \"qwen3\" or \"qwen3_moe\": transformers' LlamaForCausalLM, "
                "MixtralForCausalLM, Qwen3ForCausalLM or Qwen3MoeForCausalLM)");
  for (const char* bias : {"attention_bias", "mlp_bias"}) {
    COSHARD_TRY_ASSIGN(const bool on, f.boolean(bias, false));
    if (on) return fail(ErrorCode::unsupported, source, ": \"", bias, "\"=true (coshard's Llama has no biases)");
  }
  if (doc.contains("hidden_act") && doc["hidden_act"] != "silu")
    return fail(ErrorCode::unsupported, source, ": \"hidden_act\"=", async::bounded_echo(doc["hidden_act"].dump()), " (expected \"silu\": SwiGLU)");
  LlamaConfig c;
  COSHARD_TRY_ASSIGN(c.vocab, f.integer("vocab_size"));
  COSHARD_TRY_ASSIGN(c.dim, f.integer("hidden_size"));
  COSHARD_TRY_ASSIGN(c.layers, f.integer("num_hidden_layers"));
  COSHARD_TRY_ASSIGN(c.heads, f.integer("num_attention_heads"));
  COSHARD_TRY_ASSIGN(c.kv_heads, f.integer("num_key_value_heads", c.heads));
  COSHARD_TRY_ASSIGN(c.intermediate, f.integer("intermediate_size"));
  COSHARD_TRY_ASSIGN(c.head_dim, f.integer("head_dim", std::int64_t{0}));
  COSHARD_TRY_ASSIGN(c.max_seq, f.integer("max_position_embeddings", std::int64_t{2048}));
  COSHARD_TRY_ASSIGN(c.norm_eps, f.number(doc, "rms_norm_eps", 1e-6));
  COSHARD_TRY_ASSIGN(c.init_std, f.number(doc, "initializer_range", 0.02));
  COSHARD_TRY_ASSIGN(c.tie_embeddings, f.boolean("tie_word_embeddings", false));
  COSHARD_TRY(detail::read_family_fields(f, *family, c));
  // The rotary base and scaling: rope_theta and rope_scaling, or (newer transformers)
  // rope_parameters holding both.
  const json* rope = nullptr;
  if (doc.contains("rope_parameters") && doc["rope_parameters"].is_object()) rope = &doc["rope_parameters"];
  else if (doc.contains("rope_scaling") && doc["rope_scaling"].is_object()) rope = &doc["rope_scaling"];
  else if (doc.contains("rope_scaling") && !doc["rope_scaling"].is_null())
    return fail(ErrorCode::invalid_argument, source, ": \"rope_scaling\"=", async::bounded_echo(doc["rope_scaling"].dump()), " (expected an object or null)");
  COSHARD_TRY_ASSIGN(c.rope_theta, f.number(rope && rope->contains("rope_theta") ? *rope : doc, "rope_theta", 10000.0));
  if (rope) {
    const json& r = *rope;
    const std::string type = r.contains("rope_type") && r["rope_type"].is_string() ? r["rope_type"].get<std::string>()
                             : r.contains("type") && r["type"].is_string()        ? r["type"].get<std::string>()
                                                                                  : "default";
    if (type == "llama3") {
      COSHARD_TRY_ASSIGN(c.rope_scaling.factor, f.number(r, "factor", std::nullopt));
      COSHARD_TRY_ASSIGN(c.rope_scaling.low_freq_factor, f.number(r, "low_freq_factor", 1.0));
      COSHARD_TRY_ASSIGN(c.rope_scaling.high_freq_factor, f.number(r, "high_freq_factor", 4.0));
      COSHARD_TRY_ASSIGN(const double original, f.number(r, "original_max_position_embeddings", 8192.0));
      if (!(original >= 1 && original <= 1e12) || original != std::floor(original))
        return fail(ErrorCode::invalid_argument, source, ": \"original_max_position_embeddings\"=", original,
                    " (expected a whole number from 1 to 1e12)");
      c.rope_scaling.original_max_positions = static_cast<std::int64_t>(original);
    } else if (type != "default") {
      return fail(ErrorCode::unsupported, source, ": rope scaling \"", type,
                  "\" (coshard applies \"llama3\" or none; linear, dynamic and yarn are not supported)");
    }
  }
  if (auto ok = c.validate(); !ok) return fail(std::move(ok).error().with_context(std::string(source)));
  const std::string kept = doc.dump();
  c.hf_config.assign(kept.begin(), kept.end());
  return c;
}

Result<LlamaConfig> read_hf_llama_config(const fs::path& folder) {
  const fs::path path = folder / kHfConfigName;
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, std::size_t{16} << 20, "config.json"));
  return parse_hf_llama_config(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), path.string());
}

std::string hf_llama_config_json(const LlamaConfig& c, DataType dtype) {
  // The keys of the folder it was read from, under the ones the model sets.
  json doc = c.hf_config.empty() ? json::object()
                                 : json::parse(std::string_view(c.hf_config.data(), c.hf_config.size()), nullptr, false);
  if (!doc.is_object()) doc = json::object();
  const json read = doc;
  // Keys the model has no say in keep the folder's value.
  auto unless_read = [&](const char* key, json value) {
    if (!read.contains(key)) doc[key] = std::move(value);
  };
  doc["architectures"] = {"LlamaForCausalLM"};
  doc["model_type"] = "llama";
  doc["vocab_size"] = c.vocab;
  doc["hidden_size"] = c.dim;
  doc["intermediate_size"] = c.intermediate;
  doc["num_hidden_layers"] = c.layers;
  doc["num_attention_heads"] = c.heads;
  doc["num_key_value_heads"] = c.kv_heads;
  doc["head_dim"] = c.resolved_head_dim();
  doc["max_position_embeddings"] = c.max_seq;
  doc["rms_norm_eps"] = c.norm_eps;
  doc["rope_theta"] = c.rope_theta;
  if (c.rope_scaling.factor > 0)
    doc["rope_scaling"] = {{"rope_type", "llama3"},
                           {"factor", c.rope_scaling.factor},
                           {"low_freq_factor", c.rope_scaling.low_freq_factor},
                           {"high_freq_factor", c.rope_scaling.high_freq_factor},
                           {"original_max_position_embeddings", c.rope_scaling.original_max_positions}};
  else
    doc["rope_scaling"] = nullptr;
  doc["tie_word_embeddings"] = c.tie_embeddings;
  doc["attention_bias"] = false;
  unless_read("attention_dropout", 0.0);
  doc["mlp_bias"] = false;
  doc["hidden_act"] = "silu";
  doc["initializer_range"] = c.init_std;
  unless_read("pretraining_tp", 1);
  unless_read("use_cache", true);
  doc["torch_dtype"] = torch_dtype_name(dtype);
  detail::write_family_fields(doc, c);
  return doc.dump(2) + "\n";
}

Result<std::vector<GatheredParameter>> to_hf_llama(const LlamaConfig& c, std::vector<GatheredParameter> params,
                                                   std::size_t element_bytes) {
  std::map<std::string, GatheredParameter*> by_name;
  for (auto& p : params) by_name[p.name] = &p;
  std::vector<GatheredParameter> out;
  for (const auto& m : llama_mappings(c)) {
    const auto it = by_name.find(m.name);
    if (it == by_name.end() || !(it->second->shape == m.shape))
      return fail(ErrorCode::invalid_argument, "to_hf_llama: parameter ", m.name,
                  it == by_name.end() ? std::string(" is missing") : " is " + it->second->shape.to_string(),
                  " (expected ", m.shape.to_string(), " for the model's config)");
    const auto& bytes = it->second->bytes;
    std::size_t offset = 0;
    for (const auto& piece : m.pieces) {
      const Shape shape = piece_shape(m, piece);
      const std::size_t n = static_cast<std::size_t>(shape.numel()) * element_bytes;
      out.push_back({piece.hf_name, shape, std::vector<std::byte>(bytes.begin() + static_cast<std::ptrdiff_t>(offset),
                                                                  bytes.begin() + static_cast<std::ptrdiff_t>(offset + n))});
      offset += n;
    }
    by_name.erase(it);
  }
  if (!by_name.empty())
    return fail(ErrorCode::invalid_argument, "to_hf_llama: parameter ", by_name.begin()->first,
                " has no place in transformers' Llama (is the model make_llama's?)");
  return out;
}

Result<std::vector<GatheredParameter>> from_hf_llama(const LlamaConfig& c, std::vector<GatheredParameter> tensors,
                                                     std::size_t element_bytes) {
  std::map<std::string, GatheredParameter*> by_name;
  for (auto& t : tensors)
    if (!by_name.emplace(t.name, &t).second)
      return fail(ErrorCode::invalid_argument, "tensor ", t.name, " appears twice");
  std::vector<GatheredParameter> out;
  for (const auto& m : llama_mappings(c)) {
    GatheredParameter p{m.name, m.shape, {}};
    p.bytes.reserve(static_cast<std::size_t>(m.shape.numel()) * element_bytes);
    for (const auto& piece : m.pieces) {
      const auto it = by_name.find(piece.hf_name);
      const Shape shape = piece_shape(m, piece);
      if (it == by_name.end())
        return fail(ErrorCode::invalid_argument, "tensor ", piece.hf_name, " is missing (expected ", shape.to_string(),
                    " for the config's ", detail::family_title(c.family), ")");
      if (!(it->second->shape == shape))
        return fail(ErrorCode::invalid_argument, "tensor ", piece.hf_name, " is ", it->second->shape.to_string(),
                    " (expected ", shape.to_string(), " for the config's ", detail::family_title(c.family), ")");
      p.bytes.insert(p.bytes.end(), it->second->bytes.begin(), it->second->bytes.end());
      by_name.erase(it);
    }
    out.push_back(std::move(p));
  }
  // A tied model's file may carry lm_head.weight too (a copy of the embedding): only then is it taken.
  if (c.tie_embeddings) {
    if (auto it = by_name.find("lm_head.weight"); it != by_name.end()) {
      if (it->second->bytes != out.front().bytes)
        return fail(ErrorCode::invalid_argument, "tensor lm_head.weight differs from model.embed_tokens.weight, but the "
                                                 "config ties them (tie_word_embeddings: true)");
      by_name.erase(it);
    }
  }
  // (rotary_emb.inv_freq of old exports is a buffer, not a weight)
  for (auto it = by_name.begin(); it != by_name.end();)
    it = it->first.ends_with("rotary_emb.inv_freq") ? by_name.erase(it) : std::next(it);
  if (!by_name.empty())
    return fail(ErrorCode::invalid_argument, "tensor ", by_name.begin()->first, " is not part of the config's ", detail::family_title(c.family), " (",
                by_name.size(), " such tensor", by_name.size() == 1 ? "" : "s", ")");
  return out;
}

async::Task<Result<void>> load_hf_llama(Engine& engine, const fs::path& folder, const LlamaConfig& config) {
  const DataType dtype = engine.options().dtype;
  auto read = [folder, config, dtype]() -> Result<std::vector<GatheredParameter>> {
    COSHARD_TRY_ASSIGN(auto files, SafetensorsFolder::load(folder));
    std::vector<GatheredParameter> tensors;
    for (const auto& e : files.tensors()) {
      COSHARD_TRY_ASSIGN(auto t, detail::decode_parameter(folder.string(), e.info->name, e.info->dtype, e.info->shape,
                                                          files.data(e), dtype));
      tensors.push_back(std::move(t));
    }
    auto mapped = from_hf_llama(config, std::move(tensors), size_of(dtype));
    if (!mapped) return fail(std::move(mapped).error().with_context(folder.string()));
    return mapped;
  };
  co_return co_await engine.load_parameters_from("loading the Hugging Face folder " + folder.string(), std::move(read));
}

namespace {

async::Task<Result<void>> export_merged(Engine& engine, const fs::path& folder, const LlamaConfig& config,
                                        SafetensorsFolderOptions options, modules::Module* adapted) {
  const DataType dtype = engine.options().dtype;
  COSHARD_CO_TRY(config.validate());
  const auto file_dtype = safe_dtype_of(dtype);
  if (!file_dtype) co_return fail(ErrorCode::unsupported, "export_hf_llama: dtype ", async::to_string(dtype));
  options.metadata.emplace("producer", "coshard");
  auto write = [folder, config, dtype, file_dtype = *file_dtype,
                options = std::move(options), adapted](const std::vector<GatheredParameter>& params) -> Result<void> {
    std::vector<GatheredParameter> merged;
    if (adapted) {
      COSHARD_TRY_ASSIGN(merged, merge_lora(*adapted, params, dtype));
    }
    COSHARD_TRY_ASSIGN(auto hf, to_hf_llama(config, adapted ? std::move(merged) : params, size_of(dtype)));
    COSHARD_TRY(async::check_output_folder(folder, "Hugging Face folder"));  // created when absent
    std::vector<SafeTensorView> views;
    for (const auto& t : hf) {
      const auto dims = t.shape.dims();
      views.push_back({t.name, file_dtype, std::vector<std::int64_t>(dims.begin(), dims.end()), t.bytes});
    }
    COSHARD_TRY(save_safetensors_folder(folder, views, options));
    return async::write_file_atomic(folder / kHfConfigName, hf_llama_config_json(config, dtype));
  };
  co_return co_await engine.export_parameters("export to the Hugging Face folder " + folder.string(), std::move(write));
}

}  // namespace

async::Task<Result<void>> export_hf_llama(Engine& engine, const fs::path& folder, const LlamaConfig& config,
                                          SafetensorsFolderOptions options) {
  co_return co_await export_merged(engine, folder, config, std::move(options), nullptr);
}

async::Task<Result<void>> export_hf_llama(Engine& engine, const fs::path& folder, const LlamaConfig& config,
                                          SafetensorsFolderOptions options, modules::Module& adapted) {
  co_return co_await export_merged(engine, folder, config, std::move(options), &adapted);
}

}  // namespace coshard::zero
