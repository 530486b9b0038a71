#include "command_line_options.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>

#include "model_choice.hpp"

namespace coshard::train_app {

using trainer::TrainerConfig;

namespace {

// A real given as "nan" passes CLI11's ranges (every comparison with it is false): refused here,
// before anything runs (a --temperature nan trained the whole run, then refused the sample).
const CLI::Validator kFinite(
    [](std::string& text) -> std::string {
      double v = 0;
      const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
      if (ec == std::errc{} && end == text.data() + text.size() && !std::isfinite(v)) return "expected a finite number";
      return {};
    },
    "FINITE");

// Where the ranks run, how they talk, how long they may take, and how many steps.
void add_run_options(CLI::App& app, Options& o, CommandLine& cl) {
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  cl.world_option =
      app.add_option("--world-size", o.world_size,
                     "ranks as threads of this process (Local backend; with --device cuda they share GPU 0); under "
                     "mpirun, srun or torchrun the launcher's world, and this must equal it if given")
          ->check(CLI::Range(1, 64));
  app.add_option("--backend", o.backend,
                 "collectives: auto (threads: local; mpirun/srun: nccl on GPUs, else mpi; torchrun: nccl), local, "
                 "nccl or mpi")
      ->check(CLI::IsMember({"auto", "local", "nccl", "mpi"}));
  app.add_option("--collective-timeout", o.collective_timeout_s,
                 "seconds a collective may take before the run fails naming the ranks it waits for (0: the "
                 "backend's default: 60 for local, 300 for nccl and mpi)")
      ->check(kFinite)
      ->check(CLI::Range(0.0, 1e7));
  app.add_option("--stop-timeout", o.stop_timeout_s,
                 "seconds the run may take, after the first SIGINT/SIGTERM/SIGHUP, to finish its step and save "
                 "before it exits anyway (status 128 + the signal, no final save; the checkpoints already "
                 "published stay); 0: no bound (default 300)")
      ->check(CLI::Range(0, 1 << 24));
  app.add_option("--steps", o.steps,
                 "optimizer steps in total (a resumed run continues to this); 0: no training, only a sample (with "
                 "--prompt or --prompt-ids) and/or the validation loss (with --val-data) of --init's weights")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
}

// Samples: the prompt, how often, and how the tokens are drawn.
void add_sample_options(CLI::App& app, Options& o, CommandLine& cl) {
  cl.prompt_option = app.add_option("--prompt", cl.prompt_text,
                                    "text to continue in samples, its bytes as token ids (models trained on text as "
                                    "bytes)");
  cl.prompt_ids_option = app.add_option("--prompt-ids", cl.prompt_ids,
                                        "token ids to continue in samples, comma-separated (e.g. 50256,464)");
  cl.sample_every = app.add_option("--sample-every", o.sample_every,
                                   "a sample every N steps and after the last step (0: after the last step only, "
                                   "when --prompt or --prompt-ids is given)")
                        ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
  app.add_option("--sample-tokens", o.sample.tokens, "new tokens in each sample")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  app.add_option("--temperature", o.sample.temperature,
                 "sampling temperature (0: greedy, the most likely token each time: the same text at any world size "
                 "and stage)")
      ->check(kFinite)
      ->check(CLI::Range(0.0f, 1e6f));
  app.add_option("--top-k", o.sample.top_k, "sample among the K most likely tokens (0: all)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 31));
}

// The step's shape (--batch, --seq) and the model's: a GPT, or a Llama by preset and/or flags.
void add_shape_options(CLI::App& app, Options& o, CommandLine& cl) {
  cl.batch_option = app.add_option("--batch", o.batch, "global batch (sequences per step, split evenly over the ranks; default 16, or the config's train_batch_size)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 30));
  app.add_option("--seq", o.seq, "tokens per sequence")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cl.model_option = app.add_option("--model", cl.model, "gpt (GPT-2's shape: LayerNorm, learned positions, GELU) or llama (RMSNorm, rotary "
                                   "positions, SwiGLU, grouped-query attention; see --preset)")
      ->check(CLI::IsMember({"gpt", "llama"}));
  cl.preset_option = app.add_option("--preset", cl.preset,
                                    "a Llama shape by name (implies --model llama; the shape flags given change it):" +
                                        describe_presets());
  cl.layers = app.add_option("--layers", o.layers, "transformer blocks")->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}));
  cl.dim = app.add_option("--dim", o.dim, "model width")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  cl.heads = app.add_option("--heads", o.heads, "attention heads")->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}));
  cl.kv_heads = app.add_option("--kv-heads", cl.llama_flags.kv_heads,
                               "llama: key/value heads, dividing --heads (default: --heads, or the preset's)")
                    ->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}))
                    ->default_str("");
  cl.head_dim = app.add_option("--head-dim", cl.llama_flags.head_dim, "llama: width of a head (default: dim / heads)")
                    ->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 16))
                    ->default_str("");
  cl.intermediate = app.add_option("--intermediate", cl.llama_flags.intermediate,
                                   "llama: the MLP's hidden width (default: 8/3 x dim rounded up to 64, or the preset's)")
                        ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24))
                        ->default_str("");
  cl.rope_theta = app.add_option("--rope-theta", cl.llama_flags.rope_theta, "llama: the rotary base (default 500000, or the preset's)")
                      ->check(kFinite)
                      ->check(CLI::Range(1.0 + 1e-9, 1e12))
                      ->default_str("");
  cl.experts = app.add_option("--experts", cl.llama_flags.moe.experts,
                               "llama: a mixture of experts in every layer's MLP, of this many experts (Qwen3-MoE's "
                               "layout: head norms; default: none, or the preset's)")
                   ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 16))
                   ->default_str("");
  cl.experts_per_token = app.add_option("--experts-per-token", cl.llama_flags.moe.top_k,
                                        "llama: the experts each token is routed to (top k; default 2, or the preset's)")
                             ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 16))
                             ->default_str("");
  cl.expert_width = app.add_option("--expert-width", cl.llama_flags.moe.intermediate,
                                   "llama: each expert's hidden width (default: the MLP's, or the preset's)")
                        ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24))
                        ->default_str("");
  app.add_option("--expert-fetch", cl.expert_fetch,
                 "mixture of experts at ZeRO-3: routed (gather and reduce only the experts some rank routed a token to) "
                 "or all (every expert every pass, as FSDP2 and DeepSpeed do; an expert nobody chose then gets a "
                 "zero gradient, so weight decay and the moments move it)")
      ->check(CLI::IsMember({"routed", "all"}));
  cl.router_aux_loss_coef =
      app.add_option("--router-aux-loss-coef", cl.llama_flags.moe.aux_loss_coef,
                     "mixture of experts: the load-balancing loss's weight (transformers' router_aux_loss_coef; "
                     "default: the folder's when its output_router_logits is true, else 0, or the preset's)")
          ->check(kFinite)
          ->check(CLI::Range(0.0, 1e6))
          ->default_str("");
  cl.tie_option = app.add_flag("--tie-embeddings", cl.tie, "llama: the output layer uses the embedding table");
  cl.untie_option = app.add_flag("--untie-embeddings", cl.untie, "llama: an output layer of its own")->excludes(cl.tie_option);
  cl.vocab = app.add_option("--vocab", o.vocab,
                 "vocabulary: the synthetic task's, or the model's for a --data file of token ids (every id must be "
                 "below it; GPT-2's tokenizer: 50257); a Llama preset's own by default")->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 20));
}

