// libFuzzer target: zero::parse_peft_config (outside input: a PEFT folder's adapter_config.json,
// whose nested value once overflowed the stack) and PEFT's module selection over the config read
// (its regular expressions are outside input too). Properties: no crash, leak or hang; a config
// that parses selects modules of a small Llama or fails with a message, and what coshard writes
// for it parses back; every error is a Result with a message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "coshard/zero/peft.hpp"

using namespace coshard;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = zero::parse_peft_config(text, "adapter_config.json");
  if (!c) {
    if (c.error().message().empty()) std::abort();
    return 0;
  }
  auto targets = zero::peft_llama_targets(*c, 3, true);
  if (!targets && targets.error().message().empty()) std::abort();
  if (!c->target_modules_regex) {
    auto again = zero::parse_peft_config(zero::peft_config_json(*c), "written");
    if (!again || again->r != c->r || again->target_modules != c->target_modules) std::abort();
  }
  return 0;
}
