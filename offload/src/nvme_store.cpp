// NvmeStore (rules in nvme_store.hpp).
#include "coshard/offload/nvme_store.hpp"

#include "coshard/async/log.hpp"

#include <asio/error.hpp>
#include <asio/random_access_file.hpp>
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <map>
#include <new>
#include <optional>
#include <utility>
#include <vector>

#include "coshard/async/detail/asio_op.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/when_all.hpp"

namespace coshard::offload {
namespace {

using async::Task;
namespace fs = std::filesystem;

std::uint64_t round_up(std::uint64_t n, std::uint64_t to) { return (n + to - 1) / to * to; }

bool aligned(const void* p) { return reinterpret_cast<std::uintptr_t>(p) % NvmeStore::kAlignment == 0; }

}  // namespace

struct NvmeStore::Impl {
  NvmeStoreOptions options;
  async::Runtime* runtime = nullptr;  // the one whose io_context the files belong to
  std::map<std::string, std::unique_ptr<asio::random_access_file>> files;
  std::atomic<std::uint64_t> written{0};
  std::atomic<std::uint64_t> read{0};

  // Busy time, on the runtime's thread: a clock per direction and one for either, each running
  // while its count of transfers in flight is above zero.
  struct BusyClock {
    int in_flight = 0;
    std::chrono::steady_clock::time_point since;
    std::chrono::nanoseconds total{0};
    void start(std::chrono::steady_clock::time_point now) {
      if (in_flight++ == 0) since = now;
    }
    void stop(std::chrono::steady_clock::time_point now) {
      if (--in_flight == 0) total += now - since;
    }
    std::chrono::nanoseconds at(std::chrono::steady_clock::time_point now) const {
      return in_flight > 0 ? total + (now - since) : total;
    }
  };
  BusyClock read_clock, write_clock, either_clock;
  bool record_spans = false;
  std::vector<NvmeTransferSpan> spans;

  // Counts a transfer in flight while it lives.
  struct InFlight {
    Impl& store;
    bool writing;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    InFlight(Impl& s, bool w) : store(s), writing(w) {
      (writing ? store.write_clock : store.read_clock).start(start);
      store.either_clock.start(start);
    }
    ~InFlight() {
      const auto now = std::chrono::steady_clock::now();
      (writing ? store.write_clock : store.read_clock).stop(now);
      store.either_clock.stop(now);
    }
    InFlight(const InFlight&) = delete;
    InFlight& operator=(const InFlight&) = delete;
  };

  Result<asio::random_access_file*> file(const std::string& name, bool create) {
    async::Runtime* rt = async::Runtime::current();
    if (rt == nullptr) return fail(ErrorCode::invalid_argument, "NvmeStore: must be awaited on a coshard Runtime");
    if (runtime == nullptr) runtime = rt;
    if (runtime != rt) return fail(ErrorCode::invalid_argument, "NvmeStore: used from two runtimes; a store belongs to one");
    if (name.empty() || name.front() == '/' || name.find("..") != std::string::npos) {
      return fail(ErrorCode::invalid_argument, "NvmeStore: file name '", name, "' must be relative, without '..'");
    }
    if (auto it = files.find(name); it != files.end()) return it->second.get();
    const fs::path path = options.directory / name;
    if (create) {
      std::error_code ec;
      fs::create_directories(path.parent_path(), ec);
      if (ec) return fail(ErrorCode::io, "NvmeStore: cannot create folder '", path.parent_path().string(), "': ", ec.message());
    } else if (!fs::exists(path)) {
      return fail(ErrorCode::io, "NvmeStore: file '", path.string(), "' does not exist");
    }
    int flags = O_RDWR | (create ? O_CREAT : 0) | (options.direct ? O_DIRECT : 0);
    auto f = std::make_unique<asio::random_access_file>(rt->io_context());
    std::error_code ec;
    f->open(path.string(), static_cast<asio::file_base::flags>(flags), ec);
    if (ec) {
      return fail(ErrorCode::io, "NvmeStore: cannot open '", path.string(), "': ", ec.message(),
                  options.direct ? " (if the filesystem refuses O_DIRECT, e.g. tmpfs, set direct = false)" : "");
    }
    auto* raw = f.get();
    files.emplace(name, std::move(f));
    return raw;
  }

