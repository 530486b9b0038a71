// What the Hugging Face formats share (private to src/formats): readers of config.json's fields,
// and how a coshard parameter stacks transformers' tensors.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "coshard/async/json_limits.hpp"
#include "coshard/async/result.hpp"
#include "coshard/modules/tensor.hpp"

namespace coshard::zero::detail {

using json = nlohmann::json;

// One coshard parameter and the transformers tensors it stacks, rows in order.
struct Piece {
  std::string hf_name;
  std::int64_t rows;  // 0: the whole parameter (no split)
};
struct Mapping {
  std::string name;
  modules::Shape shape;  // coshard's
  std::vector<Piece> pieces;
};

// Readers of the JSON fields, each failure naming the file and the key.
struct Fields {
  const json& doc;
  std::string_view source;
  Result<std::int64_t> integer(const char* key, std::optional<std::int64_t> fallback = std::nullopt) const {
    if (!doc.contains(key) || doc[key].is_null()) {
      if (fallback) return *fallback;
      return fail(ErrorCode::invalid_argument, source, ": \"", key, "\" is missing (expected a whole number)");
    }
    const json& v = doc[key];
    if (!v.is_number_integer() || v.get<std::int64_t>() < 0)
      return fail(ErrorCode::invalid_argument, source, ": \"", key, "\"=", async::bounded_echo(v.dump()), " (expected a whole number >= 0)");
    return v.get<std::int64_t>();
  }
  Result<double> number(const json& obj, const char* key, std::optional<double> fallback) const {
    if (!obj.contains(key) || obj[key].is_null()) {
      if (fallback) return *fallback;
      return fail(ErrorCode::invalid_argument, source, ": \"", key, "\" is missing (expected a number)");
    }
    const json& v = obj[key];
    if (!v.is_number())
      return fail(ErrorCode::invalid_argument, source, ": \"", key, "\"=", async::bounded_echo(v.dump()), " (expected a number)");
    return v.get<double>();
  }
  Result<bool> boolean(const char* key, bool fallback) const {
    if (!doc.contains(key) || doc[key].is_null()) return fallback;
    if (!doc[key].is_boolean())
      return fail(ErrorCode::invalid_argument, source, ": \"", key, "\"=", async::bounded_echo(doc[key].dump()), " (expected true or false)");
    return doc[key].get<bool>();
  }
};

}  // namespace coshard::zero::detail
