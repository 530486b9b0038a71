#include "coshard/async/files.hpp"

#include "coshard/async/replacing_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

namespace coshard::async {

namespace fs = std::filesystem;

namespace {

std::string kind_of(const struct stat& st) {
  if (S_ISDIR(st.st_mode)) return "a folder";
  if (S_ISCHR(st.st_mode)) return "a character device";
  if (S_ISBLK(st.st_mode)) return "a block device";
  if (S_ISFIFO(st.st_mode)) return "a fifo";
  if (S_ISSOCK(st.st_mode)) return "a socket";
  if (S_ISREG(st.st_mode)) return "a regular file";  // (where a folder is expected)
  return "not a regular file";
}

// Creates and removes a uniquely named file in `folder`: the only sure test that it takes one
// (permissions, read-only mounts, a full inode table; root passes access() regardless).
Result<void> probe_folder(const fs::path& folder, std::string_view what, const fs::path& named) {
  static std::atomic<unsigned> serial{0};
  const fs::path probe = folder / (".coshard-probe." + std::to_string(::getpid()) + "." + std::to_string(serial++));
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    return fail(ErrorCode::io, what, " ", named.string(), ": cannot create a file in ", folder.string(), " (",
                std::strerror(errno), ")");
  ::close(fd);
  ::unlink(probe.c_str());
  return {};
}

fs::path normal(const fs::path& p) {
  std::error_code ec;
  auto abs = fs::weakly_canonical(fs::absolute(p, ec), ec);
  return ec ? fs::absolute(p).lexically_normal() : abs.lexically_normal();
}

}  // namespace

Result<void> check_replaceable(const fs::path& path, std::string_view what) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0) {
    if (errno == ENOENT) return {};
    return fail(ErrorCode::io, what, " ", path.string(), ": cannot inspect (", std::strerror(errno), ")");
  }
  if (!S_ISREG(st.st_mode))
    return fail(ErrorCode::invalid_argument, what, " ", path.string(), ": is ", kind_of(st),
                "; expected a regular file or a new path (coshard never replaces anything else)");
  return {};
}

Result<void> check_output_file(const fs::path& path, std::string_view what) {
  if (path.empty()) return fail(ErrorCode::invalid_argument, what, ": an empty path");
  COSHARD_TRY(check_replaceable(path, what));
  const fs::path folder = path.has_parent_path() ? path.parent_path() : fs::path(".");
  struct stat st{};
  if (::stat(folder.c_str(), &st) != 0)
    return fail(ErrorCode::io, what, " ", path.string(), ": its folder ", folder.string(), " cannot be used (",
                std::strerror(errno), ")");
  if (!S_ISDIR(st.st_mode))
    return fail(ErrorCode::invalid_argument, what, " ", path.string(), ": ", folder.string(), " is ", kind_of(st),
                ", not a folder");
  return probe_folder(folder, what, path);
}

Result<void> check_output_folder(const fs::path& path, std::string_view what) {
  if (path.empty()) return fail(ErrorCode::invalid_argument, what, ": an empty path");
  struct stat st{};
  if (::stat(path.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode))
      return fail(ErrorCode::invalid_argument, what, " ", path.string(), ": is ", kind_of(st), "; expected a folder");
  } else {
    std::error_code ec;
    fs::create_directories(path, ec);
    if (ec) return fail(ErrorCode::io, what, " ", path.string(), ": cannot create the folder (", ec.message(), ")");
  }
  return probe_folder(path, what, path);
}

Result<void> check_input_file(const fs::path& path, std::string_view what) {
  struct stat st{};
  if (::stat(path.c_str(), &st) != 0)
    return fail(ErrorCode::io, what, " ", path.string(), ": cannot inspect (", std::strerror(errno), ")");
  if (!S_ISREG(st.st_mode))
    return fail(ErrorCode::invalid_argument, what, " ", path.string(), ": is ", kind_of(st), "; expected a regular file");
  return {};
}

Result<std::vector<std::byte>> read_regular_file(const fs::path& path, std::size_t max_bytes, std::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // a fifo must not block the open
  if (fd < 0) return fail(ErrorCode::io, what, " ", path.string(), ": cannot open (", std::strerror(errno), ")");
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st{};
  if (::fstat(fd, &st) != 0) return fail(ErrorCode::io, what, " ", path.string(), ": cannot inspect (", std::strerror(errno), ")");
  if (!S_ISREG(st.st_mode))
    return fail(ErrorCode::invalid_argument, what, " ", path.string(), ": is ", kind_of(st), "; expected a regular file");
  const auto size = static_cast<std::size_t>(st.st_size);
  if (size > max_bytes)
    return fail(ErrorCode::invalid_argument, what, " ", path.string(), ": ", size, " bytes; at most ", max_bytes,
                " expected");
  std::vector<std::byte> bytes(size);
  std::size_t done = 0;
  while (done < size) {
    const ssize_t n = ::read(fd, bytes.data() + done, size - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return fail(ErrorCode::io, what, " ", path.string(), ": read failed after ", done, " of ", size,
                           " bytes (", std::strerror(errno), ")");
    if (n == 0)
      return fail(ErrorCode::io, what, " ", path.string(), ": ended after ", done, " of ", size,
                  " bytes (truncated while read?)");
    done += static_cast<std::size_t>(n);
  }
  return bytes;
}

bool same_path(const fs::path& a, const fs::path& b) {
  std::error_code ec;
  if (fs::exists(a, ec) && fs::exists(b, ec)) {
    const bool same = fs::equivalent(a, b, ec);
    if (!ec) return same;
  }
  return normal(a) == normal(b);
}

bool path_within(const fs::path& inner, const fs::path& outer) {
  const fs::path i = normal(inner), o = normal(outer);
  auto oi = o.begin(), ii = i.begin();
  for (; oi != o.end() && ii != i.end(); ++oi, ++ii)
    if (*oi != *ii) break;
  // "a/b/" ends in an empty element: "a/b/c" still lies within it.
  return oi == o.end() || (std::next(oi) == o.end() && oi->empty());
}

std::uint32_t crc32_of(std::span<const std::byte> bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  const auto* p = reinterpret_cast<const Bytef*>(bytes.data());
  std::size_t left = bytes.size();
  while (left > 0) {  // zlib takes uInt lengths
    const auto n = static_cast<uInt>(std::min<std::size_t>(left, 1u << 30));
    crc = crc32(crc, p, n);
    p += n;
    left -= n;
  }
  return static_cast<std::uint32_t>(crc);
}

Result<void> fsync_path(const fs::path& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_CLOEXEC);
  if (fd < 0) return fail(ErrorCode::io, path.string(), ": open for fsync failed (", std::strerror(errno), ")");
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0) return fail(ErrorCode::io, path.string(), ": fsync failed (", std::strerror(err), ")");
  return {};
}

Result<void> write_file_atomic(const fs::path& path, std::string_view text) {
  COSHARD_TRY_ASSIGN(auto file, ReplacingFile::create(path, "output"));
  COSHARD_TRY(file.write(text));
  return file.commit();
}

}  // namespace coshard::async