  // One block: a loop over *_some_at until `len` bytes moved (or, reading, until at least
  // `required` bytes arrived and the file ended).
  Task<Result<void>> block(bool writing, asio::random_access_file& f, const std::string& name, std::uint64_t offset,
                           std::byte* p, std::size_t len, std::size_t required) {
    std::size_t done = 0;
    while (done < len) {
      auto [ec, n] = co_await async::detail::TransferAwaiter([&](auto handler) {
        if (writing) {
          f.async_write_some_at(offset + done, asio::buffer(p + done, len - done), std::move(handler));
        } else {
          f.async_read_some_at(offset + done, asio::buffer(p + done, len - done), std::move(handler));
        }
      });
      if (ec == asio::error::interrupted || ec == asio::error::try_again) continue;
      if (!writing && (ec == asio::error::eof || (!ec && n == 0))) {
        if (done >= required) co_return Result<void>{};
        co_return fail(ErrorCode::io, "NvmeStore: read of ", len, " bytes at offset ", offset, " of '",
                       (options.directory / name).string(), "' found only ", done, " (file truncated?)");
      }
      if (ec) {
        co_return fail(ErrorCode::io, "NvmeStore: ", writing ? "write" : "read", " of ", len, " bytes at offset ", offset,
                       " of '", (options.directory / name).string(), "' failed after ", done, " bytes: ", ec.message());
      }
      if (writing && n == 0) {
        co_return fail(ErrorCode::io, "NvmeStore: write at offset ", offset + done, " of '", (options.directory / name).string(),
                       "' made no progress (disk full?)");
      }
      done += n;
    }
    co_return Result<void>{};
  }