// The training data and the held-out data, and how their files hold tokens.
void add_data_options(CLI::App& app, Options& o) {
  app.add_option("--data", o.data_specs,
                 "training data (default: the synthetic task): a text file, trained on as bytes, or files of token "
                 "ids (llm.c's .bin with its header, or raw uint16 as nanoGPT's train.bin; see --data-format): several "
                 "files are read as one stream in the order given, a quoted glob's ('fineweb_train_*.bin') in name order; "
                 "a file named twice (another spelling, a link) is refused");
  app.add_option("--data-format", o.data_format,
                 "how --data holds its tokens: auto (llm.c's header, else uint16 for a .bin name, else bytes), bytes, "
                 "u16 or u32 (little-endian ids)")
      ->check(CLI::IsMember({"auto", "bytes", "u16", "u32"}));
  app.add_option("--val-data", o.val_specs,
                 "held-out data for the validation loss, in --data's formats (--data-format applies to both): its "
                 "first --eval-batches batches of the step's shape, the same each time, every --eval-every steps and "
                 "after the last step");
}

// The trainer's settings (trainer/settings.hpp): an option each, made from the table, checked
// as given and applied over --config in the order given.
void add_setting_options(CLI::App& app, CommandLine& cl) {
  for (const auto& setting : trainer::settings()) {
    if (setting.flag.empty()) continue;
    const trainer::Setting* s = &setting;
    const std::string flag(s->flag);
    auto take = [&given = cl.given, s, flag](const std::string& text) {
      TrainerConfig scratch;
      if (auto ok = s->parse(*s, scratch, text); !ok) throw CLI::ValidationError(flag, ok.error().message());
      if (auto ok = s->validate(scratch); !ok) throw CLI::ValidationError(flag, ok.error().message());
      given.emplace_back(s, text);
    };
    if (s->kind == trainer::SettingKind::boolean) {
      app.add_flag_callback(flag, [take, s] { take(s->switch_sets ? "true" : "false"); }, std::string(s->help));
      continue;
    }
    auto* option = app.add_option_function<std::string>(flag, take, std::string(s->help));
    if (const auto shown = s->value(TrainerConfig{}); !shown.empty()) option->default_str(shown);
    // (a count that also takes the word local, the ranks of a node: INT|local)
    const bool or_local = s->kind == trainer::SettingKind::integer && s->expected.ends_with("or local");
    option->type_name(or_local ? "INT|local"
                      : s->kind == trainer::SettingKind::integer ? "INT"
                      : s->kind == trainer::SettingKind::bytes ? "SIZE"
                      : s->kind == trainer::SettingKind::real  ? "FLOAT"
                                                               : "TEXT");
    if (s->kind == trainer::SettingKind::choice && !s->choices.empty())
      option->check(CLI::IsMember(std::vector<std::string>(s->choices.begin(), s->choices.end())));
  }
}

