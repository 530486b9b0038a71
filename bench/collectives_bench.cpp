// Local-backend collectives beside the memory-copy limit, in one binary.
//
//   BM_LocalAllGather/W/S      in-place all_gather, S bytes gathered per rank (W ranks)
//   BM_LocalReduceScatter/W/S  f32 sum reduce_scatter of S bytes per rank
//   BM_MemcpyStreams/W/S       W CPU streams each memcpy S bytes at once: the limit
//   BM_NcclAllReduce/S, BM_NcclAllGather/S
//                              NCCL at world size 1 on GPU 0 (latency at small S, bandwidth at
//                              large S; skipped without a GPU)
//
// Bytes per second are bus bandwidth as NCCL defines it (algbw * (W-1)/W, S being the gathered
// size, or the reduce_scatter input size); the memcpy baseline reports plain bytes copied per
// stream per second. bench/report.py prints busbw / memcpy for each (W, S).
#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

#include "coshard/async/memory.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/collectives/nccl.hpp"
#include "coshard/collectives/store.hpp"

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

// NCCL, world size 1: one rendezvous, one communicator, device buffers from the caching allocator.
void nccl_bench(benchmark::State& state, bool gather) {
  if (async::cuda_device_count() == 0 || !nccl_compiled()) {
    state.SkipWithError("no CUDA device or no NCCL");
    return;
  }
  const auto bytes = static_cast<std::size_t>(state.range(0));
  async::Runtime rt;
  auto setup = rt.block_on([]() -> async::Task<Result<std::pair<std::unique_ptr<TcpStore>, std::unique_ptr<Communicator>>>> {
    const StoreOptions options{.host = "127.0.0.1", .port = 0, .host_server = true};
    COSHARD_CO_TRY_ASSIGN(auto store, co_await TcpStore::connect(options));
    COSHARD_CO_TRY_ASSIGN(auto comm, co_await make_nccl_communicator(*store, 0, 1, async::Device::cuda(0)));
    co_return std::pair{std::move(store), std::move(comm)};
  }());
  if (!setup) {
    state.SkipWithError(setup.error().message().c_str());
    return;
  }
  Communicator& comm = *setup->second;
  auto alloc = std::move(*async::CachingAllocator::create(async::Device::cuda(0)));
  auto send = std::move(*alloc->allocate(bytes, comm.stream()));
  auto recv = std::move(*alloc->allocate(bytes, comm.stream()));
  for (auto _ : state) {
    auto e = gather ? comm.all_gather(send.data(), recv.data(), bytes, DataType::u8)
                    : comm.all_reduce(send.data(), recv.data(), bytes / 4, DataType::f32, ReduceOp::sum);
    if (!e || !e->synchronize()) state.SkipWithError("NCCL collective failed");
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
  send.reset();
  recv.reset();
  (void)rt.block_on([](auto& s) -> async::Task<void> { s.first.reset(); co_return; }(*setup));
}

void BM_NcclAllReduce(benchmark::State& state) { nccl_bench(state, false); }
void BM_NcclAllGather(benchmark::State& state) { nccl_bench(state, true); }
BENCHMARK(BM_NcclAllReduce)->RangeMultiplier(4)->Range(4 << 10, 256 << 20)->UseRealTime();
BENCHMARK(BM_NcclAllGather)->RangeMultiplier(4)->Range(4 << 10, 256 << 20)->UseRealTime();

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
