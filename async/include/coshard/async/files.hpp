// The file policy of every path a user names: outputs go only to regular files (or new paths in
// a folder that exists and can be written), never over a device, a folder or a fifo; inputs are
// regular files read whole with a size check, never a device that streams without end. Each
// refusal names the path, what it is, and what was expected.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <span>
#include <string_view>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::async {

// `what` names the role in messages ("--export", "trace"). The path may exist (then it must be a
// regular file, links followed) or not (then its folder must exist and take a new file: probed
// by creating and removing one).
Result<void> check_output_file(const std::filesystem::path& path, std::string_view what);
// A folder of outputs: an existing folder, or created now (with its parents); either way one a
// file can be created in (probed).
Result<void> check_output_folder(const std::filesystem::path& path, std::string_view what);
// Refuses anything but a regular file (after links) just before it is replaced: the last guard
// of a writer that renames a temporary over `path`.
Result<void> check_replaceable(const std::filesystem::path& path, std::string_view what);
// Refuses anything but an existing regular file (links followed), naming what it is: for a reader
// that opens the path itself (a fifo would block its open, a device stream without end).
Result<void> check_input_file(const std::filesystem::path& path, std::string_view what);
// The whole content of a regular file of at most `max_bytes` bytes.
Result<std::vector<std::byte>> read_regular_file(const std::filesystem::path& path, std::size_t max_bytes,
                                                 std::string_view what);
// Whether two paths name the same file or folder: the same inode when both exist, otherwise the
// same normalised absolute path (links resolved as far as they exist).
bool same_path(const std::filesystem::path& a, const std::filesystem::path& b);
// Whether `inner` is `outer` or lies inside it (normalised absolute paths, links resolved as far
// as they exist).
bool path_within(const std::filesystem::path& inner, const std::filesystem::path& outer);

// Replaces `path` atomically through a ReplacingFile (replacing_file.hpp: a fresh temporary made
// with O_EXCL beside it, fsync, rename, fsync the folder). A failure leaves no temporary behind
// and the old file untouched. Only a regular file is ever replaced (a device, folder or fifo at
// `path` is refused by name), and nothing planted beside it is ever opened.
Result<void> write_file_atomic(const std::filesystem::path& path, std::string_view text);
// fsync of a file or (flags with O_DIRECTORY) a folder.
Result<void> fsync_path(const std::filesystem::path& path, int flags);
// CRC-32 (zlib's) of any number of bytes.
std::uint32_t crc32_of(std::span<const std::byte> bytes);

}  // namespace coshard::async
