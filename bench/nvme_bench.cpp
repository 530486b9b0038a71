// NvmeStore throughput: 1 MiB blocks, queue depth 8/16/32, O_DIRECT, on a 256 MiB file.
//   BM_NvmeWrite/QD, BM_NvmeRead/QD   bytes per second (aligned pinned buffers: the direct path)
//   BM_UringWrite/QD, BM_UringRead/QD the same transfers straight through liburing (the
//                                     baseline the store, on Asio's io_uring backend, is held to)
//   BM_UringWriteFixed/QD, BM_UringReadFixed/QD   liburing with the buffer registered
//                                     (io_uring_register_buffers, *_fixed requests): whether
//                                     registration helps
// Run with --benchmark_enable_random_interleaving=true so that the disk's drift spreads over
// all of them alike.
// The file lives in $COSHARD_NVME_DIR (default: the working folder); scripts/nvme_vs_fio.sh
// runs fio --ioengine=io_uring --direct=1 on the same file with the same block size and queue
// depth and prints ours / fio.
#include <benchmark/benchmark.h>
#include <fcntl.h>
#include <liburing.h>
#include <sys/uio.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <string>
#include <vector>

#include "coshard/async/memory.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/offload/nvme_store.hpp"

namespace {

using namespace coshard;
constexpr std::size_t kFileBytes = std::size_t{256} << 20;

std::filesystem::path bench_dir() {
  const char* d = std::getenv("COSHARD_NVME_DIR");
  return d ? std::filesystem::path(d) : std::filesystem::current_path();
}

void run(benchmark::State& state, bool writing) {
  const auto depth = static_cast<std::size_t>(state.range(0));
  auto store = offload::NvmeStore::open({.directory = bench_dir(), .block_bytes = 1 << 20, .queue_depth = depth});
  if (!store) {
    state.SkipWithError(store.error().message().c_str());
    return;
  }
  auto buffer = async::PinnedBuffer::allocate(kFileBytes);
  if (!buffer) {
    state.SkipWithError(buffer.error().message().c_str());
    return;
  }
  std::memset(buffer->data(), 0x5A, buffer->size());
  async::Runtime rt;
  // The file must exist (and be full size) before reads.
  (void)rt.block_on((*store)->write("nvme_bench.bin", 0, buffer->bytes()));
  for (auto _ : state) {
    auto r = writing ? rt.block_on((*store)->write("nvme_bench.bin", 0, buffer->bytes()))
                     : rt.block_on((*store)->read("nvme_bench.bin", 0, buffer->bytes()));
    if (!r) state.SkipWithError(r.error().message().c_str());
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kFileBytes));
}

// One pass over the file through liburing: `depth` 1 MiB requests in flight, each into its own
// slice of `buffer`, short transfers resubmitted for the rest. Returns an error message or "".
std::string uring_pass(io_uring& ring, int fd, std::byte* buffer, std::size_t depth, bool writing, bool fixed) {
  constexpr std::size_t kBlock = 1 << 20;
  const std::size_t blocks = kFileBytes / kBlock;
  std::vector<std::size_t> done(blocks, 0);
  std::size_t next = 0, in_flight = 0, finished = 0;
  auto submit = [&](std::size_t b) {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring);
    const std::size_t at = b * kBlock + done[b];
    const auto len = static_cast<unsigned>(kBlock - done[b]);
    if (fixed) {
      if (writing) io_uring_prep_write_fixed(sqe, fd, buffer + at, len, at, 0);
      else io_uring_prep_read_fixed(sqe, fd, buffer + at, len, at, 0);
    } else {
      if (writing) io_uring_prep_write(sqe, fd, buffer + at, len, at);
      else io_uring_prep_read(sqe, fd, buffer + at, len, at);
    }
    io_uring_sqe_set_data64(sqe, b);
    ++in_flight;
  };
  while (finished < blocks) {
    while (in_flight < depth && next < blocks) submit(next++);
    if (int r = io_uring_submit_and_wait(&ring, 1); r < 0) return std::string("io_uring_submit: ") + std::strerror(-r);
    io_uring_cqe* cqe = nullptr;
    unsigned head = 0, seen = 0;
    io_uring_for_each_cqe(&ring, head, cqe) {
      ++seen;
      --in_flight;
      const std::size_t b = io_uring_cqe_get_data64(cqe);
      if (cqe->res < 0 && cqe->res != -EINTR && cqe->res != -EAGAIN) return std::string("io_uring: ") + std::strerror(-cqe->res);
      if (cqe->res == 0) return "io_uring: a transfer made no progress (file too short?)";
      if (cqe->res > 0) done[b] += static_cast<std::size_t>(cqe->res);
      if (done[b] < kBlock) submit(b);
      else ++finished;
    }
    io_uring_cq_advance(&ring, seen);
  }
  return "";
}

