// The ZeRO engine's two promises, measured inside one run each:
//
//   BM_PrefetchOverlap      stage 3 at world size 2 (Local backend, CPU streams) with a fixed
//                           delay injected before every collective on the communication stream
//                           (a slow link). Three runs in one process: compute alone (no delay),
//                           the delay with on-demand fetches, the delay with prefetch. The delay
//                           is chosen so launches x delay matches the compute of a step; the
//                           communication time reported is measured (the stream's busy time per
//                           step: delays plus the collectives). Reports step / max(compute,
//                           communication): 1.0 is perfect overlap (target <= 1.15).
//   BM_HostOverheadPerUnit  1,000 tiny Linear modules, stage 3 at world size 1: the host time
//                           to enqueue a forward pass with the engine's fetch + release around
//                           every module, minus the same pass over unsharded parameters, per
//                           unit (target < 5 us; DeepSpeed spends hundreds of us per module).
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <time.h>

#include <barrier>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/cpu_threads.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "coshard/offload/swapper.hpp"
#include "bench_rank.hpp"

namespace {

using namespace coshard;
using namespace coshard::modules;
using namespace coshard::zero;
using Clock = std::chrono::steady_clock;

// A communicator whose stream sleeps `delay` before each launched group: a link with latency.
// It also measures how long its stream is busy with each group (the delay plus the collective
// itself), so a step's communication time is measured, not assumed to be launches x delay.
class DelayedCommunicator final : public collectives::Communicator {
 public:
  DelayedCommunicator(collectives::Communicator& inner, std::chrono::microseconds delay)
      : inner_(inner), delay_(delay), timing_(std::make_shared<Timing>()) {}
  int rank() const noexcept override { return inner_.rank(); }
  int size() const noexcept override { return inner_.size(); }
  std::string_view backend() const noexcept override { return inner_.backend(); }
  async::Stream& stream() noexcept override { return inner_.stream(); }
  Result<async::Event> launch(const collectives::Coalesced& group) override {
    const auto d = delay_;
    COSHARD_TRY(inner_.stream().launch([t = timing_, d] {
      t->started = Clock::now();  // the stream worker is the only thread touching `started`
      if (d.count() > 0) std::this_thread::sleep_for(d);
    }));
    auto done = inner_.launch(group);
    COSHARD_TRY(inner_.stream().launch([t = timing_] {
      t->busy_ns.fetch_add(std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now() - t->started).count());
    }));
    return done;
  }
  Result<std::unique_ptr<collectives::Communicator>> split(int color, int key) override {
    return inner_.split(color, key);
  }
  std::uint64_t launches() const noexcept override { return inner_.launches(); }
  Result<void> status() const override { return inner_.status(); }
  void abort(const std::string& reason) override { inner_.abort(reason); }

  // Stream-busy seconds since the last reset (read after the stream has drained).
  double busy_seconds() const { return static_cast<double>(timing_->busy_ns.load()) * 1e-9; }
  void reset_busy() { timing_->busy_ns.store(0); }

 private:
  struct Timing {
    Clock::time_point started;
    std::atomic<std::int64_t> busy_ns{0};
  };
  collectives::Communicator& inner_;
  std::chrono::microseconds delay_;
  std::shared_ptr<Timing> timing_;
};

// A CPU rank; a benchmark cannot go on without one.
struct RankSetup : bench::BenchRank {
  RankSetup() {
    if (auto opened = open(async::Device::cpu()); !opened) {
      std::fprintf(stderr, "engine_bench: cannot open a CPU rank: %s\n", opened.error().message().c_str());
      std::abort();
    }
  }
};

constexpr GptConfig kOverlapModel{.vocab = 512, .max_seq = 64, .dim = 128, .layers = 4, .heads = 4, .mlp_ratio = 4};

struct OverlapResult {
  double step_seconds = 0;
  double comm_seconds = 0;  // measured stream-busy time of rank 0's communication per step
  std::uint64_t launches_per_step = 0;
  double exposed_comm_seconds = 0;  // the engine's own figure (device timestamps), per step
  std::size_t peak_live_bytes = 0;
  std::string error;
};

