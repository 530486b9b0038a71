// coshard-train's command line: every option with its range and help, and a --config file's
// settings with the command line's values over them, validated. Cross-option checks that need
// the environment (the world size, paths, memory) come after, in coshard_train.cpp.
#pragma once

#include <cstdint>
#include <optional>
#include <filesystem>
#include <string>
#include <vector>

#include "coshard/collectives/env.hpp"
#include "coshard/trainer/config.hpp"
#include "coshard/trainer/sampling.hpp"
#include "model_choice.hpp"

namespace coshard::train_app {

struct Options {
  std::string device = "cpu";
  int world_size = 2;
  std::string backend = "auto";     // collectives::parse_backend
  double collective_timeout_s = 0;  // 0: the backend's default
  int stop_timeout_s = 300;         // after the first stop signal, at most this long (0: no bound)
  std::int64_t steps = 400;
  std::int64_t batch = 16;
  std::int64_t seq = 64;
  std::int64_t layers = 4;
  std::int64_t dim = 128;
  std::int64_t heads = 4;
  std::int64_t vocab = 256;  // the synthetic task's, or the model's for token ids; bytes are 256
  bool init_is_folder = false;    // --init names a Hugging Face folder (else a safetensors file)
  std::string init_fingerprint;   // of --init's files (run_checks.hpp): every rank must load the same
  bool export_is_folder = false;  // --export names a folder (else FILE.safetensors)
  ModelChoice model;  // --model, --preset and the shape flags (its vocabulary settled in main)
  std::string data_format = "auto";  // trainer::parse_token_format
  std::string data, config, init, metrics, trace, checkpoint_dir, export_path;
  // LoRA: a Hugging Face PEFT folder of adapters to start from (--adapter; its adapter_config.json
  // gives the rank, alpha and targets when --lora-rank is not given), and one to write at the end
  // (--export-adapter).
  std::string adapter, export_adapter;
  std::string val_data;  // held-out data (--val-data), in --data-format: its first file
  // --data and --val-data as given (paths or globs) and as files, in order (data and val_data
  // name the first, for the kind of data and the messages).
  std::vector<std::string> data_specs, val_specs;
  std::vector<std::filesystem::path> data_files, val_files;
  bool validate = false;  // --val-data, or --eval-every/--eval-batches on the synthetic task
  // Samples (--sample-every, --prompt/--prompt-ids, --sample-tokens, --temperature, --top-k): every
  // sample_every steps and after the last step when sampling is asked for; --steps 0 samples only.
  std::int64_t sample_every = 0;
  bool sampling = false;
  std::vector<std::int32_t> prompt;  // empty: the first tokens of the data's first batch
  bool prompt_is_text = false;       // --prompt (bytes), not --prompt-ids
  trainer::SampleOptions sample;
  std::string flight_recorder;  // folder of the collective flight recorder's dumps
  std::int64_t checkpoint_every = 0;
  int blas_threads = 0;  // 0: cores / ranks in this process
  bool resume = false;
  bool start_over = false;
  bool quiet = false;
  bool estimate = false;  // print the memory estimate and exit
  bool print_config = false;  // print the settings as JSON and exit
  bool attention_given = false;   // --attention on the command line (else chosen by memory)
  bool vocab_given = false;       // --vocab on the command line
  bool attention_chosen = false;  // materialized chosen because the run fits with it
  bool batch_given = false;
  bool world_size_given = false;  // --batch on the command line (else the config's batch sizes may set it)
  trainer::TrainerConfig train;
  collectives::LaunchEnv launch;  // who started this process (read in main, before anything runs)
};

// Fills `o` from the command line. An exit code when the process is done (0 after --help, 2 for
// any command-line or config error, already reported on stderr); nullopt to go on.
std::optional<int> parse_command_line(int argc, char** argv, Options& o);

}  // namespace coshard::train_app
