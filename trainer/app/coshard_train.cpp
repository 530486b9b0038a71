// coshard-train: trains the GPT-style model of coshard::modules with the ZeRO engine.
//
//   coshard-train                                  synthetic task, 2 Local ranks, ZeRO-3, CPU
//   coshard-train --data book.txt --steps 2000     a text file as bytes
//   coshard-train --checkpoint-dir ck --checkpoint-every 50 ... ; later: the same with --resume
//
// Ranks: --world-size N runs N ranks as threads of this process (the Local backend: on the CPU,
// or with --device cuda sharing GPU 0), or, with the torchrun variables set (WORLD_SIZE, RANK,
// ...), this process is one rank of many (NCCL on GPUs). --device cuda alone is one rank on NCCL.
// --batch is the global batch per step, split evenly over the ranks; the data of a step depends
// only on (--seed, step), so runs at different world sizes and stages see the same data.
#include <CLI/CLI.hpp>
#include <signal.h>

#include <atomic>
#include <csignal>
#include <limits>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <mutex>
#include <thread>

#include "coshard/async/memory.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/cpu_threads.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/trainer/trace.hpp"
#include "coshard/trainer/trainer.hpp"
#include "progress.hpp"
#include "memory_check.hpp"
#include "run_checks.hpp"

namespace {

using namespace coshard;
using trainer::HostBatch;
using trainer::TrainerConfig;

struct Options {
  std::string device = "cpu";
  int world_size = 2;
  std::int64_t steps = 400;
  std::int64_t batch = 16;
  std::int64_t seq = 64;
  std::int64_t layers = 4;
  std::int64_t dim = 128;
  std::int64_t heads = 4;
  std::int64_t vocab = 256;  // synthetic task only; a --data file is bytes (256)
  std::string data, config, init, metrics, trace, checkpoint_dir, export_path;
  std::int64_t checkpoint_every = 0;
  int keep_checkpoints = 0;
  int blas_threads = 0;  // 0: cores / ranks in this process
  bool resume = false;
  bool start_over = false;
  bool quiet = false;
  bool estimate = false;  // print the memory estimate and exit
  TrainerConfig train;
};

// Rank 0 prints and writes; every rank reports its failure.
// The first SIGINT/SIGTERM asks for a graceful stop (recorded here; lock-free, so safe in a
// handler); a second one stops the process at once, the way the signal would have.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_stop_signal(int sig) {
  if (g_stop_signal.exchange(sig) != 0) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
  }
}

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
                                   Shared& shared, bool threads) {
  const int rank = comm.rank(), world = comm.size();
  const bool lead = rank == 0;
  modules::GptConfig g;
  g.vocab = data.vocab();
  g.max_seq = o.seq;
  g.dim = o.dim;
  g.layers = o.layers;
  g.heads = o.heads;
  COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(g));
  trainer::TrainerBuilder builder(o.train);
  builder.communicator(comm);
  // What defines this run beyond the parameters' shapes: a resume with another shape of attention
  // (--heads) or other data is refused.
  builder.run_identity("model", "gpt layers " + std::to_string(o.layers) + " dim " + std::to_string(o.dim) + " heads " +
                                    std::to_string(o.heads) + " seq " + std::to_string(o.seq));
  builder.run_identity("data", data.identity());
  COSHARD_CO_TRY_ASSIGN(auto t, co_await builder.build(*model));
  if (shared.epoch.recorded()) COSHARD_CO_TRY(t.set_timeline_epoch(shared.epoch));
  if (!o.init.empty()) COSHARD_CO_TRY(co_await t.load_safetensors(o.init));
  if (o.resume) {
    auto loaded = co_await t.load_checkpoint(o.checkpoint_dir);
    if (!loaded) co_return fail(std::move(loaded).error().with_context("--resume"));
  }
  const std::int64_t first = t.steps_done();
  if (lead && !o.quiet) {
    std::printf("coshard-train: %lld-parameter GPT (%lld layers, dim %lld, %lld heads), %s\n",
                static_cast<long long>(g.parameter_count()), static_cast<long long>(g.layers),
                static_cast<long long>(g.dim), static_cast<long long>(g.heads), data.describe().c_str());
    std::printf("  ZeRO-%d, %d rank(s) on %s, global batch %lld x %lld tokens, %zu fetch units%s\n",
                o.train.zero_stage, world, o.device.c_str(), static_cast<long long>(o.batch),
                static_cast<long long>(o.seq), t.engine().units().size(),
                first > 0 ? (", resumed at step " + std::to_string(first)).c_str() : "");
    std::fflush(stdout);
  }
  std::ofstream metrics;
  if (lead && !o.metrics.empty()) {
    metrics.open(o.metrics, first > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics) co_return fail(ErrorCode::io, "--metrics ", o.metrics, ": cannot open for writing");
  }
  trainer::Progress progress(first, o.steps, stdout);
  std::int64_t saved_at = first;
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
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(global.rank_rows(rank, world)));
    if (!o.trace.empty()) shared.trace.add(rank, stats.step, stats.timeline);
    if (lead) {
      if (!o.quiet) progress.update(stats);
      if (metrics.is_open()) {
        metrics << trainer::to_json_line(stats) << '\n';
        metrics.flush();
        if (!metrics) co_return fail(ErrorCode::io, "--metrics ", o.metrics, ": write failed");
      }
    }
    if (o.checkpoint_every > 0 && stats.step % o.checkpoint_every == 0) {
      COSHARD_CO_TRY(co_await t.save_checkpoint(o.checkpoint_dir));
      saved_at = stats.step;
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
  if (!o.export_path.empty() && !stopped) {
    COSHARD_CO_TRY(co_await t.export_safetensors(o.export_path));
    if (lead && !o.quiet) std::printf("exported %s\n", o.export_path.c_str());
  }
  co_return Result<void>{};
}

