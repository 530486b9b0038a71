// libFuzzer target: TrainerConfig::from_json (outside input: users' DeepSpeed config files).
// Properties: no crash, leak or hang; a config that parses passes validate(); every error is a
// Result, never an exception.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "coshard/trainer/config.hpp"

using namespace coshard::trainer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  std::vector<std::string> notes;
  auto c = TrainerConfig::from_json(text, TrainerConfig{}, &notes);
  if (c && !c->validate()) std::abort();
  if (!c && c.error().message().empty()) std::abort();
  return 0;
}
