#include "rank_run.hpp"

#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>

#include "coshard/collectives/mesh.hpp"
#include "coshard/modules/safetensors_folder.hpp"
#include "coshard/trainer/trainer.hpp"
#include "coshard/zero/hf_llama.hpp"
#include "coshard/zero/peft.hpp"
#include "flight_dumps.hpp"
#include "progress.hpp"
#include "run_report.hpp"
#include "samples.hpp"
#include "stop_signals.hpp"

namespace coshard::train_app {

using trainer::HostBatch;

namespace {

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

// Tensor parallelism: a data x tensor mesh, the model this rank's part of it, the data split
// over the data ranks (a tensor group reads the same rows). None without --tensor-parallel.
Result<std::optional<collectives::Mesh>> make_mesh(const Options& o, collectives::Communicator& comm, bool threads) {
  // Ranks as processes: the same --tensor-parallel on every rank before the mesh's splits (a rank
  // of another size makes other splits or none, and the job waited out the collective timeout).
  // One split by it is the exchange: a rank's group is the world only when every rank agrees.
  if (!threads && comm.size() > 1) {
    auto same = comm.split(o.train.tensor_parallel_size, comm.rank());
    if (!same) return fail(std::move(same).error().with_context("agreeing on --tensor-parallel"));
    if (!*same || (*same)->size() != comm.size())
      return fail(ErrorCode::invalid_argument, "--tensor-parallel: rank ", comm.rank(), " gives ",
                  o.train.tensor_parallel_size, ", and only ", *same ? (*same)->size() : 0, " of the ", comm.size(),
                  " ranks give the same (every rank of a run must give the same --tensor-parallel)");
  }
  if (!threads && comm.size() > 1) {  // (--expert-parallel alike)
    auto same = comm.split(o.train.expert_parallel_size, comm.rank());
    if (!same) return fail(std::move(same).error().with_context("agreeing on --expert-parallel"));
    if (!*same || (*same)->size() != comm.size())
      return fail(ErrorCode::invalid_argument, "--expert-parallel: rank ", comm.rank(), " gives ",
                  o.train.expert_parallel_size, ", and only ", *same ? (*same)->size() : 0, " of the ", comm.size(),
                  " ranks give the same (every rank of a run must give the same --expert-parallel)");
  }
  if (o.train.tensor_parallel_size <= 1 && o.train.expert_parallel_size <= 1) return std::nullopt;
  COSHARD_TRY_ASSIGN(const int shard, o.train.shard_group_size_for(comm.size() / o.train.tensor_parallel_size));
  auto made = collectives::Mesh::create(
      comm, {.tensor = o.train.tensor_parallel_size, .shard = shard, .expert = o.train.expert_parallel_size});
  if (!made)
    return fail(std::move(made).error().with_context(o.train.tensor_parallel_size > 1 ? "--tensor-parallel"
                                                                                       : "--expert-parallel"));
  return std::move(*made);
}

// What defines this run beyond the parameters' shapes, and what every rank must do alike, for
// the builder to check (at a resume, and across the ranks).
void describe_run(trainer::TrainerBuilder& builder, const Options& o, const trainer::TokenSource& data,
                  const trainer::TokenSource* val) {
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
  // A LoRA checkpoint leaves the base out: a resume must start from the same base weights (the
  // seed's, in the identity already, or --init's files by their checksums).
  if (o.train.lora_rank > 0) builder.run_identity("LoRA base", o.init.empty() ? "the seed's" : o.init_fingerprint);
  if (val) builder.validation(*val, o.train.eval_every, o.train.eval_batches);
}

// The weights to start from: --init's, then --adapter's adapters, then --resume's checkpoint.
async::Task<Result<void>> load_weights(const Options& o, trainer::Trainer& t, modules::Module& model) {
  if (o.init_is_folder) {
    COSHARD_CO_TRY(co_await zero::load_hf_llama(t.engine(), o.init, o.model.llama));
  } else if (!o.init.empty()) {
    COSHARD_CO_TRY(co_await t.load_safetensors(o.init));
  }
  const bool llama = o.model.kind == ModelChoice::Kind::llama;
  if (!o.adapter.empty()) {
    const std::filesystem::path adapter = o.adapter;  // (named: no temporaries in co_await, GCC 12)
    COSHARD_CO_TRY(co_await zero::load_peft_adapter(t.engine(), model, adapter, llama));
  }
  if (o.resume) {
    auto loaded = co_await t.load_checkpoint(o.checkpoint_dir);
    if (!loaded) co_return fail(std::move(loaded).error().with_context("--resume"));
  }
  co_return Result<void>{};
}

// What the steps of one rank share: its run's inputs, and its place among the data ranks.
struct RankRun {
  const Options& o;
  collectives::Communicator& comm;
  const trainer::TokenSource& data;
  const trainer::TokenSource* val;
  Shared& shared;
  bool threads;  // the ranks are threads of this process (else each a process)
  bool lead;     // rank 0: it prints, and writes --metrics and --trace
  int rank, world;  // among the data ranks (a tensor group reads the same rows)
};

// What the steps leave for the end of the run.
struct StepsDone {
  std::int64_t saved_at = 0;  // the last step checkpointed (or the first step)
  // The first step of the current run of steps whose loss was not finite (0: the last one's was).
  std::int64_t nonfinite_since = 0;
  double last_loss = 0;
};

// Ranks as threads agree on the step to stop at through memory (Shared::stop_at): whether they
// stop before `step`.
bool threads_stop_before(Shared& shared, std::int64_t step) {
  if (stop_signal() != 0) {
    std::int64_t unset = std::numeric_limits<std::int64_t>::max();
    shared.stop_at.compare_exchange_strong(unset, step + 1);
  }
  return step >= shared.stop_at.load();
}

// A step's record: its spans for --trace, and on rank 0 the progress line and the --metrics line.
Result<void> record_step(const RankRun& run, const trainer::StepStats& stats, trainer::Progress& progress,
                         std::ofstream& metrics) {
  if (!run.o.trace.empty()) run.shared.trace.add(run.comm.rank(), stats.step, stats.timeline);
  if (run.lead) {
    if (!run.o.quiet) progress.update(stats);
    if (metrics.is_open()) {
      metrics << trainer::to_json_line(stats) << '\n';
      metrics.flush();
      if (!metrics) return fail(ErrorCode::io, "--metrics ", run.o.metrics, ": write failed");
    }
  }
  return Result<void>{};
}

// The steps from `first` to --steps, or to the step a stop signal ends them at, with their
// samples and checkpoints.
async::Task<Result<StepsDone>> train_steps(const RankRun& run, trainer::Trainer& t, trainer::Progress& progress,
                                           std::ofstream& metrics, std::int64_t first) {
  const Options& o = run.o;
  StepsDone done{.saved_at = first};
  for (std::int64_t step = first; step < o.steps; ++step) {
    if (run.threads) {
      if (threads_stop_before(run.shared, step)) break;
    } else {
      COSHARD_CO_TRY_ASSIGN(const bool stopping, co_await any_rank_stopping(t, run.comm, stop_signal() != 0));
      if (stopping) break;
    }
    const HostBatch global = run.data.batch(static_cast<std::uint64_t>(step), o.batch, o.seq);
    if (run.val && step + 1 == o.steps) t.request_validation();  // (the last step: evaluated whatever --eval-every says)
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(global.rank_rows(run.rank, run.world)));
    if (!std::isfinite(stats.loss)) {
      if (done.nonfinite_since == 0) done.nonfinite_since = stats.step;
    } else {
      done.nonfinite_since = 0;
    }
    done.last_loss = stats.loss;
    COSHARD_CO_TRY(record_step(run, stats, progress, metrics));
    if (o.sample_every > 0 && stats.step % o.sample_every == 0 && stats.step < o.steps) {
      if (run.lead && !o.quiet) progress.finish();
      COSHARD_CO_TRY(co_await train_app::sample_after(t, o, run.data, stats.step, o.quiet));
    }
    if (o.checkpoint_every > 0 && stats.step % o.checkpoint_every == 0) {
      COSHARD_CO_TRY(co_await t.save_checkpoint(o.checkpoint_dir));
      done.saved_at = stats.step;
    }
  }
  co_return done;
}

// The end of the steps on every rank: a stopped run's steps saved, the pending save published,
// the ranks met, and rank 0's last progress line and --trace written.
async::Task<Result<void>> end_steps(const RankRun& run, trainer::Trainer& t, trainer::Progress& progress, bool stopped,
                                    std::int64_t saved_at) {
  const Options& o = run.o;
  // Stopped by a signal: the steps since the last checkpoint are saved (when there is a folder
  // for them), and the pending save is published before the exit.
  if (stopped && !o.checkpoint_dir.empty() && t.steps_done() > saved_at)
    COSHARD_CO_TRY(co_await t.save_checkpoint(o.checkpoint_dir));
  COSHARD_CO_TRY(co_await t.finish_checkpoint());
  if (stopped) run.shared.stopped_after = t.steps_done();
  // No rank tears down (a counted stream synchronize) before rank 0 has reported its last step.
  COSHARD_CO_TRY_ASSIGN(auto all_done, run.comm.barrier());
  COSHARD_CO_TRY(co_await all_done);
  if (run.lead && !o.quiet) progress.finish();
  if (run.lead && !o.trace.empty()) {
    // Local ranks: every rank added its spans before the barrier. Processes: this rank's own.
    COSHARD_CO_TRY(run.shared.trace.write(o.trace));
    if (!o.quiet) std::printf("trace: %zu spans in %s\n", run.shared.trace.size(), o.trace.c_str());
  }
  co_return Result<void>{};
}

// The trained model (--export) and its adapters (--export-adapter), at the end of a run that
// trained to the end.
async::Task<Result<void>> export_results(const RankRun& run, trainer::Trainer& t, modules::Module& model) {
  const Options& o = run.o;
  if (!o.export_path.empty()) {
    if (o.export_is_folder) {
      modules::SafetensorsFolderOptions shards;  // named: GCC 12 mishandles default arguments in co_await
      // (with LoRA, the adapters folded into the base: the fine-tuned model as transformers reads it)
      if (o.train.lora_rank > 0)
        COSHARD_CO_TRY(co_await zero::export_hf_llama(t.engine(), o.export_path, o.model.llama, std::move(shards), model));
      else
        COSHARD_CO_TRY(co_await zero::export_hf_llama(t.engine(), o.export_path, o.model.llama, std::move(shards)));
    } else {
      COSHARD_CO_TRY(co_await t.export_safetensors(o.export_path));
    }
    if (run.lead && !o.quiet) std::printf("exported %s\n", o.export_path.c_str());
  }
  if (!o.export_adapter.empty()) {
    const bool llama = o.model.kind == ModelChoice::Kind::llama;
    // (named: GCC 12 destroys a class-type temporary argument of a coroutine in co_await twice)
    std::string base = o.init_is_folder ? o.init : std::string();  // (a Hugging Face base's folder, else none)
    const std::filesystem::path folder = o.export_adapter;
    COSHARD_CO_TRY(co_await zero::export_peft_adapter(t.engine(), model, folder, llama, std::move(base)));
    if (run.lead && !o.quiet) std::printf("exported the adapters to %s\n", o.export_adapter.c_str());
  }
  co_return Result<void>{};
}

// The sample after the last step (--steps 0: the only one, always shown), once everything is
// saved and exported on every rank: a stop signal during it has nothing left to lose, and ends
// the process at once.
async::Task<Result<void>> sample_at_end(const RankRun& run, trainer::Trainer& t) {
  COSHARD_CO_TRY_ASSIGN(auto exported, run.comm.barrier());
  COSHARD_CO_TRY(co_await exported);
  nothing_left_to_lose();
  if (stop_signal() != 0) co_return Result<void>{};  // (it came before: no sample)
  COSHARD_CO_TRY(co_await train_app::sample_after(t, run.o, run.data, t.steps_done(), run.o.quiet && run.o.steps > 0));
  co_return Result<void>{};
}

}  // namespace

