// The runtime's hot paths beside their baselines, in one binary:
//
//   spawn + join            vs asio::post + run_one (same thread), std::async + future
//   co_await a ready event  vs std::shared_future::get on a ready future
//   CPU stream launch + record + co_await (a full cross-thread round trip)
//                           vs asio::thread_pool post + std::future, std::async + future
//   semaphore acquire/release (uncontended) vs std::counting_semaphore
//   the same with a debug log line in it (the fetch path's shape): at warn (off: the line's
//   arguments, a norm over 1M floats among them, are never computed) and at debug into a sink
//   that drops the line (what a line costs when it is on)
//
// coshard's loops run inside the runtime (the benchmark's iteration loop executes on the
// reactor thread, which is where coroutines live); real time is reported for all.
#include <benchmark/benchmark.h>

#include <asio/io_context.hpp>
#include <asio/post.hpp>
#include <asio/thread_pool.hpp>

#include <cmath>
#include <future>
#include <string_view>
#include <vector>
#include <semaphore>

#include "coshard/async/async.hpp"
#include "coshard/async/log.hpp"

namespace {

using namespace coshard::async;

Task<int> noop_task() { co_return 1; }

void run_in_runtime(benchmark::State& state, Task<void> (*body)(benchmark::State&, Runtime&)) {
  Runtime rt;
  auto r = rt.block_on(body(state, rt));
  if (!r) state.SkipWithError(r.error().message().c_str());
}

// ---- spawn + join ------------------------------------------------------------------------------

void BM_SpawnJoin(benchmark::State& state) {
  run_in_runtime(state, [](benchmark::State& state, Runtime& rt) -> Task<void> {
    for (auto _ : state) {
      auto r = co_await rt.spawn(noop_task());
      benchmark::DoNotOptimize(r);
    }
  });
}
BENCHMARK(BM_SpawnJoin)->UseRealTime();

void BM_Baseline_AsioPostRunOne(benchmark::State& state) {
  asio::io_context io{1};
  int x = 0;
  for (auto _ : state) {
    asio::post(io, [&x] { ++x; });
    io.run_one();
  }
  benchmark::DoNotOptimize(x);
}
BENCHMARK(BM_Baseline_AsioPostRunOne)->UseRealTime();

void BM_Baseline_StdAsyncFuture(benchmark::State& state) {
  for (auto _ : state) {
    auto f = std::async(std::launch::async, [] { return 1; });
    benchmark::DoNotOptimize(f.get());
  }
}
BENCHMARK(BM_Baseline_StdAsyncFuture)->UseRealTime();

// ---- co_await a ready event --------------------------------------------------------------------

void BM_AwaitReadyEvent(benchmark::State& state) {
  run_in_runtime(state, [](benchmark::State& state, Runtime&) -> Task<void> {
    auto s = Stream::create(Device::cpu());
    Event e = *s->record();
    (void)co_await e;  // now passed
    for (auto _ : state) {
      auto r = co_await e;
      benchmark::DoNotOptimize(r);
    }
  });
}
BENCHMARK(BM_AwaitReadyEvent)->UseRealTime();

void BM_Baseline_ReadySharedFutureGet(benchmark::State& state) {
  std::promise<int> p;
  std::shared_future<int> f = p.get_future().share();
  p.set_value(1);
  for (auto _ : state) benchmark::DoNotOptimize(f.get());
}
BENCHMARK(BM_Baseline_ReadySharedFutureGet)->UseRealTime();

// ---- CPU stream round trip ------------------------------------------------------------------------

void BM_CpuStreamLaunchEventRoundTrip(benchmark::State& state) {
  run_in_runtime(state, [](benchmark::State& state, Runtime&) -> Task<void> {
    auto s = Stream::create(Device::cpu());
    int x = 0;
    for (auto _ : state) {
      (void)s->launch([&x] { ++x; });
      auto e = s->record();
      auto r = co_await *e;
      benchmark::DoNotOptimize(r);
    }
    benchmark::DoNotOptimize(x);
  });
}
BENCHMARK(BM_CpuStreamLaunchEventRoundTrip)->UseRealTime();

void BM_Baseline_ThreadPoolPostFuture(benchmark::State& state) {
  asio::thread_pool pool(1);
  for (auto _ : state) {
    std::promise<int> p;
    auto f = p.get_future();
    asio::post(pool, [&p] { p.set_value(1); });
    benchmark::DoNotOptimize(f.get());
  }
}
BENCHMARK(BM_Baseline_ThreadPoolPostFuture)->UseRealTime();

// ---- semaphore ------------------------------------------------------------------------------------

void BM_SemaphoreAcquireRelease(benchmark::State& state) {
  run_in_runtime(state, [](benchmark::State& state, Runtime&) -> Task<void> {
    Semaphore sem(1 << 20);
    for (auto _ : state) {
      auto p = co_await sem.acquire(64);
      benchmark::DoNotOptimize(p);
    }
  });
}
BENCHMARK(BM_SemaphoreAcquireRelease)->UseRealTime();

void BM_Baseline_StdCountingSemaphore(benchmark::State& state) {
  std::counting_semaphore<> sem(1 << 20);
  for (auto _ : state) {
    sem.acquire();
    sem.release();
  }
}
BENCHMARK(BM_Baseline_StdCountingSemaphore)->UseRealTime();

// ---- a debug line in the fetch path ----------------------------------------------------------------

double costly_norm(const std::vector<float>& v) {
  double sum = 0;
  for (float x : v) sum += static_cast<double>(x) * x;
  return std::sqrt(sum);
}

const std::vector<float> g_tensor(1 << 20, 0.5f);
bool g_costly = false;  // the line names the norm (only where the line is off: it would dominate)

void semaphore_with_debug_line(benchmark::State& state, const char* level) {
  if (!coshard::log::configure(level)) state.SkipWithError("log::configure");
  coshard::log::set_sink([](coshard::log::Level, std::string_view line) { benchmark::DoNotOptimize(line.data()); });
  g_costly = std::string_view(level) == "warn";
  run_in_runtime(state, [](benchmark::State& state, Runtime&) -> Task<void> {
    Semaphore sem(1 << 20);
    for (auto _ : state) {
      auto p = co_await sem.acquire(64);
      if (g_costly)
        COSHARD_LOG_DEBUG(zero, "fetch unit {}: {} bytes, live {}, norm {}", 3, 64, sem.available(), costly_norm(g_tensor));
      else
        COSHARD_LOG_DEBUG(zero, "fetch unit {}: {} bytes, live {}", 3, 64, sem.available());
      benchmark::DoNotOptimize(p);
    }
  });
  coshard::log::set_sink({});
  (void)coshard::log::configure("");
}

// Off: within noise of BM_SemaphoreAcquireRelease (one relaxed load and a branch).
void BM_SemaphoreAcquireRelease_DebugLineOff(benchmark::State& state) { semaphore_with_debug_line(state, "warn"); }
BENCHMARK(BM_SemaphoreAcquireRelease_DebugLineOff)->UseRealTime();

// On (without the norm), into a sink that drops it: formatting, the timestamp, the sink's lock.
void BM_SemaphoreAcquireRelease_DebugLineOn(benchmark::State& state) { semaphore_with_debug_line(state, "zero=debug"); }
BENCHMARK(BM_SemaphoreAcquireRelease_DebugLineOn)->UseRealTime();

}  // namespace

BENCHMARK_MAIN();
