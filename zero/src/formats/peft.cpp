// PEFT adapter folders and the merged export (peft.hpp).
#include "coshard/zero/peft.hpp"

#include <algorithm>
#include <array>
#include <cmath>
#include <map>
#include <optional>
#include <regex>
#include <set>

#include <nlohmann/json.hpp>

#include "coshard/async/files.hpp"
#include "coshard/async/json_limits.hpp"
#include "coshard/modules/moe.hpp"
#include "coshard/modules/safetensors.hpp"
#include "formats/parameter_decode.hpp"

namespace coshard::zero {

namespace fs = std::filesystem;
using json = nlohmann::json;
using modules::DataType;
using modules::LoraAdapter;
using modules::Module;

namespace {

// "h12." -> 12; -1 when `path` is not under a block h<N>.
std::int64_t block_of(std::string_view path) {
  if (!path.starts_with("h")) return -1;
  const auto dot = path.find('.');
  if (dot == std::string_view::npos || dot == 1) return -1;
  std::int64_t l = 0;
  for (char c : path.substr(1, dot - 1)) {
    if (c < '0' || c > '9') return -1;
    l = l * 10 + (c - '0');
  }
  return l;
}

// transformers' module of a Llama's adapter: "model.layers.0.self_attn.q_proj", "lm_head"; or
// coshard's path of its linear layer for any other.
std::string peft_module(const std::string& adapter_path, const std::string& child, bool llama) {
  const std::string linear = adapter_path.substr(0, adapter_path.size() - child.size() - 1);
  if (!llama) return linear;
  if (linear == "head") return "lm_head";
  const std::string projection = child.starts_with("lora_") ? child.substr(5) : "";
  const std::int64_t l = block_of(linear);
  if (l < 0 || projection.empty()) return linear;
  // An expert's: h{l}.mlp.moe.experts.{e}.gate_up or .down.
  if (const auto at = linear.find(".mlp.moe.experts."); at != std::string::npos) {
    const std::string rest = linear.substr(at + std::string_view(".mlp.moe.experts.").size());
    return modules::llama_expert_module_name(l, std::stoll(rest.substr(0, rest.find('.'))), projection);
  }
  return modules::llama_module_name(l, projection);
}

// How many modules of the model each projection name has (q_proj in every block, gate_proj in
// every dense MLP and every Qwen3-MoE expert, w1 in every Mixtral expert, ...): a projection
// adapted in all of them is named bare in target_modules.
std::map<std::string, std::int64_t> projection_counts(Module& model) {
  std::map<std::string, std::int64_t> count;
  model.for_each_module([&](const std::string& path, Module& m) {
    if (block_of(path) < 0) return;
    if (path.ends_with(".attn.qkv"))
      for (const char* p : {"q_proj", "k_proj", "v_proj"}) ++count[p];
    if (path.ends_with(".attn.proj")) ++count["o_proj"];
    if (path.ends_with(".mlp.gate_up")) ++count["gate_proj"], ++count["up_proj"];
    if (path.ends_with(".mlp.down")) ++count["down_proj"];
    if (auto* moe = dynamic_cast<modules::SparseMoe*>(&m))
      for (const char* p : moe->options().mixtral_names ? std::array{"w1", "w3", "w2"}
                                                        : std::array{"gate_proj", "up_proj", "down_proj"})
        count[p] += moe->options().experts;
  });
  return count;
}

// The whole values by name.
std::map<std::string, const GatheredParameter*> by_name(const std::vector<GatheredParameter>& params) {
  std::map<std::string, const GatheredParameter*> out;
  for (const auto& p : params) out[p.name] = &p;
  return out;
}

// PEFT's regular expressions come from outside: compiled for libstdc++'s breadth-first executor,
// whose time is polynomial in the name's length ("(a*)*b" over a 32-character name ran for
// minutes in the default, backtracking one); it refuses back-references (regex_error).
std::regex outside_regex(const std::string& pattern) {
#if defined(__GLIBCXX__)
  return std::regex(pattern, std::regex::ECMAScript | std::regex_constants::__polynomial);
#else
  return std::regex(pattern, std::regex::ECMAScript);
#endif
}

}  // namespace

std::vector<PeftTensorNames> peft_names(Module& model, bool llama) {
  std::vector<PeftTensorNames> out;
  // Expert parallelism: the adapters of the experts other expert ranks hold, in the same places as
  // this rank's (the same adapter settings and shapes): the folder and the merged export hold them all.
  std::map<std::string, std::vector<std::string>> places;
  for (auto& place : modules::expert_places(model)) places.emplace(place.name, std::move(place.names_by_rank));
  model.for_each_module([&](const std::string& path, Module& m) {
    auto* adapter = dynamic_cast<LoraAdapter*>(&m);
    if (!adapter) return;
    const std::string child = path.substr(path.rfind('.') + 1);
    const auto it = places.find(path + ".A");
    const std::vector<std::string> own{path + ".A"};
    for (const std::string& a : it == places.end() ? own : it->second) {
      const std::string at = a.substr(0, a.size() - 2);
      const std::string module = "base_model.model." + peft_module(at, child, llama);
      out.push_back({at, module + ".lora_A.weight", module + ".lora_B.weight", adapter});
    }
  });
  return out;
}

Result<PeftAdapterConfig> peft_config_of(Module& model, bool llama, std::string base_model_name_or_path) {
  const auto names = peft_names(model, llama);
  if (names.empty()) return fail(ErrorCode::invalid_argument, "PEFT adapter: the model has no LoRA adapters");
  PeftAdapterConfig c;
  c.r = names.front().adapter->rank();
  c.lora_alpha = names.front().adapter->alpha();
  c.lora_dropout = names.front().adapter->dropout();
  c.base_model_name_or_path = std::move(base_model_name_or_path);
  std::set<std::string> targets;
  // A projection adapted in some of its modules only is named module by module (PEFT adapts every
  // module a bare name matches).
  const auto counts = projection_counts(model);
  std::map<std::string, std::vector<std::string>> blocks_of_projection;  // "q_proj" -> its full names
  for (const auto& n : names) {
    if (n.adapter->rank() != c.r || n.adapter->alpha() != c.lora_alpha)
      return fail(ErrorCode::invalid_argument, "PEFT adapter: ", n.path, " has rank ", n.adapter->rank(), " and alpha ",
                  n.adapter->alpha(), ", another adapter rank ", c.r, " and alpha ", c.lora_alpha,
                  " (a PEFT folder holds one of each)");
    // (the module's last name: q_proj, lm_head, or a coshard layer's path)
    const std::string module = n.a.substr(std::string_view("base_model.model.").size(),
                                          n.a.size() - std::string_view("base_model.model.").size() - std::string_view(".lora_A.weight").size());
    if (llama && module.starts_with("model.layers."))
      blocks_of_projection[module.substr(module.rfind('.') + 1)].push_back(module);
    else if (llama && module != "lm_head")
      // (PEFT would look for coshard's path in transformers' model, and --adapter for a
      // transformers name: neither could load the folder)
      return fail(ErrorCode::unsupported, "PEFT adapter: the adapter on ", module, " has no module of transformers' ",
                  "model to name (adapt the attention's, the MLPs' or the experts' projections, or lm_head; or export ",
                  "the merged model with --export alone)");
    else
      targets.insert(module);
  }
  for (auto& [projection, modules] : blocks_of_projection) {
    const auto it = counts.find(projection);
    if (it != counts.end() && static_cast<std::int64_t>(modules.size()) == it->second) targets.insert(projection);
    else targets.insert(modules.begin(), modules.end());
  }
  c.target_modules.assign(targets.begin(), targets.end());
  return c;
}

std::string peft_config_json(const PeftAdapterConfig& c) {
  json doc;
  doc["peft_type"] = "LORA";
  doc["task_type"] = "CAUSAL_LM";
  doc["r"] = c.r;
  doc["lora_alpha"] = c.lora_alpha;
  doc["lora_dropout"] = c.lora_dropout;
  doc["target_modules"] = c.target_modules;
  // (null for a base that is no Hugging Face folder, as PEFT writes for such a model)
  if (c.base_model_name_or_path.empty()) doc["base_model_name_or_path"] = nullptr;
  else doc["base_model_name_or_path"] = c.base_model_name_or_path;
  doc["bias"] = "none";
  doc["fan_in_fan_out"] = false;
  doc["inference_mode"] = true;
  doc["init_lora_weights"] = true;
  doc["modules_to_save"] = nullptr;
  return doc.dump(2) + "\n";
}

Result<PeftAdapterConfig> parse_peft_config(std::string_view text, std::string_view source) {
  // (as every reader of outside JSON: a value nested 150,000 deep overflowed the stack when named)
  COSHARD_TRY(async::check_json_nesting(text, source));
  const json doc = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded() || !doc.is_object()) return fail(ErrorCode::invalid_argument, source, ": not a JSON object");
  auto bad = [&](std::string_view key, std::string_view expected) {
    const std::string shown = doc.contains(key) ? async::bounded_echo(doc.at(std::string(key)).dump()) : "(missing)";
    return fail(ErrorCode::invalid_argument, source, ": ", key, "=", shown, ", expected ", expected);
  };
  if (!doc.contains("peft_type") || doc["peft_type"] != "LORA") return bad("peft_type", "\"LORA\"");
  PeftAdapterConfig c;
  if (!doc.contains("r") || !doc["r"].is_number_integer() || doc["r"].get<std::int64_t>() < 1 ||
      doc["r"].get<std::int64_t>() > 65536)
    return bad("r", "a whole number from 1 to 65536");
  c.r = doc["r"].get<std::int64_t>();
  if (!doc.contains("lora_alpha") || !doc["lora_alpha"].is_number() || !(doc["lora_alpha"].get<double>() > 0) ||
      !std::isfinite(doc["lora_alpha"].get<double>()))
    return bad("lora_alpha", "a finite number > 0");
  c.lora_alpha = doc["lora_alpha"].get<double>();
  if (doc.contains("lora_dropout") && !doc["lora_dropout"].is_null()) {
    if (!doc["lora_dropout"].is_number() || doc["lora_dropout"].get<double>() < 0 || doc["lora_dropout"].get<double>() >= 1)
      return bad("lora_dropout", "a number in [0, 1)");
    c.lora_dropout = doc["lora_dropout"].get<double>();
  }
  // A list of names, or one string (a regular expression, checked here so that a bad one is
  // named now, not at the match).
  auto names_or_regex = [&](std::string_view key, std::vector<std::string>& names, bool& regex) -> Result<void> {
    const std::string k(key);
    if (!doc.contains(k) || doc[k].is_null()) return {};
    const json& t = doc[k];
    if (t.is_string()) {
      names.push_back(t.get<std::string>());
      regex = true;
      if (names.back() == "all-linear" && key == "target_modules") return {};
      // std::regex compiles and matches by recursion: a long or deeply grouped pattern could
      // overflow the stack. Module names are short; so are the patterns that select them.
      int depth = 0, deepest = 0;
      for (const char ch : names.back()) {
        depth += ch == '(' ? 1 : ch == ')' ? -1 : 0;
        deepest = std::max(deepest, depth);
      }
      if (names.back().size() > 1024 || deepest > 16)
        return bad(key, "a regular expression of at most 1024 characters and 16 nested groups");
      // libstdc++'s compiler reads a back-reference's or a repeat's number into a long without a
      // bound (signed overflow: undefined behaviour, found by the PEFT config fuzzer); a module
      // name's numbers are short.
      std::size_t digits = 0, longest = 0;
      for (const char ch : names.back()) {
        digits = ch >= '0' && ch <= '9' ? digits + 1 : 0;
        longest = std::max(longest, digits);
      }
      if (longest > 9) return bad(key, "a regular expression whose numbers have at most 9 digits");
      try {
        (void)outside_regex(names.back());
      } catch (const std::regex_error& e) {
        return bad(key, std::string("a list of module names or a regular expression (") + e.what() + ")");
      }
      return {};
    }
    if (t.is_array() && t.size() <= 4096 && std::all_of(t.begin(), t.end(), [](const json& v) { return v.is_string(); })) {
      for (const auto& v : t) names.push_back(v.get<std::string>());
      return {};
    }
    return bad(key, "a list of module names or a regular expression");
  };
  COSHARD_TRY(names_or_regex("target_modules", c.target_modules, c.target_modules_regex));
  COSHARD_TRY(names_or_regex("exclude_modules", c.exclude_modules, c.exclude_modules_regex));
  if (doc.contains("layers_to_transform") && !doc["layers_to_transform"].is_null()) {
    const json& l = doc["layers_to_transform"];
    auto index = [](const json& v) { return v.is_number_integer() && v.get<std::int64_t>() >= 0 && v.get<std::int64_t>() < (1 << 20); };
    if (index(l)) {
      c.layers_to_transform.push_back(l.get<std::int64_t>());
    } else if (l.is_array() && l.size() <= 4096 && std::all_of(l.begin(), l.end(), index)) {
      for (const auto& v : l) c.layers_to_transform.push_back(v.get<std::int64_t>());
    } else {
      return bad("layers_to_transform", "a block index or a list of them");
    }
  }
  if (doc.contains("layers_pattern") && !doc["layers_pattern"].is_null()) {
    const json& l = doc["layers_pattern"];
    if (l.is_string()) {
      c.layers_pattern.push_back(l.get<std::string>());
    } else if (l.is_array() && l.size() <= 64 && std::all_of(l.begin(), l.end(), [](const json& v) { return v.is_string(); })) {
      for (const auto& v : l) c.layers_pattern.push_back(v.get<std::string>());
    } else {
      return bad("layers_pattern", "a name or a list of names");
    }
    for (const auto& pattern : c.layers_pattern) {  // (each a piece of a regular expression, as in PEFT)
      bool compiles = pattern.size() <= 256 && std::count(pattern.begin(), pattern.end(), '(') <= 16;
      try {
        if (compiles) (void)outside_regex("^.*\\." + pattern + "\\.(\\d+)\\.");
      } catch (const std::regex_error&) {
        compiles = false;
      }
      if (!compiles) return bad("layers_pattern", "block container names (pieces of a regular expression, at most 256 characters)");
    }
  }
  if (doc.contains("base_model_name_or_path") && doc["base_model_name_or_path"].is_string())
    c.base_model_name_or_path = doc["base_model_name_or_path"].get<std::string>();
  // What coshard's adapters do not do, refused rather than loaded wrongly.
  if (doc.contains("use_dora") && doc["use_dora"] == true) return bad("use_dora", "false (DoRA is not LoRA)");
  if (doc.contains("use_rslora") && doc["use_rslora"] == true) return bad("use_rslora", "false (the scale is alpha / r)");
  if (doc.contains("bias") && doc["bias"].is_string() && doc["bias"] != "none") return bad("bias", "\"none\"");
  if (doc.contains("rank_pattern") && doc["rank_pattern"].is_object() && !doc["rank_pattern"].empty())
    return bad("rank_pattern", "empty (one rank for every adapter)");
  if (doc.contains("alpha_pattern") && doc["alpha_pattern"].is_object() && !doc["alpha_pattern"].empty())
    return bad("alpha_pattern", "empty (one alpha for every adapter)");
  return c;
}

