// libFuzzer target: TensorBoard event files as read back (outside input: a file another program,
// a crash or a person may have written). Properties: no crash, leak, hang or undefined behaviour;
// a file that parses has a version, and its records framed again are the same bytes (the framing
// is canonical: a length, its CRC, the payload, its CRC).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>

#include "coshard/trainer/tensorboard.hpp"

using namespace coshard::trainer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span<const std::uint8_t>(data, size));
  auto parsed = parse_tensorboard_file(bytes, "fuzz");
  auto records = tfrecord::split(bytes, "fuzz");
  if (parsed && !records) std::abort();
  if (parsed && parsed->file_version.empty()) std::abort();
  if (records) {
    std::string again;
    for (const auto& r : *records) again += tfrecord::frame(r);
    if (again.size() != size || (size > 0 && std::memcmp(again.data(), data, size) != 0)) std::abort();
  }
  return 0;
}
