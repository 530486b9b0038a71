// SwapFolder: the folder of one rank's swap files, owned by one engine for its life.
//
// Two runs pointed at one NVMe folder would overwrite each other's swap files and both train on
// garbage without an error. So a rank's folder is claimed with an async::FolderLock (an flock the
// kernel releases when the process dies), not shared even within this process: a second claim,
// from another run or another engine of this process, is refused naming the holder. At a clean
// end the swap files go (they are scratch: checkpoints hold the state).
#pragma once

#include <filesystem>
#include <string>

#include "coshard/async/folder_lock.hpp"
#include "coshard/async/result.hpp"

namespace coshard::offload {

class SwapFolder {
 public:
  // Creates `dir` if needed and takes its lock; `owner` describes the claimant for a later
  // refusal ("coshard rank 0 of 2").
  static Result<SwapFolder> claim(const std::filesystem::path& dir, const std::string& owner);

  SwapFolder() = default;
  SwapFolder(SwapFolder&& other) noexcept = default;
  SwapFolder& operator=(SwapFolder&& other) noexcept;
  SwapFolder(const SwapFolder&) = delete;
  SwapFolder& operator=(const SwapFolder&) = delete;
  // Removes the folder's regular files (the swap files and the lock file), then the folder if it
  // is empty, then lets the lock go.
  ~SwapFolder();

  const std::filesystem::path& path() const noexcept { return lock_.path(); }
  static constexpr const char* kLockFile = async::FolderLock::kLockFile;

 private:
  void release() noexcept;
  async::FolderLock lock_;
};

}  // namespace coshard::offload
