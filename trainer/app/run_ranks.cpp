#include "run_ranks.hpp"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <exception>
#include <new>
#include <optional>
#include <system_error>
#include <thread>

#include "coshard/async/log.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/cpu_threads.hpp"
#include "flight_dumps.hpp"
#include "launch_mode.hpp"
#include "rank_run.hpp"
#include "run_data.hpp"
#include "run_checks.hpp"
#include "stop_signals.hpp"

namespace coshard::train_app {

namespace {

// What a thread that could not start (EAGAIN) means here: most often the memory for its stack,
// under a limit on the address space, or the limit on a user's threads.
std::string thread_failure_hint(const std::exception& e) {
  const auto* error = dynamic_cast<const std::system_error*>(&e);
  if (error == nullptr || error->code() != std::errc::resource_unavailable_try_again) return "";
  return " (a thread could not start: out of host memory for its stack, or at the limit on threads; "
         "fewer --blas-threads start fewer)";
}

// A rank that could not run, reported and its communicator aborted; where even that runs out of
// memory (the message, the abort's own), the process says so in a fixed text and exits 1: a
// named error, never std::terminate's abort, and no rank left waiting on this one.
template <class Report>
void report_rank_failure(int rank, const char* what, const std::exception& e, Report& report) noexcept {
  try {
    const bool memory = dynamic_cast<const std::bad_alloc*>(&e) != nullptr;
    report(rank, std::string(what) + (memory ? "out of host memory (std::bad_alloc)" : e.what()) + thread_failure_hint(e));
  } catch (...) {
    char text[256];
    const int n = std::snprintf(text, sizeof text,
                                "coshard-train: rank %d: out of host memory (%s%s), with too little left to stop the other "
                                "ranks in order; exiting\n",
                                rank, what, e.what());
    if (n > 0) (void)!::write(2, text, static_cast<std::size_t>(std::min<int>(n, sizeof text - 1)));
    std::_Exit(1);
  }
}

// Exit status of a failure to set up the ranks: 2 for what the user asked (a refusal), 1 for what
// the machine could not give (memory, a thread), as for the same failure later in the run.
int setup_failure_status(const Error& e) { return e.code() == ErrorCode::out_of_memory ? 1 : 2; }

// One rank per process: started by a launcher, or one rank asked of NCCL or MPI.
bool one_rank_per_process(const Options& o, collectives::Backend backend) {
  const bool processes = o.launch.launcher != collectives::Launcher::none;
  return processes || backend == collectives::Backend::nccl || backend == collectives::Backend::mpi ||
         (o.device == "cuda" && o.world_size == 1 && backend != collectives::Backend::local);
}

// One process per rank: NCCL on a GPU, MPI on the CPU, or Local for a single CPU rank. An exit
// status when its communicator cannot be made or cannot serve the run as asked.
std::optional<int> run_process_rank(const Options& o, collectives::Backend backend, const trainer::TokenSource& data,
                                    const trainer::TokenSource* val, Shared& shared) {
  log::set_thread_rank(o.launch.rank);
  async::Runtime rt;
  auto comm = collectives::communicator_from_env(rt, process_communicator_options(o, backend));
  if (!comm) {
    std::fprintf(stderr, "coshard-train: rank %d: %s\n", o.launch.rank, comm.error().message().c_str());
    return setup_failure_status(comm.error());
  }
  if (launched_with_others(o)) {  // (every rank knows every other trains, before any collective of the run)
    auto agreed = rt.block_on(agree_on_launch_mode(**comm, LaunchMode::train));
    if (!agreed) {
      std::fprintf(stderr, "coshard-train: rank %d: %s\n", o.launch.rank, agreed.error().message().c_str());
      return 2;
    }
  }
  if (!(*comm)->stream().device().is_cuda() && o.device == "cuda") {
    std::fprintf(stderr, "coshard-train: --device cuda: the %s backend here moves host memory (no CUDA device or no "
                 "NCCL in this build, or --backend %s)\n", std::string((*comm)->backend()).c_str(), o.backend.c_str());
    return 2;
  }
  std::optional<FlightDumps> dumps;
  if (!o.flight_recorder.empty()) {
    dumps.emplace(o.flight_recorder, std::vector<const collectives::Communicator*>{comm->get()}, (*comm)->size());
    shared.flight = &*dumps;
  }
  auto done = rt.block_on(run_rank(o, **comm, data, val, shared, false));
  if (!done) {
    shared.error((*comm)->rank(), done.error().message());
    (*comm)->abort(done.error().message());
  }
  return std::nullopt;
}

// Ranks as threads: on the CPU, or sharing GPU 0 (the Local backend on device memory). An exit
// status when their communicators cannot be made.
std::optional<int> run_thread_ranks(const Options& o, const trainer::TokenSource& data, const trainer::TokenSource* val,
                                    Shared& shared) {
  const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(o.collective_timeout_s * 1000.0));
  const async::Device device = o.device == "cuda" ? async::Device::cuda(0) : async::Device::cpu();
  collectives::LocalOptions local{.device = device};
  if (timeout.count() > 0) local.timeout = timeout;
  auto comms = collectives::make_local_communicators(o.world_size, local);
  if (!comms) {
    std::fprintf(stderr, "coshard-train: %s\n", comms.error().message().c_str());
    return setup_failure_status(comms.error());
  }
  // One epoch for every rank's timeline (CPU streams share steady_clock; the streams of one
  // GPU share its clock). Never waited for: it passes at once, long before any timing is read.
  auto clock = async::Stream::create(device, {.name = "clock"});
  if (clock) {
    if (auto epoch = clock->record_timed()) shared.epoch = *epoch;
  }
  std::optional<FlightDumps> dumps;
  if (!o.flight_recorder.empty()) {
    std::vector<const collectives::Communicator*> all;
    for (const auto& c : *comms) all.push_back(c.get());
    dumps.emplace(o.flight_recorder, std::move(all), o.world_size);
    shared.flight = &*dumps;
  }
  std::vector<std::thread> threads;
  // A rank that fails, even to start, aborts its communicator: the others stop at once,
  // naming it, instead of waiting out the collective timeout for it.
  auto rank_failed = [&](int r, const std::string& message) {
    shared.error(r, message);
    (*comms)[static_cast<std::size_t>(r)]->abort(message);
  };
  for (int r = 0; r < o.world_size; ++r) {
    try {
      threads.emplace_back([&, r] {
        try {
          log::set_thread_rank(r);  // this thread's lines, and its runtime's, name the rank
          async::Runtime rt;
          auto done = rt.block_on(run_rank(o, *(*comms)[static_cast<std::size_t>(r)], data, val, shared, true));
          if (!done) rank_failed(r, done.error().message());
        } catch (const std::exception& e) {  // the runtime's own thread could not start, say
          report_rank_failure(r, "cannot run: ", e, rank_failed);
        }
      });
    } catch (const std::exception& e) {
      report_rank_failure(r, "cannot start its thread: ", e, rank_failed);
    }
  }
  for (auto& t : threads) t.join();
  return std::nullopt;
}

// The run's exit status, said: the ranks' errors (with the flight recorder's diagnosis), or the
// step a stop signal ended the run after.
int report_outcome(const Options& o, const Shared& shared) {
  if (!shared.errors.empty()) {
    std::fflush(stdout);
    for (const auto& e : shared.errors) std::fprintf(stderr, "coshard-train: %s\n", e.c_str());
    // What the communicators wrote as they failed (rank 0 of processes reads the shared folder).
    const bool processes = o.launch.launcher != collectives::Launcher::none;
    if (!o.flight_recorder.empty() && o.launch.rank == 0)
      print_flight_diagnosis(o.flight_recorder, processes ? o.launch.world_size : o.world_size);
    return 1;
  }
  if (const int sig = stop_signal(); sig != 0 && shared.stopped_after >= 0) {
    std::fflush(stdout);
    std::fprintf(stderr, "coshard-train: stopped by %s after step %lld%s%s\n", signal_name(sig),
                 static_cast<long long>(shared.stopped_after.load()),
                 o.checkpoint_dir.empty() ? " (no --checkpoint-dir: nothing saved)" : "; its checkpoint is published",
                 o.export_path.empty() ? "" : "; --export skipped (training did not finish)");
    return 128 + sig;
  }
  return 0;
}

}  // namespace