// What trains: frozen parameters, and LoRA's adapters to start from, to write, and where.
void add_fine_tuning_options(CLI::App& app, Options& o, CommandLine& cl) {
  app.add_option("--freeze", cl.freeze,
                 "parameters that do not train, by glob over their full names (repeatable; e.g. 'embed.*' or "
                 "'h0.*', the embedding and the first block); each must match a parameter");
  app.add_option("--adapter", o.adapter,
                 "LoRA adapters to start from (continue training, or sample with them): a Hugging Face PEFT folder "
                 "(adapter_config.json, adapter_model.safetensors); its r, lora_alpha and target_modules unless "
                 "--lora-rank is given")
      ->check(CLI::ExistingDirectory);
  app.add_option("--export-adapter", o.export_adapter,
                 "with LoRA, at the end, write the adapters as a Hugging Face PEFT folder (adapter_config.json and "
                 "adapter_model.safetensors under PEFT's names; --export then writes the merged model)");
  app.add_option("--lora-targets", cl.lora_targets,
                 "with --lora-rank: the linear layers to adapt, by glob over their module paths (repeatable; "
                 "e.g. '*.attn.qkv' or 'h*.mlp.*'); with a Llama Hugging Face's projection names too (q_proj, k_proj, "
                 "v_proj, o_proj, gate_proj, up_proj, down_proj); default: q_proj and v_proj for a Llama, every "
                 "attention's qkv for a GPT");
}

// The files a run reads (--config, --init) and writes (metrics, trace, checkpoints, export, TensorBoard).
void add_file_options(CLI::App& app, Options& o, CommandLine& cl) {
  app.add_option("--config", o.config, "a DeepSpeed JSON config (its zero_optimization, fp16/bf16, optimizer, ...)")
      ->check(CLI::ExistingFile);
  app.add_option("--init", o.init,
                 "initial weights: a safetensors file of coshard's names, or a Hugging Face Llama folder (its "
                 "config.json gives the model's shape; model.safetensors, or shards with their index, the weights)")
      ->check(CLI::ExistingPath);
  app.add_option("--metrics", o.metrics, "one JSON object per step (rank 0)");
  app.add_option("--trace", o.trace, "a Chrome-trace/Perfetto JSON timeline of every step, from device timestamps");
  app.add_option("--checkpoint-dir", o.checkpoint_dir, "folder of sharded checkpoints");
  app.add_option("--checkpoint-every", o.checkpoint_every, "save every N steps (0: never)")
      ->check(CLI::Range(std::int64_t{0}, std::int64_t{1} << 40));
  app.add_flag("--resume", o.resume, "continue from the latest checkpoint in --checkpoint-dir");
  app.add_flag("--start-over", o.start_over,
               "a fresh run in a --checkpoint-dir that holds checkpoints: remove them first (without it, refused)")
      ->excludes("--resume");
  app.add_option("--export", o.export_path,
                 "at the end, write the model: a GPT, or a path ending in .safetensors, as one safetensors file "
                 "(coshard's names); a Llama otherwise as a FOLDER in Hugging Face's layout (config.json and "
                 "model.safetensors, sharded above 5GB with its index; files of an earlier export there are "
                 "replaced, others stay)");
  cl.tensorboard_option = app.add_option(
      "--tensorboard", cl.tensorboard,
      "write TensorBoard event files into this folder (rank 0; loss, lr, grad norm, tokens/s, step time, exposed "
      "communication, hit rate, swap bytes, peak memory each step): tensorboard --logdir FOLDER");
}