bool peft_targets_module(const PeftAdapterConfig& c, std::string_view key) {
  auto full_match = [&](const std::string& pattern) {
    try {
      return std::regex_match(key.begin(), key.end(), outside_regex(pattern));
    } catch (const std::regex_error&) {
      return false;  // (checked when read)
    }
  };
  auto listed = [&](const std::vector<std::string>& names) {
    return std::any_of(names.begin(), names.end(), [&](const std::string& n) { return modules::peft_list_matches(n, key); });
  };
  if (!c.exclude_modules.empty() && (c.exclude_modules_regex ? full_match(c.exclude_modules.front()) : listed(c.exclude_modules)))
    return false;
  if (c.target_modules_regex) {
    // PEFT's "all-linear": every linear layer but the output layer.
    if (c.target_modules.front() == "all-linear") return key != "lm_head";
    return full_match(c.target_modules.front());
  }
  if (std::find(c.target_modules.begin(), c.target_modules.end(), key) != c.target_modules.end()) return true;
  if (!listed(c.target_modules)) return false;
  if (c.layers_to_transform.empty()) return true;
  // The block index: the number after "<pattern>." (any name when no pattern) followed by a dot.
  std::optional<std::int64_t> index;
  const std::vector<std::string> patterns = c.layers_pattern.empty() ? std::vector<std::string>{"[^.]*"} : c.layers_pattern;
  for (const auto& pattern : patterns) {
    std::match_results<std::string_view::const_iterator> m;
    try {
      if (std::regex_search(key.begin(), key.end(), m, outside_regex("^.*\\." + pattern + "\\.(\\d+)\\."))) {
        index = std::stoll(m[1].str());
        break;
      }
    } catch (const std::exception&) {
    }
  }
  return index && std::find(c.layers_to_transform.begin(), c.layers_to_transform.end(), *index) != c.layers_to_transform.end();
}

