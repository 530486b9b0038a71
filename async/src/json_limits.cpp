#include "coshard/async/json_limits.hpp"

namespace coshard::async {

Result<void> check_json_nesting(std::string_view text, std::string_view source, int max_depth) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (std::size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
      continue;
    }
    if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {  // comments (DeepSpeed configs allow them)
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      const auto end = text.find("*/", i + 2);
      i = end == std::string_view::npos ? text.size() : end + 1;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      if (++depth > max_depth)
        return fail(ErrorCode::invalid_argument, source, ": JSON nested deeper than ", max_depth,
                    " levels (at byte ", i, "); no file coshard reads nests that deep");
    } else if ((c == ']' || c == '}') && depth > 0) {
      --depth;
    }
  }
  return {};
}

std::string bounded_echo(std::string_view text, std::size_t max_chars) {
  std::string out(text.substr(0, max_chars));
  for (char& c : out)
    if (static_cast<unsigned char>(c) < 0x20) c = '?';
  if (text.size() > max_chars) out += "... (" + std::to_string(text.size()) + " characters)";
  return out;
}

}  // namespace coshard::async
