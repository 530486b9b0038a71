// libFuzzer target: log level specs (outside input: COSHARD_LOG and --log-level). Properties: no
// crash or undefined behaviour; a refused spec changes no level; an accepted one leaves every
// component at a level that exists.
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "coshard/async/log.hpp"

using namespace coshard::log;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view spec(reinterpret_cast<const char*>(data), size);
  std::array<Level, kComponents> before{};
  for (std::size_t c = 0; c < kComponents; ++c) before[c] = level(static_cast<Component>(c));
  const auto done = configure(spec);
  for (std::size_t c = 0; c < kComponents; ++c) {
    const Level now = level(static_cast<Component>(c));
    if (!done && now != before[c]) std::abort();
    if (static_cast<int>(now) > static_cast<int>(Level::off)) std::abort();
  }
  return 0;
}
