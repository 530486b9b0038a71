// libFuzzer target: the safetensors reader (outside input: weight files from anywhere).
// Properties: no crash, no leak, no hang; a file that parses has every tensor's data inside the
// buffer and exactly as large as its dtype and shape say.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "coshard/modules/safetensors.hpp"

using namespace coshard::modules;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data), reinterpret_cast<const std::byte*>(data) + size);
  auto file = SafetensorsFile::parse(std::move(bytes), "fuzz");
  if (!file) return 0;
  for (const auto& t : file->tensors()) {
    auto d = file->data(t);
    std::size_t expected = size_of(t.dtype);
    for (auto dim : t.shape) expected *= static_cast<std::size_t>(dim);
    if (d.size() != expected) std::abort();
    volatile std::byte sink{};
    for (std::byte b : d) sink = b;  // every byte must be readable (ASan checks the bounds)
    (void)sink;
  }
  return 0;
}
