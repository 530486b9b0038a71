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
//
// This file reads the command line and checks the run before anything is built (the command
// line: command_line.cpp; the checks' helpers: run_checks.cpp, memory_check.cpp); the ranks start
// in run_ranks.cpp, each runs rank_run.cpp.
#include <cstdio>
#include <cstdlib>
#include <new>
#include <optional>
#include <string>

#include "coshard/async/folder_lock.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/collectives/env.hpp"
#include "coshard/collectives/flight_recorder.hpp"
#include "coshard/modules/cpu_blas_kernels.hpp"
#include "coshard/modules/cpu_half_products.hpp"
#include "coshard/modules/safetensors_folder.hpp"
#include "coshard/trainer/settings.hpp"
#include "coshard/zero/hf_llama.hpp"
#include "coshard/zero/peft.hpp"
#include "command_line.hpp"
#include "launch_mode.hpp"
#include "memory_check.hpp"
#include "run_checks.hpp"
#include "run_data.hpp"
#include "run_ranks.hpp"
#include "stop_signals.hpp"

namespace {

using namespace coshard;
using train_app::Options;
using trainer::TrainerConfig;

// A refusal of the run as asked, naming the values: exit status 2.
int usage(const std::string& m) {
  std::fprintf(stderr, "coshard-train: %s\n", m.c_str());
  return 2;
}

// Cross-option checks: the launcher's world, the batch sizes, the model's heads, the checkpoint folder.
std::optional<int> check_options_together(Options& o, bool processes, int world) {
  const TrainerConfig& c = o.train;
  if (processes && o.world_size_given && o.world_size != o.launch.world_size)
    return usage("--world-size " + std::to_string(o.world_size) + ": this process is " + o.launch.describe() +
                 ", whose world is " + std::to_string(o.launch.world_size) + " (leave --world-size out under a launcher)");
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
  if (c.expert_parallel_size > 1) {
    const int data = world / std::max(1, c.tensor_parallel_size);
    if (data % c.expert_parallel_size != 0)
      return usage("--expert-parallel " + std::to_string(c.expert_parallel_size) + " does not divide the " +
                   std::to_string(data) + " data-parallel ranks (expected a divisor of " + std::to_string(data) + ")");
    if (o.model.kind != train_app::ModelChoice::Kind::llama || !o.model.llama.moe.enabled())
      return usage("--expert-parallel " + std::to_string(c.expert_parallel_size) +
                   ": the model has no experts (expected a mixture of experts: --experts, a Mixtral or Qwen3-MoE "
                   "preset or folder; or --expert-parallel 1)");
    if (auto fits = modules::check_expert_parallel(o.model.llama, c.expert_parallel_size); !fits)
      return usage(fits.error().message());
  }
  return std::nullopt;
}

// The vocabulary: the data's (bytes 256, the synthetic task's --vocab, a token file's --vocab),
// unless the model fixes it (a Llama preset, or --vocab): then token files are read against it
// and other data must fit inside it. `vocab_of_bytes`: a --vocab that bytes would replace.
std::optional<int> settle_vocabulary(Options& o, std::int64_t& vocab_of_bytes) {
  bool bytes = false;
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
    // The synthetic task within a smaller vocabulary than its default 256 (a folder's of 32, say).
    else if (!o.vocab_given) o.vocab = std::min(o.vocab, o.model.vocab());
    if (o.vocab > o.model.vocab())
      return usage((bytes ? std::string("--data as bytes (vocabulary 256)") : "--vocab " + std::to_string(o.vocab)) +
                   ": more tokens than the model's vocabulary of " + std::to_string(o.model.vocab()));
  } else {
    if (bytes && o.vocab_given && o.vocab != 256) vocab_of_bytes = o.vocab;  // refused once the paths are checked
    if (bytes) o.vocab = 256;
    o.model.set_vocab(o.vocab);
  }
  return std::nullopt;
}

// A prompt the model can embed, and a sample the model has positions for (checked now, not
// after the training it follows).
std::optional<int> check_sample_fits(const Options& o) {
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
  return std::nullopt;
}

// Memory: what every rank will hold, against the machine (before anything is allocated or
// created: --estimate leaves no folder behind). An exit status for --estimate's report too.
std::optional<int> check_memory(Options& o, bool processes, int world) {
  const TrainerConfig& c = o.train;
  train_app::RunShape shape;
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
  return std::nullopt;
}

// The files the run reads.
std::optional<int> add_input_paths(const Options& o, train_app::RunPaths& paths) {
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
  if (!o.adapter.empty())  // (the files it reads: an output onto or around them would overwrite them)
    for (const std::string_view name : {zero::kPeftConfigName, zero::kPeftWeightsName})
      paths.inputs.push_back({"--adapter", std::filesystem::path(o.adapter) / name});
  return std::nullopt;
}

