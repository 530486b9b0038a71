#include "coshard/async/replacing_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <utility>
#include <vector>

#include "coshard/async/files.hpp"

namespace coshard::async {

namespace fs = std::filesystem;

Result<ReplacingFile> ReplacingFile::create(const fs::path& target, std::string_view what) {
  COSHARD_TRY(check_replaceable(target, what));
  // mkostemp: a name no one chose before, opened with O_CREAT | O_EXCL (which never follows a
  // link and fails on anything that exists, a fifo included).
  std::string name = target.string() + ".tmp.XXXXXX";
  std::vector<char> buffer(name.begin(), name.end());
  buffer.push_back('\0');
  const int fd = ::mkostemp(buffer.data(), O_CLOEXEC);
  if (fd < 0)
    return fail(ErrorCode::io, what, " ", target.string(), ": cannot create a temporary beside it (",
                std::strerror(errno), ")");
  (void)::fchmod(fd, 0644);  // mkostemp makes 0600; the files we write are read by other tools
  ReplacingFile out;
  out.target_ = target;
  out.temporary_ = fs::path(buffer.data());
  out.what_ = std::string(what);
  out.fd_ = fd;
  return out;
}

ReplacingFile::ReplacingFile(ReplacingFile&& other) noexcept
    : target_(std::move(other.target_)),
      temporary_(std::move(other.temporary_)),
      what_(std::move(other.what_)),
      fd_(std::exchange(other.fd_, -1)) {}

ReplacingFile& ReplacingFile::operator=(ReplacingFile&& other) noexcept {
  if (this != &other) {
    discard();
    target_ = std::move(other.target_);
    temporary_ = std::move(other.temporary_);
    what_ = std::move(other.what_);
    fd_ = std::exchange(other.fd_, -1);
  }
  return *this;
}

ReplacingFile::~ReplacingFile() { discard(); }

void ReplacingFile::discard() noexcept {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  ::unlink(temporary_.c_str());
}

Result<void> ReplacingFile::write(std::span<const std::byte> bytes) {
  if (fd_ < 0) return fail(ErrorCode::invalid_argument, what_, " ", target_.string(), ": written after commit");
  const std::byte* p = bytes.data();
  std::size_t left = bytes.size();
  while (left > 0) {
    const ssize_t n = ::write(fd_, p, left);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0)
      return fail(ErrorCode::io, what_, " ", temporary_.string(), ": write of ", left, " bytes failed (",
                  std::strerror(errno), ")");
    p += n;
    left -= static_cast<std::size_t>(n);
  }
  return {};
}

Result<void> ReplacingFile::commit() {
  if (fd_ < 0) return fail(ErrorCode::invalid_argument, what_, " ", target_.string(), ": committed twice");
  if (::fsync(fd_) != 0) {
    const int err = errno;
    discard();
    return fail(ErrorCode::io, what_, " ", temporary_.string(), ": fsync failed (", std::strerror(err), ")");
  }
  // The last guard: what is at the target now must still be a regular file or nothing.
  if (auto ok = check_replaceable(target_, what_); !ok) {
    discard();
    return ok;
  }
  if (::rename(temporary_.c_str(), target_.c_str()) != 0) {
    const int err = errno;
    discard();
    return fail(ErrorCode::io, what_, ": renaming ", temporary_.string(), " to ", target_.string(), " failed (",
                std::strerror(err), ")");
  }
  ::close(fd_);
  fd_ = -1;
  return fsync_path(target_.parent_path().empty() ? fs::path(".") : target_.parent_path(), O_RDONLY | O_DIRECTORY);
}

}  // namespace coshard::async