int run(const Options& o) {
  std::unique_ptr<trainer::TokenSource> data;
  if (o.data.empty()) {
    data = std::make_unique<trainer::SyntheticTask>(o.vocab, o.train.seed);
  } else {
    auto corpus = trainer::ByteCorpus::open(o.data, o.train.seed);
    if (!corpus) {
      std::fprintf(stderr, "coshard-train: %s\n", corpus.error().message().c_str());
      return 2;
    }
    if (auto ok = (*corpus)->check(o.seq); !ok) {
      std::fprintf(stderr, "coshard-train: %s\n", ok.error().message().c_str());
      return 2;
    }
    data = std::move(*corpus);
  }

  Shared shared;
  const bool torchrun = std::getenv("WORLD_SIZE") != nullptr;
  // Ranks as threads share the cores: each gets its share of BLAS threads, not all of them.
  modules::set_cpu_math_threads(o.blas_threads > 0 ? o.blas_threads
                                                   : modules::default_cpu_math_threads(torchrun ? 1 : o.world_size));
  if (torchrun || (o.device == "cuda" && o.world_size == 1)) {
    // One process per rank: NCCL on a GPU, or Local for a single CPU rank.
    async::Runtime rt;
    collectives::FromEnvOptions env;
    env.force_cpu = o.device == "cpu";
    auto comm = collectives::communicator_from_env(rt, env);
    if (!comm) {
      std::fprintf(stderr, "coshard-train: %s\n", comm.error().message().c_str());
      return 2;
    }
    if (!(*comm)->stream().device().is_cuda() && o.device == "cuda") {
      std::fprintf(stderr, "coshard-train: --device cuda: no CUDA device or no NCCL in this build\n");
      return 2;
    }
    auto done = rt.block_on(run_rank(o, **comm, *data, shared, false));
    if (!done) {
      shared.error((*comm)->rank(), done.error().message());
      (*comm)->abort(done.error().message());
    }
  } else {
    // Ranks as threads: on the CPU, or sharing GPU 0 (the Local backend on device memory).
    const async::Device device = o.device == "cuda" ? async::Device::cuda(0) : async::Device::cpu();
    auto comms = collectives::make_local_communicators(o.world_size, {.device = device});
    if (!comms) {
      std::fprintf(stderr, "coshard-train: %s\n", comms.error().message().c_str());
      return 2;
    }
    // One epoch for every rank's timeline (CPU streams share steady_clock; the streams of one
    // GPU share its clock). Never waited for: it passes at once, long before any timing is read.
    auto clock = async::Stream::create(device, {.name = "clock"});
    if (clock) {
      if (auto epoch = clock->record_timed()) shared.epoch = *epoch;
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
            async::Runtime rt;
            auto done = rt.block_on(run_rank(o, *(*comms)[static_cast<std::size_t>(r)], *data, shared, true));
            if (!done) rank_failed(r, done.error().message());
          } catch (const std::exception& e) {  // the runtime's own thread could not start, say
            rank_failed(r, std::string("cannot run: ") + e.what());
          }
        });
      } catch (const std::exception& e) {
        rank_failed(r, std::string("cannot start its thread: ") + e.what());
      }
    }
    for (auto& t : threads) t.join();
  }
  if (!shared.errors.empty()) {
    std::fflush(stdout);
    for (const auto& e : shared.errors) std::fprintf(stderr, "coshard-train: %s\n", e.c_str());
    return 1;
  }
  if (const int sig = g_stop_signal.load(); sig != 0 && shared.stopped_after >= 0) {
    std::fflush(stdout);
    std::fprintf(stderr, "coshard-train: stopped by %s after step %lld%s%s\n", sig == SIGINT ? "SIGINT" : "SIGTERM",
                 static_cast<long long>(shared.stopped_after.load()),
                 o.checkpoint_dir.empty() ? " (no --checkpoint-dir: nothing saved)" : "; its checkpoint is published",
                 o.export_path.empty() ? "" : "; --export skipped (training did not finish)");
    return 128 + sig;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  CLI::App app{"coshard-train: trains a GPT-style model with ZeRO stages 1-3 (coshard)"};
  app.option_defaults()->always_capture_default();
  auto size_option = [&](const std::string& name, std::size_t& target, const std::string& help) {
    return app.add_option_function<std::string>(
        name,
        [&target, name](const std::string& text) {
          auto v = trainer::parse_size(text);
          if (!v) throw CLI::ValidationError(name, v.error().message());
          target = *v;
        },
        help);
  };
  auto offload_option = [&](const std::string& name, trainer::OffloadOptions& target, const std::string& help) {
    return app.add_option_function<std::string>(
        name,
        [&target, name](const std::string& text) {
          auto v = trainer::parse_offload(text);
          if (!v) throw CLI::ValidationError(name, v.error().message());
          target = *v;
        },
        help);
  };
  TrainerConfig cli;  // the command line's ZeRO and optimizer values, applied over --config
  std::string fetch_mode = "all_gather";
  std::string dtype = "f32";
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  app.add_option("--world-size", o.world_size, "ranks as threads of this process (Local backend; with --device cuda they share GPU 0)")
      ->check(CLI::Range(1, 64));
  app.add_option("--steps", o.steps, "optimizer steps in total (a resumed run continues to this)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 40));
  auto* batch_option = app.add_option("--batch", o.batch, "global batch (sequences per step, split evenly over the ranks; default 16, or the config's train_batch_size)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 30));
  app.add_option("--seq", o.seq, "tokens per sequence")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  app.add_option("--layers", o.layers, "transformer blocks")->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}));
  app.add_option("--dim", o.dim, "model width")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  app.add_option("--heads", o.heads, "attention heads")->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}));
  app.add_option("--vocab", o.vocab, "vocabulary of the synthetic task")->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 20));
  app.add_option("--data", o.data, "a text file, trained on as bytes (default: the synthetic task)");
  auto* lr = app.add_option("--lr", cli.lr, "learning rate (AdamW)");
  auto* warmup = app.add_option("--warmup", cli.warmup_steps, "linear warm-up steps (from --warmup-min-lr to --lr)");
  auto* warmup_min = app.add_option("--warmup-min-lr", cli.warmup_min_lr, "the learning rate the warm-up starts from");
  std::string lr_decay = "none";
  auto* decay = app.add_option("--lr-decay", lr_decay, "after the warm-up: none, linear or cosine (to --min-lr at --decay-steps)")
                    ->check(CLI::IsMember({"none", "linear", "cosine"}));
  auto* decay_steps = app.add_option("--decay-steps", cli.decay_steps,
                                     "the step the decay reaches --min-lr (default: --steps)");
  auto* min_lr = app.add_option("--min-lr", cli.min_lr, "the learning rate the decay ends at");
  auto* seed = app.add_option("--seed", cli.seed, "seed of the initial weights and of the data");
  auto* stage = app.add_option("--zero-stage", cli.zero_stage, "1, 2 or 3");
  auto* fetch = app.add_option("--fetch-mode", fetch_mode, "stage-3 fetch collective")
                    ->check(CLI::IsMember({"all_gather", "all_reduce"}));
  auto* prefetch = app.add_option_function<std::string>(
      "--prefetch-bucket",
      [&cli](const std::string& text) {
        if (text == "auto") {
          cli.adaptive_prefetch = true;
          cli.prefetch_bucket_bytes = 0;
          return;
        }
        auto v = trainer::parse_size(text);
        if (!v) throw CLI::ValidationError("--prefetch-bucket", v.error().message());
        cli.prefetch_bucket_bytes = *v;
        cli.adaptive_prefetch = false;
      },
      "bytes gathered ahead of use (64MiB), or auto: measured from gather and compute times");
  auto* live = size_option("--max-live", cli.max_live_bytes, "budget of gathered parameter bytes (1GiB)");
  auto* reuse = app.add_option("--max-reuse-distance", cli.max_reuse_distance, "keep a unit needed again within N fetches");
  auto* persist = size_option("--persistence-threshold", cli.persistence_threshold_bytes, "smaller units stay gathered");
  auto* granularity = size_option("--module-granularity", cli.module_granularity_bytes, "coalesce smaller leaf modules");
  auto* accum = app.add_option("--grad-accum", cli.gradient_accumulation_steps, "micro-batches per step on each rank");
  auto* clip = app.add_option("--clip", cli.max_grad_norm, "global gradient-norm clipping (0: off)");
  float weight_decay = modules::AdamWOptions{}.weight_decay;
  auto* wd = app.add_option("--weight-decay", weight_decay,
                            "weight decay (default: the optimizer's own, AdamW 0.01 decoupled, SGD 0)");
  auto* max_skipped = app.add_option("--max-skipped-steps", cli.max_skipped_steps,
                                     "stop after this many steps in a row skipped for inf/NaN gradients (0: never)")
                          ->check(CLI::Range(0, 1 << 30));
  auto* precision = app.add_option("--dtype", dtype, "compute dtype (bf16/f16 on the CPU compute in f32 on copies: slower than f32, for trying a setup)")
                        ->check(CLI::IsMember({"f32", "bf16", "f16"}));
  auto* off_opt = offload_option("--offload-optimizer", cli.offload_optimizer, "none, cpu or nvme:PATH");
  auto* off_par = offload_option("--offload-params", cli.offload_params, "none, cpu or nvme (stage 3, with --offload-optimizer; nvme: its folder)");
  auto* host_budget = size_option("--host-memory-budget", cli.host_memory_budget,
                                  "pinned host memory the offload may use (default: exactly what it needs)");
  app.add_option("--config", o.config, "a DeepSpeed JSON config (its zero_optimization, fp16/bf16, optimizer, ...)")
      ->check(CLI::ExistingFile);
  app.add_option("--init", o.init, "initial weights from a safetensors file")->check(CLI::ExistingFile);
  app.add_option("--metrics", o.metrics, "one JSON object per step (rank 0)");
  app.add_option("--trace", o.trace, "a Chrome-trace/Perfetto JSON timeline of every step, from device timestamps");
  bool no_timing = false;
  app.add_flag("--no-timing", no_timing, "no device-timestamp timing (exposed_comm_ms becomes null)");
  bool step_in_backward = false;
  app.add_flag("--step-in-backward", step_in_backward,
               "with --offload-optimizer cpu or nvme: step each unit on the CPU while backward goes on (needs --clip 0)");
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "folder of sharded checkpoints");
  app.add_option("--checkpoint-every", o.checkpoint_every, "save every N steps (0: never)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
  app.add_flag("--resume", o.resume, "continue from the latest checkpoint in --checkpoint-dir");
  app.add_option("--keep-checkpoints", o.keep_checkpoints, "keep the newest N checkpoints, remove older ones (0: keep all)")
      ->check(CLI::Range(0, 1 << 30));
  app.add_flag("--start-over", o.start_over,
               "a fresh run in a --checkpoint-dir that holds checkpoints: remove them first (without it, refused)")
      ->excludes("--resume");
  app.add_option("--export", o.export_path, "write the consolidated model as safetensors at the end");
  app.add_flag("--quiet", o.quiet, "no progress output");
  bool skip_memory_check = false;
  app.add_flag("--skip-memory-check", skip_memory_check,
               "train even when the memory estimate says this machine cannot hold the run");
  app.add_flag("--estimate", o.estimate,
               "print the memory each rank will hold (device, pinned and pageable host, NVMe) against this machine's, and "
               "exit without training: 0 when it fits, 1 when not (a run that cannot fit is refused up front anyway)");
  app.add_option("--blas-threads", o.blas_threads,
                 "OpenBLAS threads for the CPU matrix products (0: the cores divided by the ranks in this process)")
      ->check(CLI::Range(0, 4096));
  // Every command-line error exits 2 (CLI11's own codes vary with the kind of error); --help 0.
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    (void)app.exit(e);
    return 2;
  }

  // --config first, then every option given on the command line over it.
  TrainerConfig c;
  if (!o.config.empty()) {
    std::vector<std::string> notes;
    auto from = TrainerConfig::from_json_file(o.config, c, &notes);
    if (!from) {
      std::fprintf(stderr, "coshard-train: %s\n", from.error().message().c_str());
      return 2;
    }
    c = *from;
    if (!o.quiet)
      for (const auto& n : notes) std::printf("config note: %s\n", n.c_str());
  }
  if (lr->count()) c.lr = cli.lr;
  if (warmup->count()) {
    c.warmup_steps = cli.warmup_steps;
    c.warmup_shape = trainer::WarmupShape::linear;
  }
  if (warmup_min->count()) c.warmup_min_lr = cli.warmup_min_lr;
  if (decay->count())
    c.decay = lr_decay == "cosine" ? trainer::LrDecay::cosine : lr_decay == "linear" ? trainer::LrDecay::linear : trainer::LrDecay::none;
  if (decay_steps->count()) c.decay_steps = cli.decay_steps;
  else if (c.decay != trainer::LrDecay::none && c.decay_steps == 0) c.decay_steps = o.steps;
  if (min_lr->count()) c.min_lr = cli.min_lr;
  if (seed->count()) c.seed = cli.seed;
  if (stage->count()) c.zero_stage = cli.zero_stage;
  if (fetch->count())
    c.fetch_mode = fetch_mode == "all_reduce" ? modules::FetchMode::all_reduce : modules::FetchMode::all_gather;
  if (prefetch->count()) {
    c.prefetch_bucket_bytes = cli.prefetch_bucket_bytes;
    c.adaptive_prefetch = cli.adaptive_prefetch;
  }
  if (live->count()) c.max_live_bytes = cli.max_live_bytes;
  if (reuse->count()) c.max_reuse_distance = cli.max_reuse_distance;
  if (persist->count()) c.persistence_threshold_bytes = cli.persistence_threshold_bytes;
  if (granularity->count()) c.module_granularity_bytes = cli.module_granularity_bytes;
  if (accum->count()) c.gradient_accumulation_steps = cli.gradient_accumulation_steps;
  if (clip->count()) c.max_grad_norm = cli.max_grad_norm;
  if (wd->count()) c.weight_decay = weight_decay;
  if (max_skipped->count()) c.max_skipped_steps = cli.max_skipped_steps;
  if (precision->count())
    c.set_compute_dtype(dtype == "bf16"  ? modules::DataType::bf16
                        : dtype == "f16" ? modules::DataType::f16
                                         : modules::DataType::f32);
  if (off_opt->count()) c.offload_optimizer = cli.offload_optimizer;
  if (off_par->count()) c.offload_params = cli.offload_params;
  if (host_budget->count()) c.host_memory_budget = cli.host_memory_budget;
  c.timing = !no_timing;
  c.keep_checkpoints = o.keep_checkpoints;
  if (step_in_backward) c.step_in_backward = true;
  c.record_timeline = !o.trace.empty();
  if (skip_memory_check) c.check_memory = false;
  if (auto ok = c.validate(); !ok) {
    std::fprintf(stderr, "coshard-train: %s\n", ok.error().message().c_str());
    return 2;
  }
  o.train = c;

  // Cross-option checks, each naming the values.
  auto usage = [](const std::string& m) {
    std::fprintf(stderr, "coshard-train: %s\n", m.c_str());
    return 2;
  };
  const auto env = collectives::read_torchrun_env();
  if (!env) return usage(env.error().message());
  const bool torchrun = std::getenv("WORLD_SIZE") != nullptr;
  const int world = torchrun ? env->world_size : o.world_size;
  // DeepSpeed's batch sizes, if the config gives any, against each other and --batch.
  const bool config_batch = c.train_batch_size > 0 || c.train_micro_batch_size_per_gpu > 0;
  const auto batch = c.check_batch(world, batch_option->count() || !config_batch ? o.batch : 0);
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
  if (o.dim % o.heads != 0)
    return usage("--dim " + std::to_string(o.dim) + " is not a multiple of --heads " + std::to_string(o.heads));
  if ((o.resume || o.checkpoint_every > 0) && o.checkpoint_dir.empty())
    return usage("--resume and --checkpoint-every need --checkpoint-dir");
  if (o.start_over && o.checkpoint_dir.empty()) return usage("--start-over needs --checkpoint-dir");

  // Memory: what every rank will hold, against the machine (before anything is allocated or
  // created: --estimate leaves no folder behind).
  train_app::RunShape shape;
  shape.gpt = {.vocab = o.data.empty() ? o.vocab : 256, .max_seq = o.seq, .dim = o.dim, .layers = o.layers, .heads = o.heads};
  shape.batch = o.batch;
  shape.seq = o.seq;
  shape.world = world;
  shape.ranks_here = torchrun ? 1 : o.world_size;
  shape.device = o.device == "cuda" ? async::Device::cuda(torchrun ? env->local_rank : 0) : async::Device::cpu();
  shape.checkpoints = !o.checkpoint_dir.empty();
  shape.export_model = !o.export_path.empty();
  auto memory = train_app::estimate_run(c, shape);
  if (!memory) return usage(memory.error().message());
  const auto fits = train_app::check_run(*memory, shape);
  if (o.estimate) {
    if (env->rank == 0) {
      std::fputs(train_app::describe_run(*memory, shape, c).c_str(), stdout);
      std::puts(fits ? "fits" : ("does not fit: " + fits.error().message()).c_str());
    }
    return fits ? 0 : 1;
  }
  if (!fits && c.check_memory) return usage(fits.error().message() + " (coshard-train --estimate shows each item; --skip-memory-check trains anyway)");
  // Every path, before anything is built or trained.
  train_app::RunPaths paths;
  if (!o.data.empty()) paths.inputs.push_back({"--data", o.data});
  if (!o.config.empty()) paths.inputs.push_back({"--config", o.config});
  if (!o.init.empty()) paths.inputs.push_back({"--init", o.init});
  if (!o.metrics.empty()) paths.output_files.push_back({"--metrics", o.metrics});
  if (!o.trace.empty()) paths.output_files.push_back({"--trace", o.trace});
  if (!o.export_path.empty()) paths.output_files.push_back({"--export", o.export_path});
  if (!o.checkpoint_dir.empty()) paths.output_folders.push_back({"--checkpoint-dir", o.checkpoint_dir});
  if (c.offload_optimizer.device == trainer::OffloadDevice::nvme)
    paths.output_folders.push_back({"--offload-optimizer nvme", c.offload_optimizer.nvme_path});
  if (c.offload_params.device == trainer::OffloadDevice::nvme && !c.offload_params.nvme_path.empty() &&
      c.offload_params.nvme_path != c.offload_optimizer.nvme_path)
    paths.output_folders.push_back({"--offload-params nvme", c.offload_params.nvme_path});
  if (auto ok = train_app::check_run_paths(paths); !ok) return usage(ok.error().message());
  if (!o.checkpoint_dir.empty()) {
    if (auto ok = train_app::prepare_checkpoint_folder(o.checkpoint_dir, o.resume, o.start_over, env->rank == 0); !ok)
      return usage(ok.error().message());
  }
  // SIGINT/SIGTERM: the first finishes the step, saves, and exits; the second stops at once.
  struct sigaction action{};
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;  // system calls of the other threads go on
  sigemptyset(&action.sa_mask);
  for (const int sig : {SIGINT, SIGTERM}) {
    struct sigaction before{};
    sigaction(sig, nullptr, &before);
    if (before.sa_handler != SIG_IGN) sigaction(sig, &action, nullptr);  // ignored on purpose (nohup): stays so
  }
  return run(o);
}