void run_uring(benchmark::State& state, bool writing, bool fixed) {
  const auto depth = static_cast<std::size_t>(state.range(0));
  const auto path = bench_dir() / "nvme_bench.bin";
  auto buffer = async::PinnedBuffer::allocate(kFileBytes);
  if (!buffer) {
    state.SkipWithError(buffer.error().message().c_str());
    return;
  }
  std::memset(buffer->data(), 0x5A, buffer->size());
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_DIRECT, 0644);
  if (fd < 0) {
    state.SkipWithError(("open " + path.string() + ": " + std::strerror(errno)).c_str());
    return;
  }
  io_uring ring{};
  if (int r = io_uring_queue_init(static_cast<unsigned>(2 * depth), &ring, 0); r < 0) {
    ::close(fd);
    state.SkipWithError((std::string("io_uring_queue_init: ") + std::strerror(-r)).c_str());
    return;
  }
  std::string error;
  if (fixed) {
    const iovec whole{buffer->data(), buffer->size()};
    if (int r = io_uring_register_buffers(&ring, &whole, 1); r < 0) error = std::string("io_uring_register_buffers: ") + std::strerror(-r);
  }
  if (error.empty()) error = uring_pass(ring, fd, buffer->data(), depth, true, fixed);  // the file at full size
  for (auto _ : state) {
    if (!error.empty()) break;
    error = uring_pass(ring, fd, buffer->data(), depth, writing, fixed);
  }
  io_uring_queue_exit(&ring);
  ::close(fd);
  if (!error.empty()) state.SkipWithError(error.c_str());
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations() * kFileBytes));
}

void BM_UringWrite(benchmark::State& state) { run_uring(state, true, false); }
void BM_UringRead(benchmark::State& state) { run_uring(state, false, false); }
void BM_UringWriteFixed(benchmark::State& state) { run_uring(state, true, true); }
void BM_UringReadFixed(benchmark::State& state) { run_uring(state, false, true); }
BENCHMARK(BM_UringWrite)->Arg(8)->Arg(16)->Arg(32)->UseRealTime()->MinTime(1.0);
BENCHMARK(BM_UringRead)->Arg(8)->Arg(16)->Arg(32)->UseRealTime()->MinTime(1.0);
BENCHMARK(BM_UringWriteFixed)->Arg(8)->Arg(16)->Arg(32)->UseRealTime()->MinTime(1.0);
BENCHMARK(BM_UringReadFixed)->Arg(8)->Arg(16)->Arg(32)->UseRealTime()->MinTime(1.0);

void BM_NvmeWrite(benchmark::State& state) { run(state, true); }
void BM_NvmeRead(benchmark::State& state) { run(state, false); }
BENCHMARK(BM_NvmeWrite)->Arg(8)->Arg(16)->Arg(32)->UseRealTime()->MinTime(1.0);
BENCHMARK(BM_NvmeRead)->Arg(8)->Arg(16)->Arg(32)->UseRealTime()->MinTime(1.0);

}  // namespace

BENCHMARK_MAIN();
