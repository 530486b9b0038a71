// coshard-train: trains the GPT-style model of coshard::modules with the ZeRO engine.
//
//   coshard-train                                  synthetic task, 2 Local ranks, ZeRO-3, CPU
//   coshard-train --data book.txt --steps 2000     a text file as bytes
//   coshard-train --checkpoint-dir ck --checkpoint-every 50 ... ; later: the same with --resume
//
// Ranks: --world-size N runs N ranks as threads of this process (the Local backend: on the CPU,
// or with --device cuda sharing GPU 0). Started by a launcher (mpirun, srun, or torchrun's
// variables), this process is one rank of many: NCCL on GPUs, MPI on the CPU (--backend picks
// another). --device cuda alone is one rank on NCCL.
// --batch is the global batch per step, split evenly over the ranks; the data of a step depends
// only on (--seed, step), so runs at different world sizes and stages see the same data.
#include <CLI/CLI.hpp>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cmath>
#include <csignal>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <system_error>
#include <fstream>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <thread>

#include "coshard/async/log.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/collectives/flight_recorder.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/cpu_blas_kernels.hpp"
#include "coshard/modules/cpu_threads.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/safetensors_folder.hpp"
#include "coshard/async/folder_lock.hpp"
#include "coshard/trainer/settings.hpp"
#include "coshard/trainer/trace.hpp"
#include "coshard/zero/hf_llama.hpp"
#include "coshard/trainer/trainer.hpp"
#include "progress.hpp"
#include "run_data.hpp"
#include "samples.hpp"
#include "command_line.hpp"
#include "flight_dumps.hpp"
#include "launch_mode.hpp"
#include "memory_check.hpp"
#include "run_checks.hpp"