// Mean step time of steps 3..N on rank 0 (steps 1-2 record the trace and warm the pools).
OverlapResult run_overlap(std::chrono::microseconds delay, std::size_t prefetch_bytes, int steps, bool adaptive = false) {
  constexpr int kWorld = 2;
  auto comms = collectives::make_local_communicators(kWorld);
  if (!comms) return {.error = comms.error().message()};
  OverlapResult out;
  std::barrier sync(kWorld);
  std::vector<std::string> errors(kWorld);
  auto rank_main = [&](int rank) {
    RankSetup r;
    DelayedCommunicator comm(*(*comms)[static_cast<std::size_t>(rank)], delay);
    auto body = [&]() -> async::Task<Result<void>> {
      COSHARD_CO_TRY_ASSIGN(auto model, make_gpt(kOverlapModel));
      COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw({}));
      EngineOptions o;
      o.zero_stage = 3;
      o.prefetch_bucket_bytes = prefetch_bytes;
      o.adaptive_prefetch = adaptive;
      o.timing = true;  // every run pays the same timing events; exposed communication is reported
      COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(*r.ctx, comm, *model, *opt, o));
      COSHARD_CO_TRY(co_await engine->initialize(1));
      std::vector<double> ids(4 * 64);
      for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<double>((i * 31 + 7) % 512);
      auto bytes = encode_values(ids, DataType::i32);
      COSHARD_CO_TRY_ASSIGN(Tensor tokens, r.ctx->upload(bytes, Shape{4, 64}, DataType::i32));
      std::vector<Batch> batch{Batch{tokens, tokens}};
      CrossEntropyLoss loss;
      Clock::time_point start;
      for (int step = 0; step < steps; ++step) {
        if (step == 2) {
          start = Clock::now();
          comm.reset_busy();
        }
        COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->step(loss, batch, 1e-4f));
        if (rank == 0) out.launches_per_step = stats.collective_launches;
        if (rank == 0 && step >= 2) {
          out.exposed_comm_seconds += stats.exposed_comm_ms.value_or(0) * 1e-3 / (steps - 2);
          out.peak_live_bytes = std::max(out.peak_live_bytes, stats.peak_live_bytes);
        }
        if (rank == 0 && std::getenv("ENGINE_BENCH_VERBOSE"))
          std::fprintf(stderr, "step %d: hit rate %.2f, gathers %lu, trace changed %d\n", step, stats.hit_rate(),
                       static_cast<unsigned long>(stats.gathers), stats.trace_changed ? 1 : 0);
      }
      if (rank == 0) {
        out.step_seconds = std::chrono::duration<double>(Clock::now() - start).count() / (steps - 2);
        out.comm_seconds = comm.busy_seconds() / (steps - 2);  // each step ends awaiting its loss
      }
      co_return Result<void>{};
    };
    auto result = r.rt.block_on(body());
    if (!result) errors[static_cast<std::size_t>(rank)] = result.error().message();
  };
  std::vector<std::thread> threads;
  for (int rank = 0; rank < kWorld; ++rank) threads.emplace_back(rank_main, rank);
  for (auto& t : threads) t.join();
  for (const auto& e : errors)
    if (!e.empty()) out.error = e;
  return out;
}