Result<std::vector<std::string>> peft_llama_targets(const PeftAdapterConfig& c, std::int64_t layers, bool untied_head) {
  modules::LlamaConfig dense;
  dense.layers = layers;
  dense.tie_embeddings = !untied_head;
  return peft_llama_targets(c, dense);
}

Result<std::vector<std::string>> peft_llama_targets(const PeftAdapterConfig& c, const modules::LlamaConfig& model) {
  const std::int64_t layers = model.layers;
  std::vector<std::string> out;
  auto take = [&](std::string key) {
    if (peft_targets_module(c, key)) out.push_back(std::move(key));
  };
  for (std::int64_t l = 0; l < layers; ++l) {
    for (const char* projection : {"q_proj", "k_proj", "v_proj", "o_proj"}) take(modules::llama_module_name(l, projection));
    if (!model.moe_layer(l)) {
      for (const char* projection : {"gate_proj", "up_proj", "down_proj"}) take(modules::llama_module_name(l, projection));
      continue;
    }
    const bool mixtral = model.family == modules::HfFamily::mixtral;
    for (std::int64_t e = 0; e < model.moe.experts; ++e)
      for (const char* projection : mixtral ? std::array{"w1", "w3", "w2"} : std::array{"gate_proj", "up_proj", "down_proj"})
        take(modules::llama_expert_module_name(l, e, projection));
  }
  if (!model.tie_embeddings && peft_targets_module(c, "lm_head")) out.push_back("lm_head");
  if (out.empty()) {
    std::string given;
    for (const auto& t : c.target_modules) given += (given.empty() ? "" : ", ") + async::bounded_echo(t);
    return fail(ErrorCode::invalid_argument, "target_modules ", c.target_modules_regex ? "\"" : "[", given,
                c.target_modules_regex ? "\"" : "]", c.layers_to_transform.empty() ? "" : " with layers_to_transform",
                c.exclude_modules.empty() ? "" : " and exclude_modules", " selects no module of this Llama (", layers,
                " blocks)");
  }
  return out;
}

