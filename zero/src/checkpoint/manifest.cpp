#include "coshard/zero/checkpoint.hpp"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>

#include "checkpoint/files.hpp"
#include "coshard/async/json_limits.hpp"

namespace coshard::zero {

using json = nlohmann::json;

std::string checkpoint_rank_file(int rank) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "rank-%05d.safetensors", rank);
  return buf;
}

bool is_checkpoint_folder_name(std::string_view name) noexcept {
  if (!name.starts_with("step-") || name.size() == 5 || name.size() > 5 + 18) return false;  // fits an int64
  return std::all_of(name.begin() + 5, name.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
}

std::string tensor_folder_name(int rank, int size) {
  return "tensor-" + std::to_string(rank) + "-of-" + std::to_string(size);
}

int tensor_folder_size(std::string_view name) noexcept {
  if (!name.starts_with("tensor-")) return 0;
  int rank = -1, size = 0;
  const char* end = name.data() + name.size();
  const auto [of, e1] = std::from_chars(name.data() + 7, end, rank);
  if (e1 != std::errc{} || std::string_view(of, static_cast<std::size_t>(end - of)).substr(0, 4) != "-of-") return 0;
  const auto [at, e2] = std::from_chars(of + 4, end, size);
  if (e2 != std::errc{} || at != end || size < 2 || rank < 0 || rank >= size) return 0;
  // (digits only: from_chars takes a leading '-', and "tensor-01-of-2" is no name a save gives)
  return tensor_folder_name(rank, size) == name ? size : 0;
}

namespace {

// Typed, range-checked field access: the text may say anything.
struct Fields {
  std::string_view source;
  std::string error;

  const json* at(const json& obj, const char* key) {
    if (!error.empty()) return nullptr;
    if (!obj.is_object() || !obj.contains(key)) {
      error = std::string("missing field '") + key + "'";
      return nullptr;
    }
    return &obj[key];
  }
  std::optional<std::int64_t> integer(const json& obj, const char* key, std::int64_t lo, std::int64_t hi) {
    const json* v = at(obj, key);
    if (!v) return std::nullopt;
    if (!v->is_number_integer()) {
      error = std::string("field '") + key + "' is " + async::bounded_echo(v->dump()) + ", expected an integer";
      return std::nullopt;
    }
    // Unsigned values above INT64_MAX read as negative through get<int64_t>: refuse those too.
    if (v->is_number_unsigned() && v->get<std::uint64_t>() > static_cast<std::uint64_t>(hi)) {
      error = std::string("field '") + key + "' is " + async::bounded_echo(v->dump()) + ", expected " + std::to_string(lo) + ".." + std::to_string(hi);
      return std::nullopt;
    }
    const auto x = v->get<std::int64_t>();
    if (x < lo || x > hi) {
      error = std::string("field '") + key + "' is " + std::to_string(x) + ", expected " + std::to_string(lo) + ".." +
              std::to_string(hi);
      return std::nullopt;
    }
    return x;
  }
  std::optional<std::string> string(const json& obj, const char* key) {
    const json* v = at(obj, key);
    if (!v) return std::nullopt;
    if (!v->is_string()) {
      error = std::string("field '") + key + "' is " + async::bounded_echo(v->dump()) + ", expected a string";
      return std::nullopt;
    }
    return v->get<std::string>();
  }
};

std::optional<std::vector<std::byte>> unhex(std::string_view s) {
  if (s.size() % 2) return std::nullopt;
  std::vector<std::byte> out;
  auto v = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (std::size_t i = 0; i < s.size(); i += 2) {
    const int hi = v(s[i]), lo = v(s[i + 1]);
    if (hi < 0 || lo < 0) return std::nullopt;
    out.push_back(static_cast<std::byte>(hi * 16 + lo));
  }
  return out;
}

// A shape as saved, and its elements: at most modules::Shape's 4 dimensions, each and their
// product at most 2^50.
std::string parse_shape(const json& v, std::vector<std::int64_t>& out, std::int64_t& numel) {
  if (!v.is_array() || v.size() > 4) return "a shape is " + async::bounded_echo(v.dump()) + ", expected at most 4 sizes";
  numel = 1;
  for (const auto& d : v) {
    if (!d.is_number_integer() || d.get<std::int64_t>() < 0 || (d.is_number_unsigned() && d.get<std::uint64_t>() > (1ull << 50)) ||
        d.get<std::int64_t>() > (std::int64_t{1} << 50))
      return "a shape is " + async::bounded_echo(v.dump()) + ", expected sizes 0..2^50";
    out.push_back(d.get<std::int64_t>());
    numel = out.back() == 0 ? 0 : (numel > (std::int64_t{1} << 50) / out.back() ? (std::int64_t{1} << 50) + 1 : numel * out.back());
  }
  if (numel > (std::int64_t{1} << 50)) return "a shape is " + async::bounded_echo(v.dump()) + ", more than 2^50 elements";
  return {};
}

// A unit's "shapes" and "splits" (both absent in older manifests): one of each per parameter, the
// shapes' elements adding up to the unit's, each split a cut of its whole shape into `tensor`
// parts that gives the shape saved. The error text names what does not fit (empty: it all does).
std::string parse_shapes_and_splits(const json& u, int tensor, CheckpointManifest::Unit& unit) {
  if (!u.contains("shapes")) {
    if (u.contains("splits")) return "'splits' without 'shapes'";
    return {};
  }
  const json& shapes = u["shapes"];
  if (!shapes.is_array() || shapes.size() != unit.parameters.size())
    return "'shapes' is not an array of " + std::to_string(unit.parameters.size()) + " shapes (one per parameter)";
  std::int64_t total = 0;
  for (const auto& s : shapes) {
    std::vector<std::int64_t> shape;
    std::int64_t numel = 0;
    if (auto error = parse_shape(s, shape, numel); !error.empty()) return error;
    total += numel;
    if (total > unit.numel) break;
    unit.shapes.push_back(std::move(shape));
  }
  if (total != unit.numel)
    return "its parameters' shapes hold " + std::to_string(total) + (total > unit.numel ? " or more" : "") +
           " elements, its 'numel' says " + std::to_string(unit.numel);
  if (!u.contains("splits")) return {};
  const json& splits = u["splits"];
  if (!splits.is_array() || splits.size() != unit.parameters.size())
    return "'splits' is not an array of " + std::to_string(unit.parameters.size()) + " splits (one per parameter)";
  for (std::size_t i = 0; i < splits.size(); ++i) {
    const json& s = splits[i];
    if (s.is_null()) {
      unit.splits.emplace_back();
      continue;
    }
    const std::string who = "the split of " + async::bounded_echo(unit.parameters[i]);
    if (tensor < 2) return who + ": saved without tensor parallelism";
    if (!s.is_object() || !s.contains("dim") || !s.contains("segments") || !s.contains("whole"))
      return who + " is " + async::bounded_echo(s.dump()) + ", expected {\"dim\", \"segments\", \"whole\"} or null";
    CheckpointManifest::Unit::Split split;
    std::int64_t whole_numel = 0;
    if (auto error = parse_shape(s["whole"], split.whole, whole_numel); !error.empty()) return who + ": " + error;
    const json& dim = s["dim"];
    if (!dim.is_number_integer() || dim.get<std::int64_t>() < 0 || dim.get<std::int64_t>() >= static_cast<std::int64_t>(split.whole.size()))
      return who + ": 'dim' is " + async::bounded_echo(dim.dump()) + ", expected a dimension of " + s["whole"].dump();
    split.dim = static_cast<int>(dim.get<std::int64_t>());
    const json& segments = s["segments"];
    if (!segments.is_array() || segments.empty() || segments.size() > 1024)
      return who + ": 'segments' is not an array of 1 to 1024 sizes";
    std::int64_t sum = 0;
    for (const auto& g : segments) {
      if (!g.is_number_integer() || g.get<std::int64_t>() < 1 || g.get<std::int64_t>() > split.whole[static_cast<std::size_t>(split.dim)] ||
          g.get<std::int64_t>() % tensor != 0)
        return who + ": a segment of " + async::bounded_echo(g.dump()) + ", expected a multiple of the tensor size " +
               std::to_string(tensor) + " within the split dimension";
      split.segments.push_back(g.get<std::int64_t>());
      sum += split.segments.back();
    }
    if (sum != split.whole[static_cast<std::size_t>(split.dim)])
      return who + ": its segments add up to " + std::to_string(sum) + ", its whole dimension " + std::to_string(split.dim) +
             " is " + std::to_string(split.whole[static_cast<std::size_t>(split.dim)]);
    auto part = split.whole;
    part[static_cast<std::size_t>(split.dim)] /= tensor;
    if (part != unit.shapes[i]) return who + ": one part of " + std::to_string(tensor) + " is not the shape saved";
    unit.splits.push_back(std::move(split));
  }
  return {};
}

// One unit's record (what a load checks its blocks against), into `unit`; the error's text, or
// empty when it reads.
std::string parse_unit(const json& u, Fields& f, int world, int tensor_size, CheckpointManifest::Unit& unit) {
  const auto name = f.string(u, "name");
  const auto numel = f.integer(u, "numel", 0, std::int64_t{1} << 50);
  const auto shard = f.integer(u, "shard", 0, std::int64_t{1} << 50);
  const json* params = f.at(u, "parameters");
  if (!f.error.empty()) return f.error;
  if (!params->is_array()) return "unit " + *name + ": 'parameters' is not an array";
  for (const auto& p : *params) {
    if (!p.is_string()) return "unit " + async::bounded_echo(*name) + ": a parameter name is " + async::bounded_echo(p.dump());
    unit.parameters.push_back(p.get<std::string>());
  }
  if (u.contains("frozen")) {  // (absent in checkpoints from before frozen units kept no state)
    if (!u["frozen"].is_boolean()) return "unit " + async::bounded_echo(*name) + ": 'frozen' is not true or false";
    unit.frozen = u["frozen"].get<bool>();
  }
  if (u.contains("saved")) {  // (absent before frozen units could be left out: saved)
    if (!u["saved"].is_boolean()) return "unit " + async::bounded_echo(*name) + ": 'saved' is not true or false";
    unit.saved = u["saved"].get<bool>();
    if (!unit.saved && !unit.frozen) return "unit " + async::bounded_echo(*name) + ": left out but not frozen";
  }
  unit.name = *name;
  unit.numel = *numel;
  unit.shard = *shard;
  unit.shard_ranks = world;
  if (u.contains("shard_ranks")) {  // (absent before hybrid sharding: the whole world)
    const auto ranks = f.integer(u, "shard_ranks", 1, world);
    if (!ranks) return f.error;
    unit.shard_ranks = static_cast<int>(*ranks);
  }
  if (u.contains("first_file")) {  // (absent before expert parallelism: 0)
    const auto first = f.integer(u, "first_file", 0, world - unit.shard_ranks);
    if (!first) return f.error;
    unit.first_file = static_cast<int>(*first);
  }
  if (auto error = parse_shapes_and_splits(u, tensor_size, unit); !error.empty())
    return "unit " + async::bounded_echo(unit.name) + ": " + error;
  if (unit.shard * unit.shard_ranks < unit.numel)
    return "unit " + unit.name + ": shard " + std::to_string(unit.shard) + " x shard_ranks " +
         std::to_string(unit.shard_ranks) + " does not cover numel " + std::to_string(unit.numel);
  return {};
}

}  // namespace

Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, std::string_view source) {
  auto bad = [&](std::string_view what) {
    return fail(ErrorCode::invalid_argument, "checkpoint manifest ", source, ": ", what);
  };
  if (auto nested = async::check_json_nesting(text, source); !nested)
    return fail(std::move(nested).error().with_context("checkpoint manifest"));
  const json m = json::parse(text.begin(), text.end(), nullptr, false);
  if (m.is_discarded() || !m.is_object()) return bad("not a JSON object");
  Fields f{source, {}};
  const auto format = f.string(m, "format");
  if (!format) return bad(f.error);
  if (*format != CheckpointManifest::kFormat) return bad("'format' is not \"coshard-checkpoint\"");
  const auto version = f.integer(m, "version", 0, 1 << 30);
  if (!version) return bad(f.error);
  if (*version != CheckpointManifest::kVersion)
    return bad("version " + std::to_string(*version) + " (expected " + std::to_string(CheckpointManifest::kVersion) + ")");

  CheckpointManifest out;
  const auto step = f.integer(m, "step", 0, std::int64_t{1} << 62);
  const auto world = f.integer(m, "world_size", 1, 1 << 24);
  const auto stage = f.integer(m, "zero_stage", 0, 3);
  const auto dtype = f.string(m, "dtype");
  const auto optimizer = f.string(m, "optimizer");
  const auto state = f.string(m, "optimizer_state");
  if (!f.error.empty()) return bad(f.error);
  out.step = *step;
  out.world = static_cast<int>(*world);
  out.zero_stage = static_cast<int>(*stage);
  out.dtype = *dtype;
  out.optimizer = *optimizer;
  auto state_bytes = unhex(*state);
  if (!state_bytes || state_bytes->size() != 32) return bad("optimizer_state is not 32 bytes of hex");
  out.optimizer_state = std::move(*state_bytes);

  if (m.contains("tensor_parallel")) {  // (absent without tensor parallelism, and before it)
    const json& tp = m["tensor_parallel"];
    const auto size = f.integer(tp, "size", 1, 1 << 16);
    const auto rank = f.integer(tp, "rank", 0, (1 << 16) - 1);
    if (!f.error.empty()) return bad("'tensor_parallel': " + f.error);
    if (*rank >= *size) return bad("'tensor_parallel': rank " + std::to_string(*rank) + " of size " + std::to_string(*size));
    out.tensor_size = static_cast<int>(*size);
    out.tensor_rank = static_cast<int>(*rank);
  }

  const json* units = f.at(m, "units");
  if (!units || !units->is_array()) return bad(f.error.empty() ? "'units' is not an array" : f.error);
  for (const auto& u : *units) {
    CheckpointManifest::Unit unit;
    if (auto error = parse_unit(u, f, out.world, out.tensor_size, unit); !error.empty()) return bad(error);
    out.units.push_back(std::move(unit));
  }

  const json* files = f.at(m, "files");
  if (!files || !files->is_array()) return bad(f.error.empty() ? "'files' is not an array" : f.error);
  if (files->size() != static_cast<std::size_t>(out.world))
    return bad("'files' lists " + std::to_string(files->size()) + " files for world_size " + std::to_string(out.world));
  for (int r = 0; r < out.world; ++r) {
    const auto& file = (*files)[static_cast<std::size_t>(r)];
    const auto rank = f.integer(file, "rank", 0, 1 << 24);
    const auto name = f.string(file, "name");
    const auto bytes = f.integer(file, "bytes", 0, std::int64_t{1} << 60);
    const auto crc = f.integer(file, "crc32", 0, 0xffffffffll);
    if (!f.error.empty()) return bad(f.error);
    if (*rank != r) return bad("files out of rank order");
    if (*name != checkpoint_rank_file(r)) return bad("file of rank " + std::to_string(r) + " is named '" + *name + "'");
    out.files.push_back({*name, static_cast<std::uint64_t>(*bytes), static_cast<std::uint32_t>(*crc)});
  }
  if (m.contains("run")) {
    const json& run = m["run"];
    if (!run.is_object() || run.size() > detail::kRunFields)
      return bad("'run' is not an object of at most " + std::to_string(detail::kRunFields) + " strings");
    for (const auto& [key, value] : run.items()) {
      if (!value.is_string()) return bad("'run' field '" + key.substr(0, 64) + "' is not a string");
      out.run.emplace(key, value.get<std::string>());
    }
    if (auto error = detail::run_identity_error(out.run); !error.empty()) return bad(error);
  }
  if (m.contains("steps_missed")) {
    const json& missed = m["steps_missed"];
    if (!missed.is_object()) return bad("'steps_missed' is not an object");
    std::size_t parameters = 0;
    for (const auto& u : out.units) parameters += u.parameters.size();
    if (missed.size() > parameters)
      return bad("'steps_missed' names " + std::to_string(missed.size()) + " parameters; the units hold " +
                 std::to_string(parameters));
    for (const auto& [name, count] : missed.items()) {
      if (name.size() > 4096) return bad("'steps_missed' names a parameter of " + std::to_string(name.size()) + " characters");
      const auto steps = f.integer(missed, name.c_str(), 1, out.step);
      if (!steps) return bad("'steps_missed': " + f.error);
      out.steps_missed.emplace(name, *steps);
    }
  }
  return out;
}

std::string detail::run_identity_error(const std::map<std::string, std::string>& run) {
  if (run.size() > kRunFields)
    return "'run' has " + std::to_string(run.size()) + " fields: at most " + std::to_string(kRunFields);
  for (const auto& [key, value] : run) {
    if (key.size() > kRunKeyChars)
      return "'run' field '" + key.substr(0, 64) + "...' has a name of " + std::to_string(key.size()) +
             " characters: at most " + std::to_string(kRunKeyChars);
    if (value.size() > kRunValueChars)
      return "'run' field '" + key + "' is " + std::to_string(value.size()) + " characters long: at most " +
             std::to_string(kRunValueChars);
  }
  return {};
}

}  // namespace coshard::zero
