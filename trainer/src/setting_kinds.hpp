// The kinds of a settings-table entry (settings_table.cpp), each made for one TrainerConfig field:
// integer<&TrainerConfig::seed>({...}, min, max) fills in the entry's kind and range, and the
// accessors that format the field (get), read text into it (parse) and test its range (check).
// An optional field reads and writes its value, an unset one as empty text.
#pragma once

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>

#include "coshard/trainer/config.hpp"
#include "coshard/trainer/settings.hpp"

namespace coshard::trainer::detail {

template <class T>
struct Unwrapped {
  using type = T;
  static constexpr bool optional = false;
};
template <class T>
struct Unwrapped<std::optional<T>> {
  using type = T;
  static constexpr bool optional = true;
};
template <auto Member>
using Field = std::remove_cvref_t<decltype(std::declval<TrainerConfig&>().*Member)>;

// Numbers as written back: integers in full, reals as the shortest text that reads back the same.
template <class T>
std::string format_value(const T& v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_floating_point_v<T>) {
    char text[64];  // the shortest text that reads back as the same value
    const auto end = std::to_chars(text, text + sizeof text, v).ptr;
    return std::string(text, end);
  } else {
    std::ostringstream out;
    out << v;
    return out.str();
  }
}

template <auto Member>
std::string get_value(const Setting&, const TrainerConfig& c) {
  const auto& v = c.*Member;
  if constexpr (Unwrapped<Field<Member>>::optional) return v ? format_value(*v) : std::string();
  else return format_value(v);
}

inline Result<void> in_range(const Setting& s, long double v, std::string_view label, const std::string& shown) {
  const bool above = s.min_open ? v > s.min : v >= s.min;
  const bool below = s.max_open ? v < s.max : v <= s.max;
  if (above && below) return {};  // (NaN is neither)
  return fail(ErrorCode::invalid_argument, label, "=", shown, ": expected ", s.expected);
}

template <auto Member>
Result<void> check_number(const Setting& s, const TrainerConfig& c, std::string_view label) {
  const auto& v = c.*Member;
  if constexpr (Unwrapped<Field<Member>>::optional) {
    if (!v) return {};
    return in_range(s, static_cast<long double>(*v), label, format_value(*v));
  } else {
    return in_range(s, static_cast<long double>(v), label, format_value(v));
  }
}

template <auto Member>
Result<void> parse_number(const Setting& s, TrainerConfig& c, std::string_view text) {
  using T = typename Unwrapped<Field<Member>>::type;
  const char* const end = text.data() + text.size();
  if constexpr (std::is_integral_v<T>) {
    T v{};
    const auto [stop, ec] = std::from_chars(text.data(), end, v);
    if (text.empty() || ec != std::errc{} || stop != end)
      return fail(ErrorCode::invalid_argument, "expected ", s.expected, " (given '", text, "')");
    c.*Member = v;
  } else {
    double v = 0;
    const auto [stop, ec] = std::from_chars(text.data(), end, v);
    if (text.empty() || ec != std::errc{} || stop != end)
      return fail(ErrorCode::invalid_argument, "expected a number (", s.expected, "; given '", text, "')");
    // Named as written, not as converted: 1e39 is no float (it would read as inf), and 1e-50 one
    // that rounds to 0.
    if constexpr (std::is_same_v<T, float>) {
      if (std::isfinite(v) && std::abs(v) > static_cast<double>(std::numeric_limits<float>::max()))
        return fail(ErrorCode::invalid_argument, "expected ", s.expected, ", within a float's range (at most 3.4e38)");
      if (v != 0 && static_cast<float>(v) == 0.0f)
        return fail(ErrorCode::invalid_argument, "expected ", s.expected, "; it rounds to 0 as a float (below 1.4e-45)");
    }
    c.*Member = static_cast<T>(v);
  }
  return {};
}

template <auto Member>
Result<void> parse_bytes(const Setting&, TrainerConfig& c, std::string_view text) {
  COSHARD_TRY_ASSIGN(c.*Member, parse_size(text));
  return {};
}

template <auto Member>
Result<void> parse_boolean(const Setting&, TrainerConfig& c, std::string_view text) {
  if (text == "true" || text == "1") c.*Member = true;
  else if (text == "false" || text == "0") c.*Member = false;
  else return fail(ErrorCode::invalid_argument, "expected true or false (given '", text, "')");
  return {};
}

inline Result<void> no_check(const Setting&, const TrainerConfig&, std::string_view) { return {}; }