// What the process prints (or only prints, and exits), its BLAS threads, and its diagnostics.
void add_output_options(CLI::App& app, Options& o, CommandLine& cl) {
  app.add_flag("--quiet", o.quiet,
               "no progress output: no header, step lines, validation lines or samples (with --steps 0 the sample and "
               "the validation loss, the run's only results, still print; errors always do)");
  app.add_flag("--print-config", o.print_config,
               "print every trainer setting of this run (--config's, with the command line's over them) as JSON under "
               "coshard's names, and exit: a file --config reads back");
  app.add_flag("--estimate", o.estimate,
               "print the memory each rank will hold (device, pinned and pageable host, NVMe) against this machine's, and "
               "exit without training: 0 when it fits, 1 when not (a run that cannot fit is refused up front anyway)");
  app.add_option("--blas-threads", o.blas_threads,
                 "math threads of each rank on the CPU: its matrix products (OpenBLAS, oneDNN) and its split element-wise "
                 "kernels and optimizer (0: the cores divided by the ranks on this machine)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--flight-recorder", o.flight_recorder,
                 "collective flight recorder: each rank writes its last collectives into this folder when a collective "
                 "times out or mismatches, a rank fails, or the process gets SIGUSR1; the diagnosis (who is behind, "
                 "where) goes to stderr");
  cl.report_option = app.add_option("--flight-report", cl.flight_report,
                                    "print the diagnosis of a --flight-recorder folder and exit (0 when it holds records)");
  cl.log_option = app.add_option("--log-level", cl.log_level,
                                 "log levels, over COSHARD_LOG: a level (trace, debug, info, warn, error, off) and/or "
                                 "component=level items, comma-separated; components: async, collectives, offload, "
                                 "modules, zero, trainer, app (e.g. warn,zero=debug)");
}

// A path given as '' would be ignored as if not given (--metrics '', --export ''): refused by name.
void refuse_empty_paths(CLI::App& app) {
  const CLI::Validator non_empty(
      [](std::string& text) { return text.empty() ? std::string("an empty path (name a file or folder)") : std::string(); },
      "PATH");
  for (const char* name : {"--data", "--val-data", "--config", "--init", "--metrics", "--trace", "--checkpoint-dir", "--export",
                           "--tensorboard", "--flight-recorder", "--flight-report", "--adapter", "--export-adapter"})
    app.get_option(name)->check(non_empty);
}

}  // namespace

bool CommandLine::given_on_command_line(std::string_view name) const {
  return std::any_of(given.begin(), given.end(), [name](const auto& g) { return g.first->name == name; });
}

void add_options(CLI::App& app, Options& o, CommandLine& cl) {
  app.option_defaults()->always_capture_default();
  app.footer(
      "Your own data: --data book.txt trains on a text file as bytes (a vocabulary of 256); --data train.bin on a "
      "file of token ids (llm.c's .bin, or nanoGPT's raw uint16 with --data-format u16) with --vocab or a --preset's "
      "vocabulary. Without --data: a synthetic task. The quick start's main job (scripts/run.sh) learns "
      "data/coshard_docs.txt, the project's own docs, and samples it with --prompt.");
  add_run_options(app, o, cl);
  add_sample_options(app, o, cl);
  add_shape_options(app, o, cl);
  add_data_options(app, o);
  add_setting_options(app, cl);
  add_fine_tuning_options(app, o, cl);
  add_file_options(app, o, cl);
  add_output_options(app, o, cl);
  refuse_empty_paths(app);
}

}  // namespace coshard::train_app
