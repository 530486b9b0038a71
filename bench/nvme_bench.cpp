// NvmeStore throughput: 1 MiB blocks, queue depth 8/16/32, O_DIRECT, on a 256 MiB file.
//   BM_NvmeWrite/QD, BM_NvmeRead/QD   bytes per second (aligned pinned buffers: the direct path)
// The file lives in $COSHARD_NVME_DIR (default: the working folder); scripts/nvme_vs_fio.sh
// runs fio --ioengine=io_uring --direct=1 on the same file with the same block size and queue
// depth and prints ours / fio.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>

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

void BM_NvmeWrite(benchmark::State& state) { run(state, true); }
void BM_NvmeRead(benchmark::State& state) { run(state, false); }
BENCHMARK(BM_NvmeWrite)->Arg(8)->Arg(16)->Arg(32)->UseRealTime()->MinTime(1.0);
BENCHMARK(BM_NvmeRead)->Arg(8)->Arg(16)->Arg(32)->UseRealTime()->MinTime(1.0);

}  // namespace

BENCHMARK_MAIN();