// An enum whose values are 0, 1, ... in the order of `choices`.
template <auto Member>
std::string get_choice(const Setting& s, const TrainerConfig& c) {
  const auto i = static_cast<std::size_t>(c.*Member);
  if (i < s.choices.size()) return std::string(s.choices[i]);
  // (a value the setting does not take, set in code: its own name where its type has one)
  if constexpr (requires { to_string(c.*Member); }) return std::string(to_string(c.*Member));
  return std::to_string(i);
}
template <auto Member>
Result<void> parse_choice(const Setting& s, TrainerConfig& c, std::string_view text) {
  const auto at = std::find(s.choices.begin(), s.choices.end(), text);
  if (at == s.choices.end()) return fail(ErrorCode::invalid_argument, "expected ", s.expected);
  c.*Member = static_cast<Field<Member>>(at - s.choices.begin());
  return {};
}
template <auto Member>
Result<void> check_choice(const Setting& s, const TrainerConfig& c, std::string_view label) {
  if (static_cast<std::size_t>(c.*Member) < s.choices.size()) return {};
  return fail(ErrorCode::invalid_argument, label, "=", get_choice<Member>(s, c), ": expected ", s.expected);
}

// The helpers fill in the kind, the accessors and the range of an entry.
template <auto Member>
Setting ranged(Setting s, SettingKind kind, long double min, bool min_open, long double max, bool max_open) {
  s.kind = kind;
  s.min = min;
  s.min_open = min_open;
  s.max = max;
  s.max_open = max_open;
  s.get = get_value<Member>;
  s.parse = parse_number<Member>;
  s.check = check_number<Member>;
  return s;
}
template <auto Member>
Setting integer(Setting s, long double min, long double max) {
  return ranged<Member>(s, SettingKind::integer, min, false, max, false);
}
// A size of at most 2^62 bytes, the range a JSON config reads too (so --print-config's output of
// any value the command line takes reads back).
template <auto Member>
Result<void> check_bytes(const Setting& s, const TrainerConfig& c, std::string_view label) {
  constexpr std::size_t kMax = std::size_t{1} << 62;
  const auto& v = c.*Member;
  if constexpr (Unwrapped<Field<Member>>::optional) {
    if (!v || *v <= kMax) return {};
    return fail(ErrorCode::invalid_argument, label, "=", *v, ": expected ", s.expected, " of at most 2^62 bytes");
  } else {
    if (v <= kMax) return {};
    return fail(ErrorCode::invalid_argument, label, "=", v, ": expected ", s.expected, " of at most 2^62 bytes");
  }
}
template <auto Member>
Setting bytes(Setting s) {
  s.kind = SettingKind::bytes;
  s.min = 0;
  s.max = static_cast<long double>(std::size_t{1} << 62);
  s.get = get_value<Member>;
  s.parse = parse_bytes<Member>;
  s.check = check_bytes<Member>;
  return s;
}
// (no upper bound by default: an infinite max_grad_norm or weight_decay is the user's to try)
template <auto Member>
Setting real(Setting s, long double min, bool min_open, long double max = std::numeric_limits<long double>::infinity(),
             bool max_open = false) {
  return ranged<Member>(s, SettingKind::real, min, min_open, max, max_open);
}
template <auto Member>
Setting boolean(Setting s) {
  s.kind = SettingKind::boolean;
  s.get = get_value<Member>;
  s.parse = parse_boolean<Member>;
  s.check = no_check;
  return s;
}
template <auto Member>
Setting choice(Setting s, std::span<const std::string_view> choices) {
  s.kind = SettingKind::choice;
  s.choices = choices;
  s.get = get_choice<Member>;
  s.parse = parse_choice<Member>;
  s.check = check_choice<Member>;
  return s;
}

// A count of ranks, or local: the ranks of one node (the launcher's ranks per node, known when the
// engine is made; `Local` says so, and `Unset` is the count it leaves).
template <auto Size, auto Local, int Unset>
Setting ranks_or_local_setting(Setting meta, int lowest) {
  Setting s = integer<Size>(std::move(meta), lowest, 1 << 24);
  s.get = [](const Setting& self, const TrainerConfig& c) {
    return c.*Local ? std::string("local") : get_value<Size>(self, c);
  };
  s.parse = [](const Setting& self, TrainerConfig& c, std::string_view text) -> Result<void> {
    if (text == "local") {
      c.*Local = true;
      c.*Size = Unset;
      return {};
    }
    COSHARD_TRY(parse_number<Size>(self, c, text));  // (a negative one is refused by the range)
    c.*Local = false;
    return {};
  };
  return s;
}

// ZeRO++'s settings (settings_wire.cpp), where the table's parallelism puts them.
void add_less_on_the_wire_settings(std::vector<Setting>& t);

}  // namespace coshard::trainer::detail
