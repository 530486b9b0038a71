// ReplacingFile: the one way coshard writes a file that replaces another (exports, manifests,
// `latest`, flight records, safetensors).
//
// The new content goes to a temporary beside the target under a fresh random name, created with
// O_EXCL: nothing already there is ever opened, so a link, fifo or file planted under the
// temporary's name (even a predictable one) is neither written through nor waited on. commit()
// fsyncs the temporary, renames it over the target (only a regular file or a new path: anything
// else is refused by name before the temporary is made) and fsyncs the folder. Dropped without a
// commit, the temporary is removed and the target is untouched.
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>
#include <string>
#include <string_view>

#include "coshard/async/result.hpp"

namespace coshard::async {

class ReplacingFile {
 public:
  // `what` names the role in messages ("--export", "checkpoint manifest").
  static Result<ReplacingFile> create(const std::filesystem::path& target, std::string_view what);

  ReplacingFile(ReplacingFile&& other) noexcept;
  ReplacingFile& operator=(ReplacingFile&& other) noexcept;
  ReplacingFile(const ReplacingFile&) = delete;
  ReplacingFile& operator=(const ReplacingFile&) = delete;
  ~ReplacingFile();

  Result<void> write(std::span<const std::byte> bytes);
  Result<void> write(std::string_view text) { return write(std::as_bytes(std::span(text.data(), text.size()))); }
  // Durable: the temporary synced, renamed over the target, the folder synced.
  Result<void> commit();

  const std::filesystem::path& temporary() const noexcept { return temporary_; }

 private:
  ReplacingFile() = default;
  void discard() noexcept;
  std::filesystem::path target_, temporary_;
  std::string what_;
  int fd_ = -1;
};

}  // namespace coshard::async