// The files and folders the run writes.
void add_output_paths(const Options& o, train_app::RunPaths& paths) {
  const TrainerConfig& c = o.train;
  if (!o.metrics.empty()) paths.output_files.push_back({"--metrics", o.metrics});
  if (!o.trace.empty()) paths.output_files.push_back({"--trace", o.trace});
  if (o.export_is_folder) paths.output_folders.push_back({"--export", o.export_path});
  else if (!o.export_path.empty()) paths.output_files.push_back({"--export", o.export_path});
  if (!o.export_adapter.empty()) paths.output_folders.push_back({"--export-adapter", o.export_adapter});
  if (!o.checkpoint_dir.empty()) paths.output_folders.push_back({"--checkpoint-dir", o.checkpoint_dir});
  if (!c.tensorboard_dir.empty()) paths.output_folders.push_back({"--tensorboard", c.tensorboard_dir.string()});
  if (!o.flight_recorder.empty()) paths.output_folders.push_back({"--flight-recorder", o.flight_recorder});
  if (c.offload_optimizer.device == trainer::OffloadDevice::nvme)
    paths.output_folders.push_back({"--offload-optimizer nvme", c.offload_optimizer.nvme_path});
  if (c.offload_params.device == trainer::OffloadDevice::nvme && !c.offload_params.nvme_path.empty() &&
      c.offload_params.nvme_path != c.offload_optimizer.nvme_path)
    paths.output_folders.push_back({"--offload-params nvme", c.offload_params.nvme_path});
}

// Every path, before anything is built or trained; --init's files fingerprinted (every rank must
// load the same).
std::optional<int> check_paths(Options& o) {
  train_app::RunPaths paths;
  if (auto done = add_input_paths(o, paths)) return done;
  add_output_paths(o, paths);
  if (auto ok = train_app::check_run_paths(paths); !ok) return usage(ok.error().message());
  for (const auto& input : paths.inputs) {
    if (input.role != "--init") continue;
    auto fingerprint = train_app::file_fingerprint(input.path);
    if (!fingerprint) return usage("--init: " + fingerprint.error().message());
    o.init_fingerprint += (o.init_fingerprint.empty() ? "" : "; ") + *fingerprint;
  }
  return std::nullopt;
}

// Rank 0 claims the checkpoint folder for the whole run (held in `lock`) before it removes or
// reads anything there: a second run on the same folder (--start-over, or a second --resume) is
// refused by name while this one lives, instead of removing its checkpoints under it.
std::optional<int> claim_checkpoint_folder(const Options& o, async::FolderLock& lock) {
  if (o.checkpoint_dir.empty()) return std::nullopt;
  if (o.launch.rank == 0) {
    auto claimed = async::FolderLock::claim(o.checkpoint_dir, "--checkpoint-dir", "coshard-train rank 0",
                                            async::FolderLock::Sharing::process);
    if (!claimed) return usage(claimed.error().message());
    lock = std::move(*claimed);
  }
  if (auto ok = train_app::prepare_checkpoint_folder(o.checkpoint_dir, o.resume, o.start_over, o.launch.rank == 0); !ok)
    return usage(ok.error().message());
  return std::nullopt;
}

}  // namespace

static int run_main(int argc, char** argv) {
  Options o;
  if (auto done = train_app::parse_command_line(argc, argv, o)) return *done;
  const auto launch = collectives::read_launch_env();
  if (!launch) return usage(launch.error().message());
  o.launch = *launch;
  if (o.print_config)  // (one rank of several under a launcher: parse_command_line left it here)
    return train_app::finish_early_under_launcher(o, train_app::LaunchMode::print_config, [&] {
      if (o.launch.rank == 0) std::printf("%s\n", trainer::settings_json(o.train).c_str());
      return 0;
    });
  const bool processes = o.launch.launcher != collectives::Launcher::none;
  const int world = processes ? o.launch.world_size : o.world_size;
  if (auto done = check_options_together(o, processes, world)) return *done;
  // oneDNN's OpenMP threads wait passively between products where a rank multiplies bf16/f16
  // natively on several threads (a restart, once: libgomp reads OMP_WAIT_POLICY when it loads).
  if (o.device == "cpu") {
    const auto products = modules::cpu_half_products();
    // (a COSHARD_CPU_ISA that names no instructions: refused here, before --estimate reports on a
    // run that could not start)
    if (!products) return usage(products.error().message());
    if (train_app::rank_math_threads(o) > 1 && products->native(o.train.engine_options().dtype))
      modules::restart_with_passive_openmp(argv);
  }
  std::int64_t vocab_of_bytes = 0;
  if (auto done = settle_vocabulary(o, vocab_of_bytes)) return *done;
  if (auto done = check_sample_fits(o)) return *done;
  if (auto done = check_memory(o, processes, world)) return *done;
  if (auto done = check_paths(o)) return *done;
  if (vocab_of_bytes != 0)
    return usage("--vocab " + std::to_string(vocab_of_bytes) + " with --data " + o.data +
                 " read as bytes: bytes are a vocabulary of 256 (leave --vocab out, or --data-format u16/u32 for a "
                 "file of token ids)");
  if (!o.flight_recorder.empty()) collectives::set_flight_recorder_dir(o.flight_recorder);
  async::FolderLock checkpoint_lock;  // (held until the run ends)
  if (auto done = claim_checkpoint_folder(o, checkpoint_lock)) return *done;
  train_app::install_stop_handlers(static_cast<unsigned>(o.stop_timeout_s), o.flight_recorder.empty());
  return train_app::run_ranks(o);
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