  // Moves [p, p+len) at `offset`: queue_depth workers each take the next block until none is
  // left, so queue_depth blocks stay in flight (a sliding window; fixed windows each waited for
  // their slowest block). `required`: bytes a read must find (the rest of the last block may
  // lie past the end of the file).
  Task<Result<void>> transfer(bool writing, const std::string& name, std::uint64_t offset, std::byte* p, std::size_t len,
                              std::size_t required) {
    auto f = file(name, writing);
    if (!f) co_return fail(std::move(f).error());
    const std::size_t blocks = (len + options.block_bytes - 1) / options.block_bytes;
    COSHARD_LOG_DEBUG(offload, "{} {} bytes {} {} at offset {} ({} blocks of {}, queue depth {})",
                      writing ? "swap out:" : "swap in:", len, writing ? "to" : "from",
                      (options.directory / name).string(), offset, blocks, options.block_bytes, options.queue_depth);
    std::size_t next = 0;          // the reactor runs every worker: no atomics needed
    std::optional<Error> failure;  // the first error; the others stop taking blocks
    std::optional<InFlight> in_flight;
    in_flight.emplace(*this, writing);
    auto worker = [&](asio::random_access_file& lane) -> Task<void> {
      while (!failure && next < blocks) {
        const std::size_t b = next++;
        const std::size_t at = b * options.block_bytes;
        const std::size_t n = std::min(options.block_bytes, len - at);
        const std::size_t need = required > at ? std::min(n, required - at) : 0;
        auto r = co_await block(writing, lane, name, offset + at, p + at, n, need);
        if (!r && !failure) failure = std::move(r).error();
      }
    };
    // Asio's io_uring service keeps one operation of a kind in flight per I/O object and queues
    // the others behind it: on one object the queue depth was 1. Each worker gets an object of
    // its own, over a duplicate of the file's descriptor (closed when the transfer ends); where
    // no descriptor is left, fewer workers share the depth.
    const std::size_t depth = std::min(options.queue_depth, blocks);
    std::vector<std::unique_ptr<asio::random_access_file>> lanes;
    for (std::size_t w = 1; w < depth; ++w) {
      const int fd = ::fcntl((*f)->native_handle(), F_DUPFD_CLOEXEC, 0);
      if (fd < 0) break;
      auto lane = std::make_unique<asio::random_access_file>(runtime->io_context());
      std::error_code ec;
      lane->assign(fd, ec);
      if (ec) {
        ::close(fd);
        break;
      }
      lanes.push_back(std::move(lane));
    }
    std::vector<Task<void>> workers;
    workers.push_back(worker(**f));
    for (auto& lane : lanes) workers.push_back(worker(*lane));
    co_await async::when_all(std::move(workers));
    const auto started = in_flight->start;
    in_flight.reset();
    if (failure) co_return fail(std::move(*failure));
    (writing ? written : read).fetch_add(required, std::memory_order_relaxed);
    if (record_spans) {
      try {
        spans.push_back({writing, name, required, started, std::chrono::steady_clock::now()});
      } catch (const std::bad_alloc&) {
        // a span lost for memory: the totals still hold it
      }
    }
    co_return Result<void>{};
  }
};

Result<std::unique_ptr<NvmeStore>> NvmeStore::open(NvmeStoreOptions options) {
  if (options.block_bytes == 0 || options.block_bytes % kAlignment != 0) {
    return fail(ErrorCode::invalid_argument, "NvmeStoreOptions::block_bytes=", options.block_bytes, ": must be a positive multiple of ",
                kAlignment);
  }
  if (options.queue_depth == 0) return fail(ErrorCode::invalid_argument, "NvmeStoreOptions::queue_depth=0: must be at least 1");
  std::error_code ec;
  if (!fs::is_directory(options.directory, ec)) {
    return fail(ErrorCode::io, "NvmeStore: directory '", options.directory.string(), "' does not exist");
  }
  if (::access(options.directory.c_str(), W_OK) != 0) {
    return fail(ErrorCode::io, "NvmeStore: directory '", options.directory.string(), "' is not writable: ", std::strerror(errno));
  }
  auto impl = std::make_unique<Impl>();
  impl->options = std::move(options);
  return std::make_unique<NvmeStore>(std::move(impl));
}

bool NvmeStore::supports_direct_io(const std::filesystem::path& directory) {
  const fs::path probe = directory / (".coshard-direct-probe-" + std::to_string(::getpid()));
  const int fd = ::open(probe.c_str(), O_CREAT | O_WRONLY | O_DIRECT | O_CLOEXEC, 0644);
  if (fd < 0) return false;
  ::close(fd);
  ::unlink(probe.c_str());
  return true;
}

NvmeStore::NvmeStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
NvmeStore::~NvmeStore() = default;

const NvmeStoreOptions& NvmeStore::options() const noexcept { return impl_->options; }
std::uint64_t NvmeStore::bytes_written() const noexcept { return impl_->written.load(std::memory_order_relaxed); }
std::uint64_t NvmeStore::bytes_read() const noexcept { return impl_->read.load(std::memory_order_relaxed); }

NvmeStoreStats NvmeStore::stats() const noexcept {
  const auto now = std::chrono::steady_clock::now();
  return {bytes_read(), bytes_written(), impl_->read_clock.at(now), impl_->write_clock.at(now), impl_->either_clock.at(now)};
}

void NvmeStore::record_spans(bool on) {
  impl_->record_spans = on;
  if (!on) impl_->spans.clear();
}

std::vector<NvmeTransferSpan> NvmeStore::take_spans() noexcept { return std::exchange(impl_->spans, {}); }

Task<Result<void>> NvmeStore::write(std::string name, std::uint64_t offset, std::span<const std::byte> data) {
  if (offset % kAlignment != 0) {
    co_return fail(ErrorCode::invalid_argument, "NvmeStore::write('", name, "'): offset ", offset, " is not a multiple of ", kAlignment);
  }
  if (data.empty()) co_return Result<void>{};
  if (aligned(data.data()) && data.size() % kAlignment == 0) {
    co_return co_await impl_->transfer(true, name, offset, const_cast<std::byte*>(data.data()), data.size(), data.size());
  }
  // Bounce: copy into aligned memory, zero the padding up to the next 4 KiB.
  COSHARD_CO_TRY_ASSIGN(async::PinnedBuffer bounce, async::PinnedBuffer::allocate(round_up(data.size(), kAlignment)));
  std::memcpy(bounce.data(), data.data(), data.size());
  std::memset(bounce.data() + data.size(), 0, bounce.size() - data.size());
  co_return co_await impl_->transfer(true, name, offset, bounce.data(), bounce.size(), bounce.size());
}

Task<Result<void>> NvmeStore::read(std::string name, std::uint64_t offset, std::span<std::byte> out) {
  if (offset % kAlignment != 0) {
    co_return fail(ErrorCode::invalid_argument, "NvmeStore::read('", name, "'): offset ", offset, " is not a multiple of ", kAlignment);
  }
  if (out.empty()) co_return Result<void>{};
  if (aligned(out.data()) && out.size() % kAlignment == 0) {
    co_return co_await impl_->transfer(false, name, offset, out.data(), out.size(), out.size());
  }
  COSHARD_CO_TRY_ASSIGN(async::PinnedBuffer bounce, async::PinnedBuffer::allocate(round_up(out.size(), kAlignment)));
  COSHARD_CO_TRY(co_await impl_->transfer(false, name, offset, bounce.data(), bounce.size(), out.size()));
  std::memcpy(out.data(), bounce.data(), out.size());
  co_return Result<void>{};
}

Task<Result<void>> NvmeStore::seal(std::string name, std::uint64_t size) {
  COSHARD_CO_TRY_ASSIGN(asio::random_access_file * f, impl_->file(name, false));
  const int fd = f->native_handle();
  const std::string path = (impl_->options.directory / name).string();
  auto flush = [fd, size, path]() -> Result<void> {
    if (::ftruncate(fd, static_cast<off_t>(size)) != 0)
      return fail(ErrorCode::io, "NvmeStore: cannot set '", path, "' to ", size, " bytes: ", std::strerror(errno));
    if (::fsync(fd) != 0) return fail(ErrorCode::io, "NvmeStore: cannot fsync '", path, "': ", std::strerror(errno));
    return {};
  };
  auto flushed = co_await impl_->runtime->spawn_blocking(std::move(flush));
  impl_->files.erase(name);  // closes it
  co_return flushed;
}

}  // namespace coshard::offload
