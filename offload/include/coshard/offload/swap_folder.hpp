// SwapFolder: the folder of one rank's swap files, owned by one engine for its life.
//
// Two runs pointed at one NVMe folder would overwrite each other's swap files and both train on
// garbage without an error. So a rank's folder is claimed with an exclusive lock (flock on a
// lock file, released by the kernel when the process dies, so a crash never leaves it held);
// a second claim, from another run or another engine of this process, is refused naming the
// holder. At a clean end the swap files go (they are scratch: checkpoints hold the state).
#pragma once

#include <filesystem>
#include <string>

#include "coshard/async/result.hpp"

namespace coshard::offload {

class SwapFolder {
 public:
  // Creates `dir` if needed and takes its lock; `owner` describes the claimant for a later
  // refusal ("coshard rank 0 of 2").
  static Result<SwapFolder> claim(const std::filesystem::path& dir, const std::string& owner);

  SwapFolder() = default;
  SwapFolder(SwapFolder&& other) noexcept;
  SwapFolder& operator=(SwapFolder&& other) noexcept;
  SwapFolder(const SwapFolder&) = delete;
  SwapFolder& operator=(const SwapFolder&) = delete;
  // Removes the folder's regular files (the swap files and the lock file), then the folder if it
  // is empty, then lets the lock go.
  ~SwapFolder();

  const std::filesystem::path& path() const noexcept { return dir_; }
  static constexpr const char* kLockFile = ".coshard-lock";

 private:
  void release() noexcept;
  std::filesystem::path dir_;
  int fd_ = -1;
};

}  // namespace coshard::offload
