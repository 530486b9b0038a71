// Limits on JSON that comes from outside (configs, manifests, indexes, flight records, safetensors
// headers), applied before a document is parsed, and on values echoed back in messages.
//
// nlohmann-json parses deep nesting without trouble, but printing or walking such a value
// recurses once per level: a 200 KB file of depth 100,000 overflowed the stack of every reader
// that named a bad value in its error. So every reader first checks the raw text's nesting (a
// linear scan, no recursion) and refuses more than kMaxJsonDepth levels by name; and a value
// echoed in a message is cut to a few dozen characters, so a 15 MB string is not printed whole.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "coshard/async/result.hpp"

namespace coshard::async {

// Far deeper than any config, manifest or index coshard reads (they nest 4 levels at most).
inline constexpr int kMaxJsonDepth = 64;

// The text's arrays and objects nest at most `max_depth` levels (strings and their escapes are
// skipped), else an error naming `source`, the limit and where the limit was passed.
Result<void> check_json_nesting(std::string_view text, std::string_view source, int max_depth = kMaxJsonDepth);

// `text` for a message: whole when short, else its first `max_chars` characters and how long it
// was. Control characters are shown as '?'.
std::string bounded_echo(std::string_view text, std::size_t max_chars = 64);

}  // namespace coshard::async
