#include "coshard/offload/swap_folder.hpp"

#include <system_error>
#include <utility>

namespace coshard::offload {

namespace fs = std::filesystem;

Result<SwapFolder> SwapFolder::claim(const fs::path& dir, const std::string& owner) {
  SwapFolder out;
  COSHARD_TRY_ASSIGN(out.lock_, async::FolderLock::claim(dir, "swap folder", owner, async::FolderLock::Sharing::none));
  return out;
}

SwapFolder& SwapFolder::operator=(SwapFolder&& other) noexcept {
  if (this != &other) {
    release();
    lock_ = std::move(other.lock_);
  }
  return *this;
}

SwapFolder::~SwapFolder() { release(); }

void SwapFolder::release() noexcept {
  if (!lock_.held()) return;
  const fs::path dir = lock_.path();
  std::error_code ec;
  // The swap files first, while the folder is still held; the lock file with the lock.
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    if (entry.path().filename() != kLockFile && entry.is_regular_file(ec)) fs::remove(entry.path(), ec);
  }
  lock_.reset();
  fs::remove(dir, ec);  // only if empty: anything the user put there stays
}

}  // namespace coshard::offload
