#include "files.hpp"

#include "coshard/async/files.hpp"

#include <fcntl.h>
#include <zlib.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <fstream>

namespace coshard::trainer::detail {

namespace fs = std::filesystem;

Result<std::vector<std::byte>> read_file(const fs::path& path, std::size_t max_bytes) {
  return async::read_regular_file(path, max_bytes, "file");
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
  COSHARD_TRY(async::check_replaceable(path, "output"));
  const fs::path tmp = path.string() + ".tmp";
  auto cleanup = [&](Error e) -> Result<void> {
    std::error_code ignored;
    fs::remove(tmp, ignored);
    return fail(std::move(e));
  };
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return fail(ErrorCode::io, tmp.string(), ": cannot create (", std::strerror(errno), ")");
    out.write(text.data(), static_cast<std::streamsize>(text.size()));
    out.close();
    if (!out)
      return cleanup(Error(ErrorCode::io, tmp.string() + ": write of " + std::to_string(text.size()) +
                                              " bytes failed (" + std::strerror(errno) + ")"));
  }
  if (auto synced = fsync_path(tmp, O_RDONLY); !synced) return cleanup(synced.error());
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) return cleanup(Error(ErrorCode::io, "renaming " + tmp.string() + " to " + path.string() + ": " + ec.message()));
  return fsync_path(path.parent_path().empty() ? fs::path(".") : path.parent_path(), O_RDONLY | O_DIRECTORY);
}

}  // namespace coshard::trainer::detail
