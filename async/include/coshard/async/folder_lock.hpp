// FolderLock: one run's claim of a folder it writes (a checkpoint folder, a rank's swap folder).
//
// Two runs writing one folder destroy each other's files without an error (the second run's
// --start-over removes the first's checkpoints; two swap folders overwrite each other's state).
// A claim is an exclusive flock on a lock file in the folder, which the kernel releases when the
// process dies, so a crash never leaves a folder locked; the lock file holds a line naming the
// holder (what, pid, host, since when), which a refused claim quotes.
//
// flock locks belong to an open file, so two claims from one process would refuse each other:
// claims are counted per process instead. With Sharing::process they share one lock (a run's
// ranks as threads, the trainer binary and its engine); with Sharing::none a second claim from
// this process is refused like another process's. The last handle of a claim lets it go: the
// lock file is removed while still held (a claimant that opened it meanwhile sees it gone once
// it gets the lock, and retries on a fresh one), then closed.
#pragma once

#include <filesystem>
#include <memory>
#include <string>
#include <string_view>

#include "coshard/async/result.hpp"

namespace coshard::async {

class FolderLock {
 public:
  enum class Sharing { none, process };
  static constexpr const char* kLockFile = ".coshard-lock";

  // Creates `dir` if needed and takes its lock. `what` names the folder's role in messages
  // ("--checkpoint-dir", "swap folder"); `owner` describes this claimant to a later refusal
  // ("coshard-train rank 0 of 2").
  static Result<FolderLock> claim(const std::filesystem::path& dir, std::string_view what, const std::string& owner,
                                  Sharing sharing);

  FolderLock() = default;
  bool held() const noexcept { return static_cast<bool>(held_); }
  const std::filesystem::path& path() const noexcept { return dir_; }
  // Lets go of this handle's share now (the lock goes with the last one).
  void reset() noexcept { held_.reset(); }

  struct Held;  // (folder_lock.cpp)

 private:
  std::filesystem::path dir_;
  std::shared_ptr<Held> held_;
};

}  // namespace coshard::async