void BM_PrefetchOverlap(benchmark::State& state) {
  constexpr int kSteps = 8;
  // Two ranks share this machine's cores: one BLAS thread each, as one GPU per rank would be
  // (two threads per rank oversubscribe 2 cores and make the compute time itself noisy).
  const int blas_threads = openblas_get_num_threads();
  openblas_set_num_threads(1);
  for (auto _ : state) {
    const auto compute = run_overlap(std::chrono::microseconds(0), 0, kSteps);
    if (!compute.error.empty()) return state.SkipWithError(compute.error.c_str());
    // Delay per launch so that launches x delay = compute of a step.
    auto delay = std::chrono::microseconds(
        static_cast<std::int64_t>(compute.step_seconds * 1e6 / static_cast<double>(compute.launches_per_step)));
    if (const char* d = std::getenv("ENGINE_BENCH_DELAY_US")) delay = std::chrono::microseconds(std::atoi(d));
    const auto on_demand = run_overlap(delay, 0, kSteps);
    std::size_t bucket = std::size_t{8} << 20;
    if (const char* b = std::getenv("ENGINE_BENCH_BUCKET")) bucket = static_cast<std::size_t>(std::atoll(b));
    const auto prefetch = run_overlap(delay, bucket, kSteps);
    const auto adaptive = run_overlap(delay, 0, kSteps, true);
    if (!on_demand.error.empty() || !prefetch.error.empty() || !adaptive.error.empty())
      return state.SkipWithError((on_demand.error + prefetch.error + adaptive.error).c_str());
    // Communication per step as measured on the on-demand run (its stream does the same work).
    const double comm_seconds = on_demand.comm_seconds;
    const double limit = std::max(compute.step_seconds, comm_seconds);
    state.counters["compute_ms"] = compute.step_seconds * 1e3;
    state.counters["comm_ms"] = comm_seconds * 1e3;
    // launches x delay alone: a lower bound on communication, so the stricter ratio.
    const double nominal = static_cast<double>(delay.count()) * 1e-6 * static_cast<double>(compute.launches_per_step);
    state.counters["comm_nominal_ms"] = nominal * 1e3;
    state.counters["prefetch_ratio_nominal"] = prefetch.step_seconds / std::max(compute.step_seconds, nominal);
    state.counters["delay_us"] = static_cast<double>(delay.count());
    state.counters["launches"] = static_cast<double>(compute.launches_per_step);
    state.counters["on_demand_ms"] = on_demand.step_seconds * 1e3;
    state.counters["prefetch_ms"] = prefetch.step_seconds * 1e3;
    state.counters["on_demand_ratio"] = on_demand.step_seconds / limit;
    state.counters["prefetch_ratio"] = prefetch.step_seconds / limit;
    state.counters["adaptive_ms"] = adaptive.step_seconds * 1e3;
    state.counters["adaptive_ratio"] = adaptive.step_seconds / limit;
    state.counters["adaptive_peak_MiB"] = static_cast<double>(adaptive.peak_live_bytes) / (1 << 20);
    state.counters["prefetch_peak_MiB"] = static_cast<double>(prefetch.peak_live_bytes) / (1 << 20);
    state.counters["exposed_on_demand_ms"] = on_demand.exposed_comm_seconds * 1e3;
    state.counters["exposed_prefetch_ms"] = prefetch.exposed_comm_seconds * 1e3;
    state.counters["exposed_adaptive_ms"] = adaptive.exposed_comm_seconds * 1e3;
    state.SetIterationTime(prefetch.step_seconds);
  }
  openblas_set_num_threads(blas_threads);
}
BENCHMARK(BM_PrefetchOverlap)->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);

// Ranks as threads with OpenBLAS's default threads (one per core, for every rank's products)
// against coshard-train's default (the cores divided by the ranks), alternated in one run:
// blas_ratio = step time with the default threads / step time with cores / ranks.
void BM_BlasThreadsPerRank(benchmark::State& state) {
  constexpr int kSteps = 8;
  const int before = cpu_math_threads();
  const int all_cores = default_cpu_math_threads(1), shared = default_cpu_math_threads(2);  // run_overlap: 2 ranks
  for (auto _ : state) {
    double oversubscribed = 0, divided = 0;
    for (int round = 0; round < 3; ++round) {
      set_cpu_math_threads(all_cores);
      const auto a = run_overlap(std::chrono::microseconds(0), 0, kSteps);
      set_cpu_math_threads(shared);
      const auto b = run_overlap(std::chrono::microseconds(0), 0, kSteps);
      if (!a.error.empty() || !b.error.empty()) return state.SkipWithError((a.error + b.error).c_str());
      oversubscribed += a.step_seconds;
      divided += b.step_seconds;
    }
    state.counters["default_threads"] = all_cores;
    state.counters["per_rank_threads"] = shared;
    state.counters["default_ms"] = oversubscribed / 3 * 1e3;
    state.counters["per_rank_ms"] = divided / 3 * 1e3;
    state.counters["blas_ratio"] = oversubscribed / divided;
    state.SetIterationTime(divided / 3);
  }
  set_cpu_math_threads(before);
}
BENCHMARK(BM_BlasThreadsPerRank)->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);

// 1,000 Linear(8, 8) modules in a row.
std::unique_ptr<Sequential> tiny_modules(int n) {
  auto model = std::make_unique<Sequential>();
  for (int i = 0; i < n; ++i) model->add("m" + std::to_string(i), std::make_unique<Linear>(8, 8));
  return model;
}

