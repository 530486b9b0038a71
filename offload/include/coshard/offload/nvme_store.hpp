// NvmeStore: files on a fast disk, read and written with O_DIRECT through io_uring.
//
//   auto store = NvmeStore::open({.directory = "/mnt/nvme/coshard"}).value();
//   co_await store->write("opt/shard-3", 0, bytes);      // Result<void>
//   co_await store->read("opt/shard-3", 0, out);         // Result<void>
//
// Rules:
// - Offsets are multiples of 4 KiB (O_DIRECT). Sizes and buffers may be anything: aligned
//   transfers go straight to the disk; an unaligned buffer or a size that is not a multiple of
//   4 KiB goes through an aligned bounce buffer (a write then pads the file to the next 4 KiB).
// - A transfer is cut into `block_bytes` pieces with `queue_depth` in flight (a sliding window),
//   each one a loop over Asio's async_*_some_at (the composed async_*_at would cut it to 64 KiB pieces);
//   short transfers continue where they stopped, EINTR/EAGAIN are retried. Asio's io_uring
//   service keeps one operation of a kind in flight per I/O object, so each worker of a transfer
//   uses its own object over a duplicate of the file's descriptor.
// - Failures come back as Result errors naming the file, offset and size: a missing directory
//   (at open), a file that is missing or shorter than asked (truncated behind our back), a full
//   disk or a file-size limit. Data written before the failure stays readable.
// - Calls run on the Runtime they are awaited on; a file is opened once and kept.
// - Time is kept per direction: a direction is busy while any of its transfers is in flight
//   (the disk's share of a step, against what it moved); with spans on, each transfer's start
//   and end (steady_clock) are kept until taken.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/result.hpp"
#include "coshard/async/task.hpp"

namespace coshard::offload {

struct NvmeStoreOptions {
  std::filesystem::path directory;
  std::size_t block_bytes = std::size_t{1} << 20;  // a multiple of 4 KiB
  std::size_t queue_depth = 16;                     // blocks in flight per transfer
  bool direct = true;                               // O_DIRECT (off: page cache, e.g. tmpfs)
};

// Totals since the store opened; read them twice and subtract for an interval.
struct NvmeStoreStats {
  std::uint64_t bytes_read = 0, bytes_written = 0;
  // Time with at least one read (write, transfer of either kind) in flight, the open interval
  // up to now included.
  std::chrono::nanoseconds read_busy{0}, write_busy{0}, busy{0};
};

// One read or write of a file, as its caller asked for it (its blocks together).
struct NvmeTransferSpan {
  bool writing = false;
  std::string file;
  std::uint64_t bytes = 0;
  std::chrono::steady_clock::time_point start, end;
};

class NvmeStore {
 public:
  static constexpr std::size_t kAlignment = 4096;

  static Result<std::unique_ptr<NvmeStore>> open(NvmeStoreOptions options);
  // Whether files in `directory` can be opened with O_DIRECT (tmpfs cannot): probed with a
  // temporary file, for choosing NvmeStoreOptions::direct.
  static bool supports_direct_io(const std::filesystem::path& directory);
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  async::Task<Result<void>> write(std::string name, std::uint64_t offset, std::span<const std::byte> data);
  async::Task<Result<void>> read(std::string name, std::uint64_t offset, std::span<std::byte> out);
  // Makes the file exactly `size` bytes (dropping the padding of an unaligned last write),
  // flushes it to the disk (ftruncate and fsync, on the blocking pool) and closes it: complete and
  // durable, ready to be renamed into place. A later read or write opens it again.
  async::Task<Result<void>> seal(std::string name, std::uint64_t size);

  const NvmeStoreOptions& options() const noexcept;
  std::uint64_t bytes_written() const noexcept;
  std::uint64_t bytes_read() const noexcept;
  // On the runtime's thread (where the transfers run).
  NvmeStoreStats stats() const noexcept;
  // Keeps each transfer's span from now on (off: drops them), until taken.
  void record_spans(bool on);
  std::vector<NvmeTransferSpan> take_spans() noexcept;

  struct Impl;
  explicit NvmeStore(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace coshard::offload