Result<PeftAdapterConfig> read_peft_config(const fs::path& folder) {
  const fs::path path = folder / kPeftConfigName;
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, std::size_t{1} << 20, "adapter_config.json"));
  return parse_peft_config(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()), path.string());
}

Result<std::vector<GatheredParameter>> merge_lora(Module& model, std::vector<GatheredParameter> params, DataType dtype) {
  const auto names = peft_names(model, false);
  std::set<std::string> adapter_tensors;
  std::map<std::string, std::size_t> index;
  for (std::size_t i = 0; i < params.size(); ++i) index[params[i].name] = i;
  for (const auto& n : names) {
    const LoraAdapter& a = *n.adapter;
    const std::string linear = n.path.substr(0, n.path.rfind('.'));
    const auto w = index.find(linear + ".weight"), pa = index.find(n.path + ".A"), pb = index.find(n.path + ".B");
    if (w == index.end() || pa == index.end() || pb == index.end())
      return fail(ErrorCode::invalid_argument, "merging LoRA: ", n.path, " or its layer's weight is not among the parameters");
    GatheredParameter& weight = params[w->second];
    const auto wv = modules::decode_values(weight.bytes, dtype);
    const auto av = modules::decode_values(params[pa->second].bytes, dtype);
    const auto bv = modules::decode_values(params[pb->second].bytes, dtype);
    // (in the whole layer: a tensor-parallel adapter's values here are whole too)
    const std::int64_t in = a.whole_in(), r = a.rank(), rows = a.whole_row_end() - a.whole_row_begin();
    if (static_cast<std::int64_t>(av.size()) != r * in || static_cast<std::int64_t>(bv.size()) != rows * r ||
        static_cast<std::int64_t>(wv.size()) < a.whole_row_end() * in)
      return fail(ErrorCode::internal, "merging LoRA: ", n.path, ": sizes do not match its layer");
    std::vector<double> merged = wv;
    const double scale = a.alpha() / static_cast<double>(r);
    for (std::int64_t i = 0; i < rows; ++i)
      for (std::int64_t j = 0; j < in; ++j) {
        double delta = 0;
        for (std::int64_t k = 0; k < r; ++k)
          delta += bv[static_cast<std::size_t>(i * r + k)] * av[static_cast<std::size_t>(k * in + j)];
        merged[static_cast<std::size_t>((a.whole_row_begin() + i) * in + j)] += scale * delta;
      }
    weight.bytes = modules::encode_values(merged, dtype);
    adapter_tensors.insert(n.path + ".A");
    adapter_tensors.insert(n.path + ".B");
  }
  std::vector<GatheredParameter> out;
  for (auto& p : params)
    if (!adapter_tensors.contains(p.name)) out.push_back(std::move(p));
  return out;
}

