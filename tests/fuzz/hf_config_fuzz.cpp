// libFuzzer target: zero::parse_hf_llama_config (outside input: a Hugging Face folder's
// config.json). Properties: no crash, leak or hang; a config that parses validates, and what
// coshard writes for it parses back to the same text; every error is a Result with a message.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "coshard/zero/hf_llama.hpp"

using namespace coshard;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto c = zero::parse_hf_llama_config(text, "config.json");
  if (!c) {
    if (c.error().message().empty()) std::abort();
    return 0;
  }
  if (!c->validate() || c->parameter_count() <= 0) std::abort();
  const std::string written = zero::hf_llama_config_json(*c, modules::DataType::bf16);
  auto again = zero::parse_hf_llama_config(written, "written");
  if (!again || zero::hf_llama_config_json(*again, modules::DataType::bf16) != written) std::abort();
  return 0;
}
