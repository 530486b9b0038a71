// TFRecord framing (the rules are at the top of coshard/trainer/tensorboard.hpp). CRC-32C is a
// table-driven byte loop: Debian ships no CRC-32C library for C++ (zlib's crc32 is the other
// polynomial), and a step's few hundred bytes do not need a faster one.
#include <array>
#include <cstring>

#include "coshard/trainer/tensorboard.hpp"

namespace coshard::trainer::tfrecord {
namespace {

constexpr std::array<std::uint32_t, 256> make_table() {
  std::array<std::uint32_t, 256> table{};
  for (std::uint32_t i = 0; i < 256; ++i) {
    std::uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;  // reflected Castagnoli
    table[i] = c;
  }
  return table;
}
constexpr auto kTable = make_table();

void put_u64(std::string& out, std::uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void put_u32(std::string& out, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
std::uint64_t get_le(std::span<const std::byte> bytes) {
  std::uint64_t v = 0;
  for (std::size_t i = bytes.size(); i-- > 0;) v = (v << 8) | static_cast<std::uint8_t>(bytes[i]);
  return v;
}
std::span<const std::byte> as_bytes(std::string_view s) { return std::as_bytes(std::span<const char>(s.data(), s.size())); }

}  // namespace

std::uint32_t crc32c(std::span<const std::byte> data) noexcept {
  std::uint32_t c = 0xFFFFFFFFu;
  for (std::byte b : data) c = kTable[(c ^ static_cast<std::uint8_t>(b)) & 0xff] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::uint32_t masked_crc32c(std::span<const std::byte> data) noexcept {
  const std::uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string frame(std::string_view payload) {
  std::string out;
  out.reserve(payload.size() + 16);
  put_u64(out, payload.size());
  put_u32(out, masked_crc32c(as_bytes(std::string_view(out.data(), 8))));
  out.append(payload);
  put_u32(out, masked_crc32c(as_bytes(payload)));
  return out;
}

Result<std::vector<std::string>> split(std::span<const std::byte> file, std::string_view name) {
  std::vector<std::string> records;
  std::size_t at = 0;
  while (at < file.size()) {
    const std::size_t index = records.size();
    if (file.size() - at < 12)
      return fail(ErrorCode::io, name, ": record ", index, " at offset ", at, ": ", file.size() - at,
                  " bytes left, fewer than a record's 12-byte header (a truncated file)");
    const auto header = file.subspan(at, 8);
    if (get_le(file.subspan(at + 8, 4)) != masked_crc32c(header))
      return fail(ErrorCode::io, name, ": record ", index, " at offset ", at, ": the length's CRC-32C does not match");
    const std::uint64_t length = get_le(header);
    if (length > file.size() - at - 12 || file.size() - at - 12 - length < 4)
      return fail(ErrorCode::io, name, ": record ", index, " at offset ", at, ": a payload of ", length, " bytes runs past the end (",
                  file.size(), " bytes; a truncated file)");
    const auto payload = file.subspan(at + 12, static_cast<std::size_t>(length));
    if (get_le(file.subspan(at + 12 + length, 4)) != masked_crc32c(payload))
      return fail(ErrorCode::io, name, ": record ", index, " at offset ", at, ": the payload's CRC-32C does not match");
    records.emplace_back(reinterpret_cast<const char*>(payload.data()), payload.size());
    at += 16 + static_cast<std::size_t>(length);
  }
  return records;
}

}  // namespace coshard::trainer::tfrecord