async::Task<Result<void>> export_peft_adapter(Engine& engine, Module& model, const fs::path& folder, bool llama,
                                              std::string base_model_name_or_path) {
  const DataType dtype = engine.options().dtype;
  const auto file_dtype = modules::safe_dtype_of(dtype);
  if (!file_dtype) co_return fail(ErrorCode::unsupported, "export_peft_adapter: dtype ", async::to_string(dtype));
  COSHARD_CO_TRY_ASSIGN(const PeftAdapterConfig config, peft_config_of(model, llama, std::move(base_model_name_or_path)));
  const auto names = peft_names(model, llama);
  auto write = [folder, config, names, file_dtype = *file_dtype](const std::vector<GatheredParameter>& params) -> Result<void> {
    const auto values = by_name(params);
    std::vector<modules::SafeTensorView> views;
    for (const auto& n : names)
      for (const auto& [from, to] : {std::pair{n.path + ".A", n.a}, std::pair{n.path + ".B", n.b}}) {
        const auto it = values.find(from);
        if (it == values.end()) return fail(ErrorCode::internal, "export_peft_adapter: no parameter ", from);
        const auto dims = it->second->shape.dims();
        views.push_back({to, file_dtype, std::vector<std::int64_t>(dims.begin(), dims.end()), it->second->bytes});
      }
    COSHARD_TRY(async::check_output_folder(folder, "PEFT adapter folder"));  // created when absent
    COSHARD_TRY(modules::save_safetensors(folder / kPeftWeightsName, views, {{"format", "pt"}, {"producer", "coshard"}}));
    return async::write_file_atomic(folder / kPeftConfigName, peft_config_json(config));
  };
  co_return co_await engine.export_parameters("export of the PEFT adapter folder " + folder.string(), std::move(write));
}

