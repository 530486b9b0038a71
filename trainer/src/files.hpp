// Small-file helpers of the trainer (private): whole reads, fsync, and atomic replacement.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <limits>
#include <span>
#include <string_view>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::trainer::detail {

// A regular file read whole (at most `max_bytes`; the error names both sizes).
Result<std::vector<std::byte>> read_file(const std::filesystem::path& path,
                                         std::size_t max_bytes = std::numeric_limits<std::size_t>::max());
// CRC-32 (zlib's) of any number of bytes.
std::uint32_t crc32_of(std::span<const std::byte> bytes);
// fsync of a file or (flags with O_DIRECTORY) a folder.
Result<void> fsync_path(const std::filesystem::path& path, int flags);
// Replaces `path` atomically: a temporary beside it, fsync, rename, fsync the folder. A failure
// leaves no temporary behind and the old file untouched. Only a regular file is ever replaced
// (a device, folder or fifo at `path` is refused by name).
Result<void> write_file_atomic(const std::filesystem::path& path, std::string_view text);

}  // namespace coshard::trainer::detail
