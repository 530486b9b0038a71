#include "coshard/offload/swap_folder.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <system_error>
#include <utility>

namespace coshard::offload {

namespace fs = std::filesystem;

namespace {

std::string holder_of(int fd) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string text = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  for (char& c : text)
    if (c < 0x20 || c >= 0x7f) c = '?';
  return text.empty() ? "another process (no description in the lock file)" : text;
}

}  // namespace

Result<SwapFolder> SwapFolder::claim(const fs::path& dir, const std::string& owner) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fail(ErrorCode::io, "swap folder ", dir.string(), ": cannot create (", ec.message(), ")");
  const fs::path lock = dir / kLockFile;
  // The lock file may be unlinked by its holder at the end (below): a lock taken on a file no
  // longer at the path is worthless, so retry until the locked file is the one there.
  for (int attempt = 0; attempt < 100; ++attempt) {
    const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return fail(ErrorCode::io, "swap folder ", dir.string(), ": cannot open ", lock.string(), " (", std::strerror(errno), ")");
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const std::string holder = err == EWOULDBLOCK ? holder_of(fd) : std::string();
      ::close(fd);
      if (err == EWOULDBLOCK)
        return fail(ErrorCode::invalid_argument, "swap folder ", dir.string(), " is in use by ", holder,
                    "; two runs sharing one folder overwrite each other's swap files: give each run its own");
      return fail(ErrorCode::io, "swap folder ", dir.string(), ": cannot lock ", lock.string(), " (", std::strerror(err), ")");
    }
    struct stat held{}, there{};
    if (::fstat(fd, &held) == 0 && ::stat(lock.c_str(), &there) == 0 && held.st_ino == there.st_ino &&
        held.st_dev == there.st_dev) {
      char host[256] = {};
      (void)::gethostname(host, sizeof host - 1);
      const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
      char when[64] = {};
      std::tm utc{};
      if (::gmtime_r(&now, &utc) != nullptr) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &utc);
      const std::string me = owner + " (pid " + std::to_string(::getpid()) + " on " + host + ", since " + when + ")\n";
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
        // The lock holds without the description; a refusal then says less, nothing more.
      }
      SwapFolder out;
      out.dir_ = dir;
      out.fd_ = fd;
      return out;
    }
    ::close(fd);  // removed or replaced between open and lock: try again
  }
  return fail(ErrorCode::io, "swap folder ", dir.string(), ": the lock file keeps changing under us");
}

SwapFolder::SwapFolder(SwapFolder&& other) noexcept : dir_(std::move(other.dir_)), fd_(std::exchange(other.fd_, -1)) {}

SwapFolder& SwapFolder::operator=(SwapFolder&& other) noexcept {
  if (this != &other) {
    release();
    dir_ = std::move(other.dir_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

SwapFolder::~SwapFolder() { release(); }

void SwapFolder::release() noexcept {
  if (fd_ < 0) return;
  std::error_code ec;
  // The lock file last, while still held: a new claimant that opened it before the unlink finds
  // it gone from the path once it gets the lock, and retries on a fresh one.
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    if (entry.path().filename() != kLockFile && entry.is_regular_file(ec)) fs::remove(entry.path(), ec);
  }
  fs::remove(dir_ / kLockFile, ec);
  fs::remove(dir_, ec);  // only if empty: anything the user put there stays
  ::close(fd_);
  fd_ = -1;
}

}  // namespace coshard::offload
