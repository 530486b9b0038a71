// Local-backend collectives beside the memory-copy limit, in one binary.
//
//   BM_LocalAllGather/W/S      in-place all_gather, S bytes gathered per rank (W ranks)
//   BM_LocalReduceScatter/W/S  f32 sum reduce_scatter of S bytes per rank
//   BM_MemcpyStreams/W/S       W CPU streams each memcpy S bytes at once: the limit
//
// Bytes per second are bus bandwidth as NCCL defines it (algbw * (W-1)/W, S being the gathered
// size, or the reduce_scatter input size); the memcpy baseline reports plain bytes copied per
// stream per second. bench/report.py prints busbw / memcpy for each (W, S).
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "coshard/async/stream.hpp"
#include "coshard/collectives/local.hpp"

namespace {

using namespace coshard;
using namespace coshard::collectives;

void wait_all(benchmark::State& state, std::vector<async::Event>& events) {
  for (auto& e : events) {
    if (!e.synchronize()) state.SkipWithError("collective failed");
  }
  events.clear();
}

void BM_LocalAllGather(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const auto bytes = static_cast<std::size_t>(state.range(1));
  const std::size_t block = bytes / static_cast<std::size_t>(world);
  auto comms = std::move(*make_local_communicators(world));
  std::vector<std::vector<std::byte>> bufs(static_cast<std::size_t>(world), std::vector<std::byte>(bytes, std::byte{1}));
  std::vector<async::Event> events;
  for (auto _ : state) {
    for (int r = 0; r < world; ++r) {
      std::byte* recv = bufs[static_cast<std::size_t>(r)].data();
      events.push_back(*comms[static_cast<std::size_t>(r)]->all_gather(recv + static_cast<std::size_t>(r) * block, recv,
                                                                        block, DataType::u8));
    }
    wait_all(state, events);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes) * (world - 1) / world);
}

void BM_LocalReduceScatter(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const auto bytes = static_cast<std::size_t>(state.range(1));
  const std::size_t count = bytes / sizeof(float) / static_cast<std::size_t>(world);
  auto comms = std::move(*make_local_communicators(world));
  std::vector<std::vector<float>> send(static_cast<std::size_t>(world), std::vector<float>(bytes / sizeof(float), 1.0f));
  std::vector<std::vector<float>> recv(static_cast<std::size_t>(world), std::vector<float>(count));
  std::vector<async::Event> events;
  for (auto _ : state) {
    for (int r = 0; r < world; ++r) {
      const auto i = static_cast<std::size_t>(r);
      events.push_back(*comms[i]->reduce_scatter(send[i].data(), recv[i].data(), count, DataType::f32, ReduceOp::sum));
    }
    wait_all(state, events);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes) * (world - 1) / world);
}

void BM_MemcpyStreams(benchmark::State& state) {
  const int world = static_cast<int>(state.range(0));
  const auto bytes = static_cast<std::size_t>(state.range(1));
  std::vector<async::Stream> streams;
  for (int r = 0; r < world; ++r) streams.push_back(std::move(*async::Stream::create(async::Device::cpu())));
  std::vector<std::vector<std::byte>> src(static_cast<std::size_t>(world), std::vector<std::byte>(bytes, std::byte{1}));
  std::vector<std::vector<std::byte>> dst(static_cast<std::size_t>(world), std::vector<std::byte>(bytes));
  std::vector<async::Event> events;
  for (auto _ : state) {
    for (int r = 0; r < world; ++r) {
      const auto i = static_cast<std::size_t>(r);
      (void)streams[i].copy(dst[i].data(), src[i].data(), bytes);
      events.push_back(*streams[i].record());
    }
    wait_all(state, events);
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
}

void sizes(benchmark::internal::Benchmark* b) {
  for (int world : {2, 4}) {
    for (std::int64_t s = 4 << 10; s <= (256 << 20); s *= 4) b->Args({world, s});
  }
  b->UseRealTime()->MinTime(0.2);
}

BENCHMARK(BM_LocalAllGather)->Apply(sizes);
BENCHMARK(BM_LocalReduceScatter)->Apply(sizes);
BENCHMARK(BM_MemcpyStreams)->Apply(sizes);

}  // namespace

BENCHMARK_MAIN();
