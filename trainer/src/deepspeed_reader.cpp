// ConfigReader (deepspeed_reader.hpp): a DeepSpeed config's values read in their forms, and the
// keys of the settings table read by each setting's kind.
#include "deepspeed_reader.hpp"

#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <system_error>

#include "coshard/async/json_limits.hpp"

namespace coshard::trainer::detail {

using json = nlohmann::json;

std::optional<double> ConfigReader::number(const json& v, const std::string& key) {
  if (v.is_number()) return v.get<double>();
  if (v.is_string()) {
    const auto s = v.get<std::string>();
    double d = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), d);
    if (ec == std::errc{} && end == s.data() + s.size()) return d;
    bad.push_back(key + "=\"" + async::bounded_echo(s) + "\" (expected a number" + (s == "auto" ? "; 'auto' is not supported" : "") + ")");
    return std::nullopt;
  }
  bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected a number)");
  return std::nullopt;
}

std::optional<std::size_t> ConfigReader::count(const json& v, const std::string& key) {
  if (v.is_number_unsigned() || v.is_number_integer()) {  // exactly, where a double would round past 2^53
    const bool fits = v.is_number_unsigned() ? v.get<std::uint64_t>() <= (std::uint64_t{1} << 62) : v.get<std::int64_t>() >= 0;
    if (fits) return static_cast<std::size_t>(v.is_number_unsigned() ? v.get<std::uint64_t>() : static_cast<std::uint64_t>(v.get<std::int64_t>()));
    bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected a whole number from 0 to 2^62)");
    return std::nullopt;
  }
  auto d = number(v, key);
  if (!d) return std::nullopt;
  constexpr double kMax = 4611686018427387904.0;  // 2^62
  if (*d < 0 || *d != std::floor(*d) || *d > kMax) {
    bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected a whole number from 0 to 2^62)");
    return std::nullopt;
  }
  return static_cast<std::size_t>(*d);
}

std::optional<bool> ConfigReader::boolean(const json& v, const std::string& key) {
  if (v.is_boolean()) return v.get<bool>();
  bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected true or false)");
  return std::nullopt;
}

std::optional<std::string> ConfigReader::string(const json& v, const std::string& key) {
  if (v.is_string()) return v.get<std::string>();
  bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected a string)");
  return std::nullopt;
}

bool ConfigReader::object(const json& v, const std::string& key) {
  if (v.is_object()) return true;
  bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected an object)");
  return false;
}

void ConfigReader::setting(const Setting& s, const json& v, const std::string& key, TrainerConfig& c,
                           std::size_t element, bool in_elements) {
  std::string text;
  switch (s.kind) {
    case SettingKind::integer: {
      // (a string that starts as a number is one: "5e7", as DeepSpeed allows)
      const bool numeric_text = v.is_string() && !v.get<std::string>().empty() &&
                                (std::isdigit(static_cast<unsigned char>(v.get<std::string>()[0])) ||
                                 v.get<std::string>()[0] == '-');
      if (v.is_string() && !numeric_text) {
        // A word the setting takes for a number ("local" for shard_group_size); a number must
        // be written as one.
        TrainerConfig scratch = c;
        const auto given = v.get<std::string>();
        if (s.parse(s, scratch, given)) {
          text = given;
          break;
        }
      }
      // A whole number as written, exactly: the setting's own range decides (--seed takes up to
      // 2^64 - 1 on the command line, and --print-config's JSON of it reads back).
      if (v.is_number_unsigned() || v.is_number_integer()) {
        text = v.dump();
        break;
      }
      // Not a number, nor a word it takes (2.5, true, null, "abc"): what the setting expects.
      const bool whole = v.is_number_float() && std::floor(v.get<double>()) == v.get<double>();
      if (!whole && !numeric_text && !s.expected.empty()) {
        bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (expected " + std::string(s.expected) + ")");
        return;
      }
      auto n = count(v, key);
      if (!n) return;
      text = std::to_string(*n);
      break;
    }
    case SettingKind::bytes: {
      if (v.is_string()) {
        // A size with its unit under coshard's own name; under DeepSpeed's, a count, or "auto"
        // where the setting takes it (the prefetch).
        TrainerConfig scratch = c;
        const auto given = v.get<std::string>();
        if (!in_elements || (given == "auto" && s.parse(s, scratch, given))) {
          text = given;
          break;
        }
      }
      auto n = count(v, key);
      if (!n) return;
      if (in_elements && *n > (std::size_t{1} << 62) / element) {
        bad.push_back(key + "=" + async::bounded_echo(v.dump()) + " (" + std::to_string(element) +
                      " bytes an element: more than 2^62 bytes)");
        return;
      }
      text = std::to_string(in_elements ? *n * element : *n);
      break;
    }
    case SettingKind::real: {
      auto d = number(v, key);
      if (!d) return;
      char buffer[64];
      const auto end = std::to_chars(buffer, buffer + sizeof buffer, *d).ptr;
      text.assign(buffer, end);
      break;
    }
    case SettingKind::boolean: {
      auto b = boolean(v, key);
      if (!b) return;
      text = *b ? "true" : "false";
      break;
    }
    case SettingKind::choice: {
      auto t = string(v, key);
      if (!t) return;
      text = *t;
      break;
    }
  }
  give(s, key, text, c);
}

void ConfigReader::give(const Setting& s, const std::string& key, const std::string& text, TrainerConfig& c) {
  if (auto [it, first] = given.try_emplace(std::string(s.name), key, text); !first) {
    if (it->second.second != text)
      bad.push_back(it->second.first + "=" + async::bounded_echo(it->second.second, 64) + " and " + key + "=" +
                    async::bounded_echo(text, 64) + " (two names for " + std::string(s.name) +
                    ": expected one value, or one of them)");
    return;
  }
  if (auto ok = s.set(c, text, key); !ok) bad.push_back(ok.error().message());
}

}  // namespace coshard::trainer::detail