namespace {

using namespace coshard;
using trainer::HostBatch;
using trainer::TrainerConfig;

using train_app::Options;

// Rank 0 prints and writes; every rank reports its failure.
// The first SIGINT/SIGTERM/SIGHUP (a closed terminal) asks for a graceful stop (recorded here;
// lock-free, so safe in a handler); a second one stops the process at once, the way the signal
// would have.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

// --stop-timeout: the first signal also sets an alarm; if the run has not ended when it rings
// (stuck where no step boundary comes: a product that never returns, a peer that never answers),
// the process ends as the signal would have, saying so.
std::atomic<unsigned> g_stop_timeout_s{0};

// Set once the run has saved and exported everything (its closing sample is all that is left): a
// stop signal then ends the process at once instead of waiting for the sample.
std::atomic<bool> g_nothing_to_lose{false};

extern "C" void on_stop_signal(int sig) {
  if (g_nothing_to_lose.load()) {
    static constexpr char kNote[] = "coshard-train: stopped during the closing sample (everything was saved)\n";
    [[maybe_unused]] const ssize_t n = ::write(2, kNote, sizeof kNote - 1);
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    _exit(128 + sig);
  }
  if (g_stop_signal.exchange(sig) != 0) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  if (const unsigned seconds = g_stop_timeout_s.load(); seconds > 0) alarm(seconds);
}

extern "C" void on_stop_timeout(int) {
  static constexpr char kNote[] =
      "coshard-train: the run did not stop within --stop-timeout after the signal; exiting without a final save "
      "(the checkpoints already published are intact)\n";
  [[maybe_unused]] const ssize_t n = ::write(2, kNote, sizeof kNote - 1);
  const int sig = g_stop_signal.load();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
  _exit(128 + sig);  // (if the signal is blocked in this thread)
}

// SIGUSR1 asks for flight records; without --flight-recorder there is nowhere to write them, and
// the signal's default action would end the run unsaved: say so and go on (write(2) is safe here).
extern "C" void on_sigusr1_without_recorder(int) {
  static constexpr char kNote[] = "coshard-train: SIGUSR1 ignored (no --flight-recorder folder to write records to)\n";
  [[maybe_unused]] const ssize_t n = ::write(2, kNote, sizeof kNote - 1);
}

const char* signal_name(int sig) { return sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : "SIGTERM"; }

struct Shared {
  // Ranks as threads agree on the step to stop at through memory: the first rank to see the
  // signal at the top of step k sets k + 1. No rank can be past the top of k + 1 then (step k's
  // collectives need this rank), so every rank runs step k and stops before k + 1.
  std::atomic<std::int64_t> stop_at{std::numeric_limits<std::int64_t>::max()};
  std::atomic<std::int64_t> stopped_after{-1};
  std::mutex mutex;
  std::vector<std::string> errors;
  trainer::TraceWriter trace;
  async::Event epoch;  // ranks as threads share one clock: their timelines line up
  void error(int rank, const std::string& message) {
    std::lock_guard lock(mutex);
    errors.push_back("rank " + std::to_string(rank) + ": " + message);
  }
};

// Ranks as processes agree through one small all-reduce (max) of their flags per step.
async::Task<Result<bool>> any_rank_stopping(trainer::Trainer& t, collectives::Communicator& comm, bool mine) {
  auto& ctx = t.context();
  const std::int32_t flag = mine ? 1 : 0;
  COSHARD_CO_TRY_ASSIGN(auto tensor, ctx.upload(std::as_bytes(std::span<const std::int32_t>(&flag, 1)), modules::Shape{1},
                                                modules::DataType::i32));
  COSHARD_CO_TRY_ASSIGN(auto uploaded, ctx.stream().record());
  COSHARD_CO_TRY(comm.stream().wait(uploaded));
  COSHARD_CO_TRY_ASSIGN(auto reduced,
                        comm.all_reduce(tensor.data(), tensor.data(), 1, modules::DataType::i32, collectives::ReduceOp::max));
  COSHARD_CO_TRY(ctx.stream().wait(reduced));
  COSHARD_CO_TRY_ASSIGN(auto values, co_await ctx.read(tensor));
  co_return values.at(0) > 0;
}

async::Task<Result<void>> run_rank(const Options& o, collectives::Communicator& comm, const trainer::TokenSource& data,
                                   const trainer::TokenSource* val, Shared& shared, bool threads) {
  const int rank = comm.rank(), world = comm.size();
  const bool lead = rank == 0;
  COSHARD_CO_TRY_ASSIGN(auto model, o.model.build());
  trainer::TrainerBuilder builder(o.train);
  builder.communicator(comm);
  // What defines this run beyond the parameters' shapes: a resume with another shape of attention
  // (--heads) or other data is refused.
  builder.run_identity("model", o.model.identity(o.seq));
  builder.run_identity("data", data.identity());
  // What this binary does with every rank alike (a difference would hang or mismatch a collective).
  builder.ranks_agree_on("--batch", std::to_string(o.batch));
  builder.ranks_agree_on("--steps", std::to_string(o.steps));
  builder.ranks_agree_on("--checkpoint-every", std::to_string(o.checkpoint_every) + (o.resume ? ", --resume" : ""));
  builder.ranks_agree_on("--export", o.export_path.empty() ? "no" : "yes");
  std::string prompt;
  for (const std::int32_t id : o.prompt) prompt += std::to_string(id) + ",";
  builder.ranks_agree_on("samples", o.sampling ? "every " + std::to_string(o.sample_every) + ", " +
                                                     std::to_string(o.sample.tokens) + " tokens, temperature " +
                                                     std::to_string(o.sample.temperature) + ", top-k " +
                                                     std::to_string(o.sample.top_k) + ", prompt " + prompt
                                               : "none");
  builder.ranks_agree_on("--val-data", val ? val->identity() : "none");
  // Ranks starting from different weights would each keep their own blocks of them: one model of
  // several files, trained without a word.
  builder.ranks_agree_on("--init", o.init.empty() ? "none" : o.init_fingerprint);
  if (val) builder.validation(*val, o.train.eval_every, o.train.eval_batches);
  COSHARD_CO_TRY_ASSIGN(auto t, co_await builder.build(*model));
  if (shared.epoch.recorded()) COSHARD_CO_TRY(t.set_timeline_epoch(shared.epoch));
  if (o.init_is_folder) {
    COSHARD_CO_TRY(co_await zero::load_hf_llama(t.engine(), o.init, o.model.llama));
  } else if (!o.init.empty()) {
    COSHARD_CO_TRY(co_await t.load_safetensors(o.init));
  }
  if (o.resume) {
    auto loaded = co_await t.load_checkpoint(o.checkpoint_dir);
    if (!loaded) co_return fail(std::move(loaded).error().with_context("--resume"));
  }
  const std::int64_t first = t.steps_done();
  // A resume that has nothing left to train would print "resumed" and exit 0 as if it had.
  if (o.resume && first >= o.steps && o.steps > 0)
    co_return fail(ErrorCode::invalid_argument, "--steps ", o.steps, ": the checkpoint in ", o.checkpoint_dir,
                   " is at step ", first, " already, so there is nothing to train (give --steps above ", first, ")");
  if (lead && !o.quiet) {
    std::printf("coshard-train: %lld-parameter %s, %s\n", static_cast<long long>(o.model.parameter_count()),
                o.model.describe().c_str(), data.describe().c_str());
    if (val)
      std::printf("  validation: %s, %lld batches%s\n", val->describe().c_str(), static_cast<long long>(o.train.eval_batches),
                  o.train.eval_every > 0 ? (", every " + std::to_string(o.train.eval_every) + " steps and after the last").c_str()
                                         : ", after the last step");
    if (o.device == "cuda") {
      const bool fused = modules::attention_is_fused(async::Device::cuda(0), o.train.engine_options().dtype,
                                                     o.model.head_dim(), o.train.attention);
      std::printf("  attention: %s%s\n", fused ? "fused kernels (one statistic a query row kept)"
                                                 : "materialized (the T x T probabilities kept)",
                  o.attention_chosen ? ": heads of 128 run faster so today, and the run fits with them "
                                       "(--attention fused keeps them off the device)"
                                     : "");
    }
    if (o.train.activation_checkpointing.enabled())
      std::printf("  activation checkpointing: %s\n", o.train.activation_checkpointing.to_string().c_str());
    if (o.device == "cpu") std::printf("  matrix products: %s\n", modules::cpu_blas_kernels().describe().c_str());
    const std::string ranks = o.launch.launcher == collectives::Launcher::none
                                  ? "threads of this process"
                                  : "processes started by " + std::string(collectives::to_string(o.launch.launcher));
    std::printf("  ZeRO-%d, %d rank(s) on %s, %s backend (%s), global batch %lld x %lld tokens, %zu fetch units%s\n",
                o.train.zero_stage, world, o.device.c_str(), std::string(comm.backend()).c_str(), ranks.c_str(),
                static_cast<long long>(o.batch),
                static_cast<long long>(o.seq), t.engine().units().size(),
                first > 0 ? (", resumed at step " + std::to_string(first)).c_str() : "");
    // Hybrid sharding: the groups the units are sharded over (each a copy of every block).
    std::set<int> groups;
    for (const auto& u : t.engine().units())
      if (o.train.zero_stage > 0 && u.shard_ranks < world) groups.insert(u.shard_ranks);
    for (const int g : groups)
      std::printf("  hybrid sharding: units sharded over groups of %d consecutive rank(s), %d copies (across them: one "
                  "all-reduce of each gradient shard)\n", g, world / g);
    std::fflush(stdout);
  }
  std::ofstream metrics;
  if (lead && !o.metrics.empty()) {
    metrics.open(o.metrics, first > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics) co_return fail(ErrorCode::io, "--metrics ", o.metrics, ": cannot open for writing");
  }
  trainer::Progress progress(first, o.steps, stdout);
  std::int64_t saved_at = first;
  // The first step of the current run of steps whose loss was not finite (0: the last one's was).
  std::int64_t nonfinite_since = 0;
  double last_loss = 0;
  for (std::int64_t step = first; step < o.steps; ++step) {
    if (threads) {
      if (g_stop_signal.load() != 0) {
        std::int64_t unset = std::numeric_limits<std::int64_t>::max();
        shared.stop_at.compare_exchange_strong(unset, step + 1);
      }
      if (step >= shared.stop_at.load()) break;
    } else {
      COSHARD_CO_TRY_ASSIGN(const bool stopping, co_await any_rank_stopping(t, comm, g_stop_signal.load() != 0));
      if (stopping) break;
    }
    const HostBatch global = data.batch(static_cast<std::uint64_t>(step), o.batch, o.seq);
    if (val && step + 1 == o.steps) t.request_validation();  // (the last step: evaluated whatever --eval-every says)
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(global.rank_rows(rank, world)));
    if (!std::isfinite(stats.loss)) {
      if (nonfinite_since == 0) nonfinite_since = stats.step;
    } else {
      nonfinite_since = 0;
    }
    last_loss = stats.loss;
    if (!o.trace.empty()) shared.trace.add(rank, stats.step, stats.timeline);
    if (lead) {
      if (!o.quiet) progress.update(stats);
      if (metrics.is_open()) {
        metrics << trainer::to_json_line(stats) << '\n';
        metrics.flush();
        if (!metrics) co_return fail(ErrorCode::io, "--metrics ", o.metrics, ": write failed");
      }
    }
    if (o.sample_every > 0 && stats.step % o.sample_every == 0 && stats.step < o.steps) {
      if (lead && !o.quiet) progress.finish();
      COSHARD_CO_TRY(co_await train_app::sample_after(t, o, data, stats.step, o.quiet));
    }
    if (o.checkpoint_every > 0 && stats.step % o.checkpoint_every == 0) {
      COSHARD_CO_TRY(co_await t.save_checkpoint(o.checkpoint_dir));
      saved_at = stats.step;
    }
  }
  // --steps 0 with validation data: the validation loss of the weights as given (--init's, or the
  // seed's), the one way to get it; announced in the header, so it is run.
  if (o.steps == 0 && val) {
    COSHARD_CO_TRY_ASSIGN(const double loss, co_await t.validation_loss(o.batch, o.seq));
    if (lead) {
      std::printf("validation loss %.4f at step %lld (no training: --steps 0)\n", loss, static_cast<long long>(first));
      std::fflush(stdout);
    }
  }
  const bool stopped = t.steps_done() < o.steps;
  // Stopped by a signal: the steps since the last checkpoint are saved (when there is a folder
  // for them), and the pending save is published before the exit.
  if (stopped && !o.checkpoint_dir.empty() && t.steps_done() > saved_at)
    COSHARD_CO_TRY(co_await t.save_checkpoint(o.checkpoint_dir));
  COSHARD_CO_TRY(co_await t.finish_checkpoint());
  if (stopped) shared.stopped_after = t.steps_done();
  // No rank tears down (a counted stream synchronize) before rank 0 has reported its last step.
  COSHARD_CO_TRY_ASSIGN(auto all_done, comm.barrier());
  COSHARD_CO_TRY(co_await all_done);
  if (lead && !o.quiet) progress.finish();
  if (lead && !o.trace.empty()) {
    // Local ranks: every rank added its spans before the barrier. Processes: this rank's own.
    COSHARD_CO_TRY(shared.trace.write(o.trace));
    if (!o.quiet) std::printf("trace: %zu spans in %s\n", shared.trace.size(), o.trace.c_str());
  }
  // A run that ends on losses that are not finite learned nothing since they began, even with
  // finite weights (the model's outputs overflow): an error, and nothing exported (the loss is
  // averaged over ranks, so every rank says so).
  if (nonfinite_since > 0)
    co_return fail(ErrorCode::invalid_argument, "the loss has not been finite since step ", nonfinite_since, " (step ",
                   t.steps_done(), ": ", last_loss, "; every such step is skipped): training diverged (a learning rate or ",
                   "weight decay too large, or non-finite data)", o.export_path.empty() ? "" : "; --export skipped");
  if (!o.export_path.empty() && !stopped) {
    if (o.export_is_folder) {
      modules::SafetensorsFolderOptions shards;  // named: GCC 12 mishandles default arguments in co_await
      COSHARD_CO_TRY(co_await zero::export_hf_llama(t.engine(), o.export_path, o.model.llama, std::move(shards)));
    } else {
      COSHARD_CO_TRY(co_await t.export_safetensors(o.export_path));
    }
    if (lead && !o.quiet) std::printf("exported %s\n", o.export_path.c_str());
  }
  // The sample after the last step (--steps 0: the only one, always shown), once everything is
  // saved and exported on every rank: a stop signal during it has nothing left to lose, and ends
  // the process at once.
  if (o.sampling && !stopped) {
    COSHARD_CO_TRY_ASSIGN(auto exported, comm.barrier());
    COSHARD_CO_TRY(co_await exported);
    g_nothing_to_lose.store(true);
    if (g_stop_signal.load() != 0) co_return Result<void>{};  // (it came before: no sample)
    COSHARD_CO_TRY(co_await train_app::sample_after(t, o, data, t.steps_done(), o.quiet && o.steps > 0));
  }
  co_return Result<void>{};
}

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

