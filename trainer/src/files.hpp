// Small-file helpers of the trainer (private): whole reads, fsync, and atomic replacement.
#pragma once

#include <cstddef>
#include <filesystem>
#include <string_view>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::trainer::detail {

Result<std::vector<std::byte>> read_file(const std::filesystem::path& path);
// fsync of a file or (flags with O_DIRECTORY) a folder.
Result<void> fsync_path(const std::filesystem::path& path, int flags);
// Replaces `path` atomically: a temporary beside it, fsync, rename, fsync the folder. A failure
// leaves no temporary behind and the old file untouched.
Result<void> write_file_atomic(const std::filesystem::path& path, std::string_view text);

}  // namespace coshard::trainer::detail