async::Task<Result<void>> run_rank(const Options& o, collectives::Communicator& comm, const trainer::TokenSource& data,
                                   const trainer::TokenSource* val, Shared& shared, bool threads) {
  const bool lead = comm.rank() == 0;
  COSHARD_CO_TRY_ASSIGN(std::optional<collectives::Mesh> mesh, make_mesh(o, comm, threads));
  // SIGUSR1 dumps the mesh's groups beside the world (released before the mesh: declared after it).
  std::optional<FlightDumps::Registration> data_dumped, tensor_dumped;
  if (mesh && shared.flight) {
    if (&mesh->data() != &comm) data_dumped.emplace(*shared.flight, mesh->data());
    tensor_dumped.emplace(*shared.flight, mesh->expert_size() > 1 ? mesh->expert() : mesh->tensor());
  }
  const RankRun run{o, comm, data, val, shared, threads, lead, mesh ? mesh->data_rank() : comm.rank(),
                    mesh ? mesh->data_size() : comm.size()};
  COSHARD_CO_TRY_ASSIGN(auto model, !mesh                        ? o.model.build()
                                     : mesh->expert_size() > 1 ? o.model.build_expert_parallel(mesh->expert())
                                                               : o.model.build(mesh->tensor()));
  trainer::TrainerBuilder builder(o.train);
  if (mesh) {
    builder.mesh(*mesh);
  } else {
    builder.communicator(comm);
  }
  describe_run(builder, o, data, val);
  COSHARD_CO_TRY_ASSIGN(auto t, co_await builder.build(*model));
  // An adapter folder the end could not write is refused before the training it would follow.
  if (!o.export_adapter.empty())
    if (auto writable = zero::peft_config_of(*model, o.model.kind == ModelChoice::Kind::llama, o.init); !writable)
      co_return fail(std::move(writable).error().with_context("--export-adapter " + o.export_adapter));
  if (shared.epoch.recorded()) COSHARD_CO_TRY(t.set_timeline_epoch(shared.epoch));
  COSHARD_CO_TRY(co_await load_weights(o, t, *model));
  const std::int64_t first = t.steps_done();
  // (a job that always passes --adapter and --resume starts from the folder once, then resumes)
  if (first > 0 && !o.adapter.empty() && lead && !o.quiet)
    std::printf("note: --resume continues from the checkpoint's adapters (step %lld), not --adapter %s's\n",
                static_cast<long long>(first), o.adapter.c_str());
  // A resume that has nothing left to train would print "resumed" and exit 0 as if it had.
  if (o.resume && first >= o.steps && o.steps > 0)
    co_return fail(ErrorCode::invalid_argument, "--steps ", o.steps, ": the checkpoint in ", o.checkpoint_dir,
                   " is at step ", first, " already, so there is nothing to train (give --steps above ", first, ")");
  if (lead && !o.quiet) print_run_header(o, t, comm, data, val, first);
  std::ofstream metrics;
  if (lead && !o.metrics.empty()) {
    metrics.open(o.metrics, first > 0 ? std::ios::app : std::ios::trunc);
    if (!metrics) co_return fail(ErrorCode::io, "--metrics ", o.metrics, ": cannot open for writing");
  }
  trainer::Progress progress(first, o.steps, stdout);
  COSHARD_CO_TRY_ASSIGN(const StepsDone steps, co_await train_steps(run, t, progress, metrics, first));
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
  COSHARD_CO_TRY(co_await end_steps(run, t, progress, stopped, steps.saved_at));
  // A run that ends on losses that are not finite learned nothing since they began, even with
  // finite weights (the model's outputs overflow): an error, and nothing exported (the loss is
  // averaged over ranks, so every rank says so).
  if (steps.nonfinite_since > 0)
    co_return fail(ErrorCode::invalid_argument, "the loss has not been finite since step ", steps.nonfinite_since,
                   " (step ", t.steps_done(), ": ", steps.last_loss, "; every such step is skipped): training diverged (a ",
                   "learning rate or weight decay too large, or non-finite data)", o.export_path.empty() ? "" : "; --export skipped");
  if (!stopped) COSHARD_CO_TRY(co_await export_results(run, t, *model));
  if (o.sampling && !stopped) COSHARD_CO_TRY(co_await sample_at_end(run, t));
  co_return Result<void>{};
}

}  // namespace coshard::train_app