// Steps of a 4.2M-parameter GPT at world size 1, stage 3, with the optimizer and the parameters
// where asked: the optimizer span (device timestamps) and the whole step (host clock), averaged
// over the steps after the first, and the device memory in use once the engine is initialised.
constexpr GptConfig kOffloadModel{.vocab = 2048, .max_seq = 32, .dim = 256, .layers = 4, .heads = 4, .mlp_ratio = 4};
struct OffloadRun {
  double optimizer_ms = 0, step_ms = 0;
  std::size_t device_bytes = 0;
};
Result<OffloadRun> offload_run(const std::filesystem::path& folder, OffloadTarget optimizer, OffloadTarget params,
                               int steps, bool step_in_backward = false) {
  RankSetup r;
  auto comms = collectives::make_local_communicators(1);
  if (!comms) return fail(std::move(comms).error());
  auto body = [&]() -> async::Task<Result<OffloadRun>> {
    COSHARD_CO_TRY_ASSIGN(auto model, make_gpt(kOffloadModel));
    COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw({}));
    EngineOptions o;
    o.zero_stage = 3;
    o.record_timeline = true;
    o.prefetch_bucket_bytes = 8 << 20;
    o.offload_optimizer = optimizer;
    o.offload_params = params;
    o.offload_optimizer.nvme_path = folder;
    o.step_in_backward = step_in_backward;
    if (const char* b = std::getenv("ENGINE_BENCH_SWAP_BUFFERS")) o.offload_optimizer.buffer_count = std::atoi(b);
    COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(*r.ctx, *(*comms)[0], *model, *opt, o));
    COSHARD_CO_TRY(co_await engine->initialize(1));
    OffloadRun run;
    run.device_bytes = r.allocator->stats().in_use_bytes;
    std::vector<double> ids(2 * 32);
    for (std::size_t i = 0; i < ids.size(); ++i) ids[i] = static_cast<double>((i * 31 + 7) % 2048);
    auto bytes = encode_values(ids, DataType::i32);
    COSHARD_CO_TRY_ASSIGN(Tensor tokens, r.ctx->upload(bytes, Shape{2, 32}, DataType::i32));
    std::vector<Batch> batch{Batch{tokens, tokens}};
    CrossEntropyLoss loss;
    for (int step = 0; step < steps; ++step) {
      const auto start = Clock::now();
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->step(loss, batch, 1e-4f));
      if (step == 0) continue;
      run.step_ms += std::chrono::duration<double, std::milli>(Clock::now() - start).count() / (steps - 1);
      for (const auto& span : stats.timeline)
        if (span.category == "optimizer") run.optimizer_ms += (span.end_ms - span.start_ms) / (steps - 1);
    }
    co_return run;
  };
  return r.rt.block_on(body());
}

// The optimizer step offloaded: its time (the timeline's optimizer span, device timestamps) on
// the device, with the state in pinned memory (cpu), and streamed from NVMe (nvme), against the
// NVMe I/O alone (the same sub-groups read and written by the swapper with nothing to do).
// Reports nvme / max(io, cpu) and nvme / (io + cpu): 1 would be perfect overlap of I/O and the
// CPU step; the sum is no overlap at all.
void BM_OptimizerOffload(benchmark::State& state) {
  constexpr GptConfig kModel = kOffloadModel;
  constexpr int kSteps = 4;
  const auto folder = std::filesystem::current_path() / "optimizer_offload_bench";
  auto optimizer_ms = [&](OptimizerOffload offload) -> Result<double> {
    COSHARD_TRY_ASSIGN(auto run, offload_run(folder, offload, OffloadTarget::none, kSteps));
    return run.optimizer_ms;
  };
  // The swapper alone over the same sub-groups (master and two moments of every unit's shard).
  auto io_ms = [&]() -> Result<double> {
    RankSetup r;
    auto model = make_gpt(kModel);
    if (!model) return fail(std::move(model).error());
    std::vector<offload::SubGroup> groups;
    std::size_t largest = 0;
    (*model)->for_each_module([&](const std::string& path, Module& m) {
      std::int64_t n = 0;
      for (const auto& p : m.parameters()) n += p->numel();
      if (n == 0) return;
      groups.push_back({"io/" + (path.empty() ? std::string("root") : path), static_cast<std::size_t>(n) * 12});
      largest = std::max(largest, static_cast<std::size_t>(n) * 12);
    });
    std::filesystem::create_directories(folder);
    offload::NvmeStoreOptions so;
    so.directory = folder;
    so.direct = offload::NvmeStore::supports_direct_io(folder);
    auto store = offload::NvmeStore::open(so);
    if (!store) return fail(std::move(store).error());
    auto pool = offload::PinnedPool::create({.host_memory_budget = 8 * offload::page_rounded(largest)});
    if (!pool) return fail(std::move(pool).error());
    offload::SwapperOptions swap_options;
    if (const char* b = std::getenv("ENGINE_BENCH_SWAP_BUFFERS")) swap_options.buffer_count = std::atoi(b);
    auto swapper = offload::Swapper::create(**store, *pool, swap_options);
    if (!swapper) return fail(std::move(swapper).error());
    auto body = [&]() -> async::Task<Result<double>> {
      auto nothing = [](std::size_t, std::span<std::byte>) -> async::Task<Result<void>> { co_return Result<void>{}; };
      COSHARD_CO_TRY(co_await (*swapper)->initialize(groups, nothing));
      double total = 0;
      for (int pass = 0; pass < kSteps - 1; ++pass) {
        const auto start = Clock::now();
        COSHARD_CO_TRY(co_await (*swapper)->for_each(groups, nothing, true));
        total += std::chrono::duration<double, std::milli>(Clock::now() - start).count();
      }
      co_return total / (kSteps - 1);
    };
    return r.rt.block_on(body());
  };
  for (auto _ : state) {
    auto device = optimizer_ms(OptimizerOffload::none);
    auto cpu = optimizer_ms(OptimizerOffload::cpu);
    auto nvme = optimizer_ms(OptimizerOffload::nvme);
    auto io = io_ms();
    if (!device || !cpu || !nvme || !io) {
      std::string e = !device ? device.error().message() : !cpu ? cpu.error().message()
                      : !nvme ? nvme.error().message() : io.error().message();
      return state.SkipWithError(e.c_str());
    }
    state.counters["params_M"] = static_cast<double>(kModel.parameter_count()) / 1e6;
    state.counters["device_opt_ms"] = *device;
    state.counters["cpu_opt_ms"] = *cpu;
    state.counters["nvme_opt_ms"] = *nvme;
    state.counters["io_ms"] = *io;
    state.counters["nvme_vs_max"] = *nvme / std::max(*io, *cpu);
    state.counters["nvme_vs_sum"] = *nvme / (*io + *cpu);
    state.SetIterationTime(*nvme * 1e-3);
  }
  std::filesystem::remove_all(folder);
}
BENCHMARK(BM_OptimizerOffload)->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);

