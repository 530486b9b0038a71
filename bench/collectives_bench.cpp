// Local-backend collectives beside the memory-copy limit, in one binary.
//
//   BM_LocalAllGather/W/S      in-place all_gather, S bytes gathered per rank (W ranks)
//   BM_LocalReduceScatter/W/S  f32 sum reduce_scatter of S bytes per rank
//   BM_MemcpyStreams/W/S       W CPU streams each memcpy S bytes at once: the limit
//   BM_NcclAllReduce/S, BM_NcclAllGather/S
//                              NCCL at world size 1 on GPU 0 (latency at small S, bandwidth at
//                              large S; skipped without a GPU)
//
//   BM_LocalGpuAllGather/W/S   the Local backend with W ranks sharing GPU 0: in-place
//                              all_gather, S bytes gathered per rank
//   BM_LocalGpuReduceScatter/W/S   f32 sum reduce_scatter of S bytes per rank, on GPU 0
//   BM_GpuMemcpy/S             one device-to-device cudaMemcpyAsync of S bytes: the limit
//                              (GPU benchmarks skip without a GPU)
//
// On the GPU every rank's bytes go through one device's memory, so the GPU benchmarks report
// copy-equivalent bytes per second (what the collective must read plus write, halved, so a
// memcpy of S bytes counts S) and the memcpy baseline its bytes copied: their ratio is the
// fraction of the copy limit. The counter `busbw` keeps NCCL's bus bandwidth, summed over ranks.
//
// Bytes per second are bus bandwidth as NCCL defines it (algbw * (W-1)/W, S being the gathered
// size, or the reduce_scatter input size); the memcpy baseline reports plain bytes copied per
// stream per second. bench/report.py prints busbw / memcpy for each (W, S).
#include <benchmark/benchmark.h>

#include <barrier>
#include <cstring>
#include <functional>
#include <thread>
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

bool have_gpu(benchmark::State& state) {
  if (async::cuda_device_count() > 0) return true;
  state.SkipWithError("no CUDA device");
  return false;
}

// W rank threads that each launch `collective(rank)` once per iteration, as ranks of a job do
// (on a GPU a launch is a meeting of the ranks' threads); the caller waits for every event.
class RankThreads {
 public:
  RankThreads(int world, std::function<async::Event(int)> collective)
      : collective_(std::move(collective)), events_(static_cast<std::size_t>(world)),
        start_(world + 1), end_(world + 1) {
    for (int r = 0; r < world; ++r) {
      threads_.emplace_back([this, r] {
        for (;;) {
          start_.arrive_and_wait();
          if (stop_) return;
          events_[static_cast<std::size_t>(r)] = collective_(r);
          end_.arrive_and_wait();
        }
      });
    }
  }
  ~RankThreads() {
    stop_ = true;
    start_.arrive_and_wait();
    for (auto& t : threads_) t.join();
  }
  // One launch on every rank; true when every event completed without error.
  bool run_once() {
    start_.arrive_and_wait();
    end_.arrive_and_wait();
    bool ok = true;
    for (auto& e : events_) ok = e.recorded() && e.synchronize() && ok;
    return ok;
  }

 private:
  std::function<async::Event(int)> collective_;
  std::vector<async::Event> events_;
  std::barrier<> start_, end_;
  bool stop_ = false;
  std::vector<std::thread> threads_;
};

struct GpuRanks {
  std::vector<std::unique_ptr<Communicator>> comms;
  std::unique_ptr<async::CachingAllocator> alloc;
  std::vector<async::Block> send, recv;
};

// W ranks on GPU 0 with send and recv buffers of the given sizes (filled with 1.0f bits).
Result<GpuRanks> gpu_ranks(int world, std::size_t send_bytes, std::size_t recv_bytes) {
  GpuRanks g;
  COSHARD_TRY_ASSIGN(g.comms, make_local_communicators(world, {.device = async::Device::cuda(0)}));
  COSHARD_TRY_ASSIGN(g.alloc, async::CachingAllocator::create(async::Device::cuda(0)));
  for (auto& c : g.comms) {
    COSHARD_TRY_ASSIGN(async::Block s, g.alloc->allocate(std::max<std::size_t>(send_bytes, 1), c->stream()));
    COSHARD_TRY_ASSIGN(async::Block r, g.alloc->allocate(std::max<std::size_t>(recv_bytes, 1), c->stream()));
    COSHARD_TRY(c->stream().fill(s.data(), 0x3F, send_bytes));
    COSHARD_TRY(c->stream().fill(r.data(), 0x3F, recv_bytes));
    g.send.push_back(std::move(s));
    g.recv.push_back(std::move(r));
  }
  return g;
}