int run_ranks(const Options& o) {
  auto opened = open_run_data(o);
  if (!opened) {
    std::fprintf(stderr, "coshard-train: %s\n", opened.error().message().c_str());
    return 2;
  }
  const std::unique_ptr<trainer::TokenSource> data = std::move(opened->train), val = std::move(opened->validation);

  Shared shared;
  const bool processes = o.launch.launcher != collectives::Launcher::none;
  const auto backend = collectives::parse_backend(o.backend);
  if (!backend) {
    std::fprintf(stderr, "coshard-train: --backend: %s\n", backend.error().message().c_str());
    return 2;
  }
  const bool one_rank = one_rank_per_process(o, *backend);
  if (!processes && one_rank && o.world_size != 1) {
    std::fprintf(stderr,
                 "coshard-train: --backend %s with --world-size %d: ranks as threads of one process use the Local "
                 "backend; start %d processes instead (mpirun -np %d coshard-train ...)\n",
                 o.backend.c_str(), o.world_size, o.world_size, o.world_size);
    return 2;
  }
  // Ranks share the cores of a machine: each gets its share of BLAS threads, not all of them.
  modules::set_cpu_math_threads(rank_math_threads(o));
  const std::optional<int> failed = one_rank ? run_process_rank(o, *backend, *data, val.get(), shared)
                                             : run_thread_ranks(o, *data, val.get(), shared);
  if (failed) return *failed;
  return report_outcome(o, shared);
}

int ranks_on_this_machine(const Options& o) {
  return o.launch.launcher != collectives::Launcher::none ? o.launch.local_size : o.world_size;
}

int rank_math_threads(const Options& o) {
  return o.blas_threads > 0 ? o.blas_threads : modules::default_cpu_math_threads(ranks_on_this_machine(o));
}

}  // namespace coshard::train_app