async::Task<Result<void>> load_peft_adapter(Engine& engine, Module& model, const fs::path& folder, bool llama) {
  const DataType dtype = engine.options().dtype;
  const auto names = peft_names(model, llama);
  if (names.empty()) co_return fail(ErrorCode::invalid_argument, "loading the PEFT folder ", folder.string(), ": the model has no LoRA adapters");
  std::set<const modules::Parameter*> adapters;
  for (const auto& n : names) adapters.insert({&n.adapter->a(), &n.adapter->b()});
  // The folder's tensors, whole (under tensor parallelism the load cuts each rank's part); every
  // other parameter keeps its value.
  auto read = [folder, names, dtype]() -> Result<std::vector<GatheredParameter>> {
    COSHARD_TRY_ASSIGN(const PeftAdapterConfig config, read_peft_config(folder));
    const LoraAdapter& first = *names.front().adapter;
    if (config.r != first.rank() || config.lora_alpha != first.alpha())
      return fail(ErrorCode::invalid_argument, (folder / kPeftConfigName).string(), ": r=", config.r, " lora_alpha=",
                  config.lora_alpha, ", the model's adapters have rank ", first.rank(), " and alpha ", first.alpha());
    const fs::path path = folder / kPeftWeightsName;
    COSHARD_TRY_ASSIGN(auto file, modules::SafetensorsFile::load(path));
    std::map<std::string, std::pair<std::string, const modules::Parameter*>> wanted;  // PEFT name -> coshard's, and which
    for (const auto& n : names) {
      wanted[n.a] = {n.path + ".A", &n.adapter->a()};
      wanted[n.b] = {n.path + ".B", &n.adapter->b()};
    }
    std::vector<GatheredParameter> out;
    std::set<std::string> found;
    for (const auto& t : file.tensors()) {
      const auto it = wanted.find(t.name);
      if (it == wanted.end())
        return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name, " is no adapter of this model");
      COSHARD_TRY_ASSIGN(auto value, detail::decode_parameter(path.string(), t.name, t.dtype, t.shape, file.data(t), dtype));
      const modules::Shape& whole = it->second.second->whole_shape();
      if (!(value.shape == whole))
        return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name, " is ", value.shape.to_string(),
                    ", the model's adapter (r=", config.r, " in ", kPeftConfigName, ") is ", whole.to_string());
      value.name = it->second.first;
      found.insert(t.name);
      out.push_back(std::move(value));
    }
    for (const auto& [peft, ours] : wanted)
      if (!found.contains(peft))
        return fail(ErrorCode::invalid_argument, path.string(), ": no tensor ", peft, " (the adapter ", ours.first, ")");
    return out;
  };
  // (named: GCC 12 destroys temporaries in co_await twice)
  std::string what = "loading the PEFT folder " + folder.string();
  Engine::ParameterFilter kept = [adapters = std::move(adapters)](const modules::Parameter& p) { return !adapters.contains(&p); };
  co_return co_await engine.load_parameters_from(std::move(what), std::move(read), std::move(kept));
}

}  // namespace coshard::zero