// Parameter offload: the whole step with the shards off the device against the same optimizer
// offload with the shards on it (cpu with cpu, nvme with nvme), and the device memory it frees.
// On a CPU "device" the copy into place is a memcpy, so the cost shown is the engine's
// (staging, reads ahead, slots), not a PCIe transfer.
void BM_ParameterOffload(benchmark::State& state) {
  constexpr int kSteps = 4;
  const auto folder = std::filesystem::current_path() / "parameter_offload_bench";
  for (auto _ : state) {
    for (const OffloadTarget where : {OffloadTarget::cpu, OffloadTarget::nvme}) {
      auto resident = offload_run(folder, where, OffloadTarget::none, kSteps);
      auto offloaded = offload_run(folder, where, where, kSteps);
      if (!resident || !offloaded)
        return state.SkipWithError((!resident ? resident.error() : offloaded.error()).message().c_str());
      const std::string w(to_string(where));
      state.counters[w + "_resident_step_ms"] = resident->step_ms;
      state.counters[w + "_offloaded_step_ms"] = offloaded->step_ms;
      state.counters[w + "_step_ratio"] = offloaded->step_ms / resident->step_ms;
      state.counters[w + "_device_MiB_saved"] =
          static_cast<double>(resident->device_bytes - offloaded->device_bytes) / (1 << 20);
      if (where == OffloadTarget::nvme) state.SetIterationTime(offloaded->step_ms * 1e-3);
    }
  }
  std::filesystem::remove_all(folder);
}
BENCHMARK(BM_ParameterOffload)->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);

// The offloaded CPU step during backward (step_in_backward) against after it: the whole step,
// optimizer on the CPU (arg 0) or on NVMe (arg 1: the swapper's reads and writes go beside
// forward and backward too), parameters on the device, runs alternated (after, during, after,
// during) so that drift falls on both. Below 1: the step hid behind backward.
void BM_StepInBackward(benchmark::State& state) {
  constexpr int kSteps = 6;
  const auto where = state.range(0) == 0 ? OffloadTarget::cpu : OffloadTarget::nvme;
  state.SetLabel(std::string(to_string(where)));
  const auto folder = std::filesystem::current_path() / "step_in_backward_bench";
  for (auto _ : state) {
    double after = 0, during = 0, after_tail = 0, during_tail = 0;
    for (int round = 0; round < 2; ++round) {
      for (const bool early : {false, true}) {
        auto run = offload_run(folder, where, OffloadTarget::none, kSteps, early);
        if (!run) return state.SkipWithError(run.error().message().c_str());
        (early ? during : after) += run->step_ms / 2;
        (early ? during_tail : after_tail) += run->optimizer_ms / 2;
      }
    }
    state.counters["after_step_ms"] = after;
    state.counters["during_step_ms"] = during;
    // The optimizer phase after backward (timeline): what is left of the step once backward ends.
    state.counters["after_opt_ms"] = after_tail;
    state.counters["during_opt_ms"] = during_tail;
    state.counters["ratio"] = during / after;
    state.SetIterationTime(during * 1e-3);
  }
  std::filesystem::remove_all(folder);
}
BENCHMARK(BM_StepInBackward)->Arg(0)->Arg(1)->UseManualTime()->Iterations(1)->Unit(benchmark::kMillisecond);

