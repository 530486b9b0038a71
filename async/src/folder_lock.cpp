#include "coshard/async/folder_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <ctime>
#include <map>
#include <mutex>
#include <system_error>
#include <utility>

namespace coshard::async {

namespace fs = std::filesystem;

struct FolderLock::Held {
  fs::path lock;
  int fd = -1;
  ~Held() {
    std::error_code ec;
    fs::remove(lock, ec);  // while still held (see the header)
    ::close(fd);
  }
};

namespace {

// This process's claims, by the lock file's identity (so two spellings of one folder are one).
struct Registry {
  std::mutex mutex;
  std::map<std::pair<dev_t, ino_t>, std::weak_ptr<FolderLock::Held>> held;
};
Registry& registry() {
  static Registry r;
  return r;
}

std::string holder_of(int fd) {
  char buf[512] = {};
  const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
  std::string text = n > 0 ? std::string(buf, static_cast<std::size_t>(n)) : std::string();
  while (!text.empty() && (text.back() == '\n' || text.back() == '\0')) text.pop_back();
  for (char& c : text)
    if (c < 0x20 || c >= 0x7f) c = '?';
  return text.empty() ? "another process (no description in the lock file)" : text;
}

std::string describe(const std::string& owner) {
  char host[256] = {};
  (void)::gethostname(host, sizeof host - 1);
  const std::time_t now = std::chrono::system_clock::to_time_t(std::chrono::system_clock::now());
  char when[64] = {};
  std::tm utc{};
  if (::gmtime_r(&now, &utc) != nullptr) std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", &utc);
  return owner + " (pid " + std::to_string(::getpid()) + " on " + host + ", since " + when + ")\n";
}

}  // namespace

Result<FolderLock> FolderLock::claim(const fs::path& dir, std::string_view what, const std::string& owner,
                                     Sharing sharing) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fail(ErrorCode::io, what, " ", dir.string(), ": cannot create (", ec.message(), ")");
  const fs::path lock = dir / kLockFile;
  auto& reg = registry();
  // The lock file may be removed by its holder at the end: a lock taken on a file no longer at
  // the path is worthless, so retry until the locked file is the one there.
  for (int attempt = 0; attempt < 100; ++attempt) {
    // O_NOFOLLOW: a link planted under the lock file's name is refused, not locked through.
    const int fd = ::open(lock.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK, 0644);
    if (fd < 0)
      return fail(ErrorCode::io, what, " ", dir.string(), ": cannot open its lock file ", lock.string(), " (",
                  std::strerror(errno), ")");
    struct stat opened{};
    if (::fstat(fd, &opened) != 0 || !S_ISREG(opened.st_mode)) {
      ::close(fd);
      return fail(ErrorCode::invalid_argument, what, " ", dir.string(), ": its lock file ", lock.string(),
                  " is not a regular file");
    }
    // A hard link planted under the lock file's name: writing the owner into it would rewrite
    // another file (the claim truncates it).
    if (opened.st_nlink > 1) {
      ::close(fd);
      return fail(ErrorCode::invalid_argument, what, " ", dir.string(), ": its lock file ", lock.string(), " has ",
                  opened.st_nlink, " names (a hard link to another file): it is left as it is; remove it");
    }
    const std::pair<dev_t, ino_t> key{opened.st_dev, opened.st_ino};
    std::unique_lock guard(reg.mutex);
    if (auto it = reg.held.find(key); it != reg.held.end()) {
      if (auto shared = it->second.lock()) {
        const std::string holder = holder_of(shared->fd);
        ::close(fd);
        if (sharing == Sharing::none)
          return fail(ErrorCode::invalid_argument, what, " ", dir.string(), " is in use by ", holder,
                      " in this process; two users of one folder overwrite each other's files: give each its own");
        FolderLock out;
        out.dir_ = dir;
        out.held_ = std::move(shared);
        return out;
      }
      reg.held.erase(it);
    }
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      const std::string holder = err == EWOULDBLOCK ? holder_of(fd) : std::string();
      ::close(fd);
      if (err == EWOULDBLOCK)
        return fail(ErrorCode::invalid_argument, what, " ", dir.string(), " is in use by ", holder,
                    "; two runs writing one folder destroy each other's files: wait for it to end, or give this "
                    "run a folder of its own");
      return fail(ErrorCode::io, what, " ", dir.string(), ": cannot lock ", lock.string(), " (", std::strerror(err), ")");
    }
    struct stat there{};
    if (::lstat(lock.c_str(), &there) == 0 && there.st_ino == opened.st_ino && there.st_dev == opened.st_dev) {
      const std::string me = describe(owner);
      if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
        // The lock holds without the description; a refusal then says less, nothing more.
      }
      auto held = std::make_shared<Held>();
      held->lock = lock;
      held->fd = fd;
      reg.held[key] = held;
      FolderLock out;
      out.dir_ = dir;
      out.held_ = std::move(held);
      return out;
    }
    ::close(fd);  // removed or replaced between open and lock: try again
  }
  return fail(ErrorCode::io, what, " ", dir.string(), ": the lock file keeps changing under us");
}

}  // namespace coshard::async