void BM_LocalGpuAllGather(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int world = static_cast<int>(state.range(0));
  const auto bytes = static_cast<std::size_t>(state.range(1));
  const std::size_t block = bytes / static_cast<std::size_t>(world);
  auto g = gpu_ranks(world, 0, bytes);
  if (!g) {
    state.SkipWithError(g.error().message().c_str());
    return;
  }
  RankThreads ranks(world, [&](int r) {
    auto* recv = static_cast<std::byte*>(g->recv[static_cast<std::size_t>(r)].data());
    auto e = g->comms[static_cast<std::size_t>(r)]->all_gather(recv + static_cast<std::size_t>(r) * block, recv, block,
                                                                DataType::u8);
    return e ? *e : async::Event{};
  });
  for (auto _ : state) {
    if (!ranks.run_once()) state.SkipWithError("collective failed");
  }
  const double moved = static_cast<double>(world - 1) * static_cast<double>(bytes);  // written (and read) once
  state.SetBytesProcessed(static_cast<std::int64_t>(static_cast<double>(state.iterations()) * moved));
  state.counters["busbw"] = benchmark::Counter(moved * static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

void BM_LocalGpuReduceScatter(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const int world = static_cast<int>(state.range(0));
  const auto bytes = static_cast<std::size_t>(state.range(1));
  const std::size_t count = bytes / sizeof(float) / static_cast<std::size_t>(world);
  auto g = gpu_ranks(world, bytes, count * sizeof(float));
  if (!g) {
    state.SkipWithError(g.error().message().c_str());
    return;
  }
  RankThreads ranks(world, [&](int r) {
    const auto i = static_cast<std::size_t>(r);
    auto e = g->comms[i]->reduce_scatter(g->send[i].data(), g->recv[i].data(), count, DataType::f32, ReduceOp::sum);
    return e ? *e : async::Event{};
  });
  for (auto _ : state) {
    if (!ranks.run_once()) state.SkipWithError("collective failed");
  }
  const double n = static_cast<double>(state.iterations());
  // Reads every rank's input (W*S), writes S: copy-equivalent (W+1)*S/2.
  state.SetBytesProcessed(static_cast<std::int64_t>(n * static_cast<double>(world + 1) * static_cast<double>(bytes) / 2));
  state.counters["busbw"] = benchmark::Counter(n * static_cast<double>(world - 1) * static_cast<double>(bytes),
                                               benchmark::Counter::kIsRate);
}

void BM_GpuMemcpy(benchmark::State& state) {
  if (!have_gpu(state)) return;
  const auto bytes = static_cast<std::size_t>(state.range(0));
  auto stream = async::Stream::create(async::Device::cuda(0));
  auto alloc = async::CachingAllocator::create(async::Device::cuda(0));
  if (!stream || !alloc) {
    state.SkipWithError("no stream or allocator on cuda:0");
    return;
  }
  auto src = (*alloc)->allocate(bytes, *stream);
  auto dst = (*alloc)->allocate(bytes, *stream);
  if (!src || !dst || !stream->fill(src->data(), 0x3F, bytes)) {
    state.SkipWithError("cannot allocate on cuda:0");
    return;
  }
  for (auto _ : state) {
    auto e = stream->copy(dst->data(), src->data(), bytes) ? stream->record() : Result<async::Event>(fail(ErrorCode::device, "copy"));
    if (!e || !e->synchronize()) state.SkipWithError("copy failed");
  }
  state.SetBytesProcessed(static_cast<std::int64_t>(state.iterations()) * static_cast<std::int64_t>(bytes));
}

void gpu_sizes(benchmark::internal::Benchmark* b) {
  for (int world : {2, 4, 8}) {
    for (std::int64_t s = 4 << 10; s <= (256 << 20); s *= 4) b->Args({world, s});
  }
  b->UseRealTime()->MinTime(0.1);
}

BENCHMARK(BM_LocalGpuAllGather)->Apply(gpu_sizes);
BENCHMARK(BM_LocalGpuReduceScatter)->Apply(gpu_sizes);
BENCHMARK(BM_GpuMemcpy)->RangeMultiplier(4)->Range(4 << 10, 256 << 20)->UseRealTime()->MinTime(0.1);

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