void BM_HostOverheadPerUnit(benchmark::State& state) {
  constexpr int kModules = 1000;
  RankSetup r;
  auto comms = collectives::make_local_communicators(1);
  if (!comms) return state.SkipWithError(comms.error().message().c_str());
  auto sharded = tiny_modules(kModules);
  auto plain = tiny_modules(kModules);
  auto opt = Optimizer::adamw({});
  auto plain_opt = Optimizer::adamw({});
  auto store = ParameterStore::create(*r.ctx, *plain, DataType::f32);
  if (!opt || !plain_opt || !store) return state.SkipWithError("setup failed");
  EngineOptions o;
  o.zero_stage = 3;
  auto engine = Engine::create(*r.ctx, *(*comms)[0], *sharded, **opt, o);
  if (!engine) return state.SkipWithError(engine.error().message().c_str());
  std::vector<double> xs(16 * 8, 0.5);
  auto bytes = encode_values(xs, DataType::f32);
  auto x = r.ctx->upload(bytes, Shape{16, 8}, DataType::f32);
  if (!x) return state.SkipWithError("upload failed");

  // Host time to enqueue one forward pass (the device may still be running it), then drain.
  // Both the wall time and the CPU time of the enqueueing thread (on 2 cores the stream
  // workers preempt it, which wall time counts and CPU time does not).
  struct HostTime {
    double wall = 0, cpu = 0;
  };
  auto thread_cpu = [] {
    timespec ts{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  };
  // The engine's pass is an inference pass (a forward outside a step or one is a named misuse).
  auto pass = [&](Module& model, bool hooks) -> async::Task<Result<HostTime>> {
    r.ctx->set_hooks(hooks ? engine->get() : nullptr);
    if (hooks) COSHARD_CO_TRY((*engine)->begin_inference());
    const auto start = Clock::now();
    const double cpu_start = thread_cpu();
    COSHARD_CO_TRY_ASSIGN(Tensor y, co_await r.ctx->forward(model, *x));
    HostTime host{std::chrono::duration<double>(Clock::now() - start).count(), thread_cpu() - cpu_start};
    if (hooks) COSHARD_CO_TRY(co_await (*engine)->end_inference());
    model.clear_saved_recursive();
    COSHARD_CO_TRY_ASSIGN(auto done, r.stream->record());
    COSHARD_CO_TRY(co_await done);
    (void)y;
    co_return host;
  };
  double engine_seconds = 0, plain_seconds = 0, engine_cpu = 0, plain_cpu = 0;
  std::int64_t passes = 0;
  for (auto _ : state) {
    auto with_engine = r.rt.block_on(pass(*sharded, true));
    auto without = r.rt.block_on(pass(*plain, false));
    if (!with_engine || !without)
      return state.SkipWithError(("forward failed: " + (with_engine ? without.error() : with_engine.error()).message()).c_str());
    engine_seconds += with_engine->wall;
    plain_seconds += without->wall;
    engine_cpu += with_engine->cpu;
    plain_cpu += without->cpu;
    ++passes;
    state.SetIterationTime(with_engine->wall);
  }
  r.ctx->set_hooks(engine->get());
  const double per_unit = 1e6 / (static_cast<double>(passes) * kModules);
  state.counters["engine_us_per_module"] = engine_seconds * per_unit;
  state.counters["plain_us_per_module"] = plain_seconds * per_unit;
  state.counters["fetch_release_us_per_unit"] = (engine_seconds - plain_seconds) * per_unit;
  state.counters["fetch_release_cpu_us_per_unit"] = (engine_cpu - plain_cpu) * per_unit;
}
BENCHMARK(BM_HostOverheadPerUnit)->UseManualTime()->Unit(benchmark::kMillisecond)->MinTime(2.0);

}  // namespace

BENCHMARK_MAIN();