int run(const Options& o) {
  auto opened = train_app::open_run_data(o);
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
  // One rank per process: started by a launcher, or one rank asked of NCCL or MPI.
  const bool one_rank_per_process = processes || *backend == collectives::Backend::nccl ||
                                    *backend == collectives::Backend::mpi ||
                                    (o.device == "cuda" && o.world_size == 1 && *backend != collectives::Backend::local);
  if (!processes && one_rank_per_process && o.world_size != 1) {
    std::fprintf(stderr,
                 "coshard-train: --backend %s with --world-size %d: ranks as threads of one process use the Local "
                 "backend; start %d processes instead (mpirun -np %d coshard-train ...)\n",
                 o.backend.c_str(), o.world_size, o.world_size, o.world_size);
    return 2;
  }
  const auto timeout = std::chrono::milliseconds(static_cast<std::int64_t>(o.collective_timeout_s * 1000.0));
  // Ranks share the cores of a machine: each gets its share of BLAS threads, not all of them.
  modules::set_cpu_math_threads(o.blas_threads > 0 ? o.blas_threads
                                                   : modules::default_cpu_math_threads(processes ? o.launch.local_size
                                                                                                 : o.world_size));
  if (one_rank_per_process) {
    // One process per rank: NCCL on a GPU, MPI on the CPU, or Local for a single CPU rank.
    log::set_thread_rank(o.launch.rank);
    async::Runtime rt;
    auto comm = collectives::communicator_from_env(rt, train_app::process_communicator_options(o, *backend));
    if (!comm) {
      std::fprintf(stderr, "coshard-train: rank %d: %s\n", o.launch.rank, comm.error().message().c_str());
      return setup_failure_status(comm.error());
    }
    if (train_app::launched_with_others(o)) {  // (every rank knows every other trains, before any collective of the run)
      auto agreed = rt.block_on(train_app::agree_on_launch_mode(**comm, train_app::LaunchMode::train));
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
    std::optional<train_app::FlightDumps> dumps;
    if (!o.flight_recorder.empty()) dumps.emplace(o.flight_recorder, std::vector<const collectives::Communicator*>{comm->get()},
                                                  (*comm)->size());
    auto done = rt.block_on(run_rank(o, **comm, *data, val.get(), shared, false));
    if (!done) {
      shared.error((*comm)->rank(), done.error().message());
      (*comm)->abort(done.error().message());
    }
  } else {
    // Ranks as threads: on the CPU, or sharing GPU 0 (the Local backend on device memory).
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
    std::optional<train_app::FlightDumps> dumps;
    if (!o.flight_recorder.empty()) {
      std::vector<const collectives::Communicator*> all;
      for (const auto& c : *comms) all.push_back(c.get());
      dumps.emplace(o.flight_recorder, std::move(all), o.world_size);
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
            auto done = rt.block_on(run_rank(o, *(*comms)[static_cast<std::size_t>(r)], *data, val.get(), shared, true));
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
  }
  if (!shared.errors.empty()) {
    std::fflush(stdout);
    for (const auto& e : shared.errors) std::fprintf(stderr, "coshard-train: %s\n", e.c_str());
    // What the communicators wrote as they failed (rank 0 of processes reads the shared folder).
    if (!o.flight_recorder.empty() && o.launch.rank == 0)
      train_app::print_flight_diagnosis(o.flight_recorder, processes ? o.launch.world_size : o.world_size);
    return 1;
  }
  if (const int sig = g_stop_signal.load(); sig != 0 && shared.stopped_after >= 0) {
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

static int run_main(int argc, char** argv) {
  train_app::Options o;
  if (auto done = train_app::parse_command_line(argc, argv, o)) return *done;
  const TrainerConfig& c = o.train;
  // Cross-option checks, each naming the values.
  auto usage = [](const std::string& m) {
    std::fprintf(stderr, "coshard-train: %s\n", m.c_str());
    return 2;
  };
  const auto launch = collectives::read_launch_env();
  if (!launch) return usage(launch.error().message());
  o.launch = *launch;
  if (o.print_config)  // (one rank of several under a launcher: parse_command_line left it here)
    return train_app::finish_early_under_launcher(o, train_app::LaunchMode::print_config, [&] {
      if (o.launch.rank == 0) std::printf("%s\n", trainer::settings_json(o.train).c_str());
      return 0;
    });
  const bool processes = o.launch.launcher != collectives::Launcher::none;
  if (processes && o.world_size_given && o.world_size != o.launch.world_size)
    return usage("--world-size " + std::to_string(o.world_size) + ": this process is " + o.launch.describe() +
                 ", whose world is " + std::to_string(o.launch.world_size) + " (leave --world-size out under a launcher)");
  const int world = processes ? o.launch.world_size : o.world_size;
  // DeepSpeed's batch sizes, if the config gives any, against each other and --batch.
  const bool config_batch = c.train_batch_size > 0 || c.train_micro_batch_size_per_gpu > 0;
  const auto batch = c.check_batch(world, o.batch_given || !config_batch ? o.batch : 0);
  if (!batch) return usage(batch.error().message());
  o.batch = *batch;
  {
    // Each rank builds the step's global batch of token ids and targets on the host (i32 each):
    // refused up front when that alone cannot fit (it was a std::bad_alloc inside a rank).
    const double memory = static_cast<double>(async::host_memory_bytes());
    const double batch_bytes = static_cast<double>(o.batch) * static_cast<double>(o.seq) * 8.0 * (world + 1);
    if (batch_bytes > memory)
      return usage("--batch " + std::to_string(o.batch) + " x --seq " + std::to_string(o.seq) + ": the host batches need " +
                   std::to_string(static_cast<unsigned long long>(batch_bytes)) + " bytes a step, more than this machine's " +
                   std::to_string(static_cast<unsigned long long>(memory)) + " bytes of memory");
  }
  if (o.model.kind == train_app::ModelChoice::Kind::gpt && o.dim % o.heads != 0)
    return usage("--dim " + std::to_string(o.dim) + " is not a multiple of --heads " + std::to_string(o.heads));
  if ((o.resume || o.checkpoint_every > 0) && o.checkpoint_dir.empty())
    return usage("--resume and --checkpoint-every need --checkpoint-dir");
  if (o.start_over && o.checkpoint_dir.empty()) return usage("--start-over needs --checkpoint-dir");

  // Memory: what every rank will hold, against the machine (before anything is allocated or
  // created: --estimate leaves no folder behind).
  train_app::RunShape shape;
  // The vocabulary: the data's (bytes 256, the synthetic task's --vocab, a token file's --vocab),
  // unless the model fixes it (a Llama preset, or --vocab): then token files are read against it
  // and other data must fit inside it.
  bool bytes = false;
  std::int64_t vocab_of_bytes = 0;  // a --vocab that bytes would replace
  if (!o.data.empty()) {
    const auto read_as_bytes = train_app::data_read_as_bytes(o, o.data_files, "--data");
    if (!read_as_bytes) return usage(read_as_bytes.error().message());
    bytes = *read_as_bytes;
  }
  if (!o.val_data.empty()) {
    if (o.data.empty())
      return usage("--val-data without --data: the synthetic task validates on held-out draws of its own (give "
                   "--eval-every alone)");
    const auto read_as_bytes = train_app::data_read_as_bytes(o, o.val_files, "--val-data");
    if (!read_as_bytes) return usage(read_as_bytes.error().message());
    const bool val_bytes = *read_as_bytes;
    if (val_bytes != bytes)
      return usage("--val-data " + o.val_data + " is read as " + (val_bytes ? "bytes" : "token ids") + " and --data " +
                   o.data + " as " + (bytes ? "bytes" : "token ids") +
                   ": validation needs data of the training data's kind (--data-format applies to both)");
  }
  if (o.model.vocab_fixed) {
    if (!o.data.empty() && !bytes) o.vocab = o.model.vocab();
    else if (bytes) o.vocab = 256;
    if (o.vocab > o.model.vocab())
      return usage((bytes ? std::string("--data as bytes (vocabulary 256)") : "--vocab " + std::to_string(o.vocab)) +
                   ": more tokens than the model's vocabulary of " + std::to_string(o.model.vocab()));
  } else {
    if (bytes && o.vocab_given && o.vocab != 256) vocab_of_bytes = o.vocab;  // refused once the paths are checked
    if (bytes) o.vocab = 256;
    o.model.set_vocab(o.vocab);
  }
  // A prompt the model can embed (checked now, not after the training it follows).
  for (std::size_t i = 0; i < o.prompt.size(); ++i)
    if (o.prompt[i] >= o.model.vocab())
      return usage(std::string(o.prompt_is_text ? "--prompt: token " : "--prompt-ids: token ") + std::to_string(i) +
                   " is " + (o.prompt_is_text ? "byte " : "id ") + std::to_string(o.prompt[i]) +
                   ", not below the model's vocabulary of " + std::to_string(o.model.vocab()) +
                   (o.prompt_is_text ? " (--prompt is for models of text read as bytes; --prompt-ids gives ids)" : ""));
  // A GPT's learned positions bound a sample: its prompt (4 tokens of the data by default) and
  // the tokens it adds.
  if (o.sampling && o.model.kind == train_app::ModelChoice::Kind::gpt) {
    const auto prompt = o.prompt.empty() ? std::min<std::int64_t>(4, o.seq) : static_cast<std::int64_t>(o.prompt.size());
    if (prompt + o.sample.tokens > o.model.gpt.max_seq)
      return usage("a sample of " + std::to_string(prompt) + " prompt tokens and --sample-tokens " +
                   std::to_string(o.sample.tokens) + " needs " + std::to_string(prompt + o.sample.tokens) +
                   " positions, and the GPT has " + std::to_string(o.model.gpt.max_seq) +
                   " (--seq): a shorter prompt, fewer --sample-tokens, or a longer --seq");
  }
  shape.model = o.model;
  shape.batch = o.batch;
  shape.seq = o.seq;
  shape.world = world;
  // Ranks sharing this machine's memory: its processes on the CPU (one GPU each otherwise).
  shape.ranks_here = processes ? (o.device == "cuda" ? 1 : o.launch.local_size) : o.world_size;
  shape.device = o.device == "cuda" ? async::Device::cuda(processes ? o.launch.local_rank : 0) : async::Device::cpu();
  shape.checkpoints = !o.checkpoint_dir.empty();
  shape.export_model = !o.export_path.empty();
  auto memory = train_app::estimate_run(c, shape);
  if (!memory) return usage(memory.error().message());
  // Chosen by memory only in one process: ranks in processes of their own could see different free
  // memory and choose differently (the same kernels on every rank: --attention).
  if (!o.attention_given && o.launch.launcher == collectives::Launcher::none) {
    auto choice = train_app::choose_attention(c, shape, std::move(*memory));
    if (!choice) return usage(choice.error().message());
    o.attention_chosen = choice->kernels != c.attention;
    o.train.attention = choice->kernels;
    *memory = std::move(choice->memory);
  }
  const auto fits = train_app::check_run(*memory, shape);
  if (o.estimate) {
    auto report = [&] {
      if (o.launch.rank == 0) {
        std::fputs(train_app::describe_run(*memory, shape, c).c_str(), stdout);
        std::puts(fits ? "fits" : ("does not fit: " + fits.error().message()).c_str());
      }
      return fits ? 0 : 1;
    };
    if (train_app::launched_with_others(o))
      return train_app::finish_early_under_launcher(o, train_app::LaunchMode::estimate, report);
    return report();
  }
  if (!fits && c.check_memory) return usage(fits.error().message() + " (coshard-train --estimate shows each item; --skip-memory-check trains anyway)");
  // Every path, before anything is built or trained.
  train_app::RunPaths paths;
  for (const auto& file : o.data_files) paths.inputs.push_back({"--data", file.string()});
  for (const auto& file : o.val_files) paths.inputs.push_back({"--val-data", file.string()});
  if (!o.config.empty()) paths.inputs.push_back({"--config", o.config});
  if (o.init_is_folder) {
    // Named and checked now (the index, each file a regular one); the ranks read them once, at the load.
    auto weights = modules::SafetensorsFolder::files_of(o.init);
    if (!weights) return usage("--init: " + weights.error().message());
    paths.inputs.push_back({"--init", std::filesystem::path(o.init) / zero::kHfConfigName});
    for (const auto& f : *weights) paths.inputs.push_back({"--init", f});
  } else if (!o.init.empty()) {
    paths.inputs.push_back({"--init", o.init});
  }
  if (!o.metrics.empty()) paths.output_files.push_back({"--metrics", o.metrics});
  if (!o.trace.empty()) paths.output_files.push_back({"--trace", o.trace});
  if (o.export_is_folder) paths.output_folders.push_back({"--export", o.export_path});
  else if (!o.export_path.empty()) paths.output_files.push_back({"--export", o.export_path});
  if (!o.checkpoint_dir.empty()) paths.output_folders.push_back({"--checkpoint-dir", o.checkpoint_dir});
  if (!c.tensorboard_dir.empty()) paths.output_folders.push_back({"--tensorboard", c.tensorboard_dir.string()});
  if (!o.flight_recorder.empty()) paths.output_folders.push_back({"--flight-recorder", o.flight_recorder});
  if (c.offload_optimizer.device == trainer::OffloadDevice::nvme)
    paths.output_folders.push_back({"--offload-optimizer nvme", c.offload_optimizer.nvme_path});
  if (c.offload_params.device == trainer::OffloadDevice::nvme && !c.offload_params.nvme_path.empty() &&
      c.offload_params.nvme_path != c.offload_optimizer.nvme_path)
    paths.output_folders.push_back({"--offload-params nvme", c.offload_params.nvme_path});
  if (auto ok = train_app::check_run_paths(paths); !ok) return usage(ok.error().message());
  for (const auto& input : paths.inputs) {
    if (input.role != "--init") continue;
    auto fingerprint = train_app::file_fingerprint(input.path);
    if (!fingerprint) return usage("--init: " + fingerprint.error().message());
    o.init_fingerprint += (o.init_fingerprint.empty() ? "" : "; ") + *fingerprint;
  }
  if (vocab_of_bytes != 0)
    return usage("--vocab " + std::to_string(vocab_of_bytes) + " with --data " + o.data +
                 " read as bytes: bytes are a vocabulary of 256 (leave --vocab out, or --data-format u16/u32 for a "
                 "file of token ids)");
  if (!o.flight_recorder.empty()) collectives::set_flight_recorder_dir(o.flight_recorder);
  // Rank 0 claims the checkpoint folder for the whole run before it removes or reads anything
  // there: a second run on the same folder (--start-over, or a second --resume) is refused by
  // name while this one lives, instead of removing its checkpoints under it.
  async::FolderLock checkpoint_lock;
  if (!o.checkpoint_dir.empty() && o.launch.rank == 0) {
    auto claimed = async::FolderLock::claim(o.checkpoint_dir, "--checkpoint-dir", "coshard-train rank 0",
                                            async::FolderLock::Sharing::process);
    if (!claimed) return usage(claimed.error().message());
    checkpoint_lock = std::move(*claimed);
  }
  if (!o.checkpoint_dir.empty()) {
    if (auto ok = train_app::prepare_checkpoint_folder(o.checkpoint_dir, o.resume, o.start_over, o.launch.rank == 0); !ok)
      return usage(ok.error().message());
  }
  // SIGINT/SIGTERM/SIGHUP: the first finishes the step, saves, and exits; the second stops at once.
  struct sigaction action{};
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;  // system calls of the other threads go on
  sigemptyset(&action.sa_mask);
  g_stop_timeout_s.store(static_cast<unsigned>(o.stop_timeout_s));
  struct sigaction alarm_action{};
  alarm_action.sa_handler = on_stop_timeout;
  sigemptyset(&alarm_action.sa_mask);
  sigaction(SIGALRM, &alarm_action, nullptr);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction before{};
    sigaction(sig, nullptr, &before);
    if (before.sa_handler != SIG_IGN) sigaction(sig, &action, nullptr);  // ignored on purpose (nohup): stays so
  }
  if (o.flight_recorder.empty()) {  // (with a recorder, its FlightDumps answers SIGUSR1)
    struct sigaction usr1{};
    usr1.sa_handler = on_sigusr1_without_recorder;
    usr1.sa_flags = SA_RESTART;
    sigemptyset(&usr1.sa_mask);
    sigaction(SIGUSR1, &usr1, nullptr);
  }
  return run(o);
}

int main(int argc, char** argv) {
  // The best OpenBLAS kernels this CPU runs, chosen before anything starts (OpenBLAS reads its
  // choice when it loads: a restart of this program when it chose weaker ones).
  coshard::modules::choose_blas_kernels_and_restart(argv);
  int code = 0;
  try {
    code = run_main(argc, argv);
  } catch (const std::bad_alloc&) {
    // Reading the command line needs a little memory: under an address-space limit the libraries
    // may leave none (the ranks' own failures are reported inside run). Said without allocating.
    std::fputs("coshard-train: out of host memory before the run could start (an address-space limit, ulimit -v, "
               "leaves too little beside the libraries)\n",
               stderr);
    code = 1;
  }
  if (code != 0) {
    // OpenBLAS's exit handler joins its worker threads, and a worker that could not get its
    // buffer (the machine out of memory, or an address-space limit) retries forever: a failed run,
    // a refused command line included, would never end. All of ours is destroyed by now; end
    // without the libraries' exit handlers.
    std::fflush(nullptr);
    std::_Exit(code);
  }
  return 0;
}
