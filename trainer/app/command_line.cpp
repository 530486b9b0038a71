#include "command_line.hpp"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <optional>

#include "coshard/async/log.hpp"
#include "coshard/trainer/data.hpp"
#include "coshard/trainer/settings.hpp"
#include "coshard/zero/peft.hpp"
#include "flight_dumps.hpp"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <filesystem>
#include <tuple>

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

}  // namespace

std::optional<int> parse_command_line(int argc, char** argv, Options& o) {
  CLI::App app{"coshard-train: trains a GPT or a Llama with ZeRO stages 0-3 (coshard)"};
  app.option_defaults()->always_capture_default();
  app.footer(
      "Your own data: --data book.txt trains on a text file as bytes (a vocabulary of 256); --data train.bin on a "
      "file of token ids (llm.c's .bin, or nanoGPT's raw uint16 with --data-format u16) with --vocab or a --preset's "
      "vocabulary. Without --data: a synthetic task. The quick start's main job (scripts/run.sh) learns "
      "data/coshard_docs.txt, the project's own docs, and samples it with --prompt.");
  app.add_option("--device", o.device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}));
  auto* world_option =
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
  std::string prompt_text, prompt_ids;
  auto* prompt_option = app.add_option("--prompt", prompt_text,
                                       "text to continue in samples, its bytes as token ids (models trained on text as "
                                       "bytes)");
  auto* prompt_ids_option = app.add_option("--prompt-ids", prompt_ids,
                                           "token ids to continue in samples, comma-separated (e.g. 50256,464)");
  auto* sample_every = app.add_option("--sample-every", o.sample_every,
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
  auto* batch_option = app.add_option("--batch", o.batch, "global batch (sequences per step, split evenly over the ranks; default 16, or the config's train_batch_size)")
      ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 30));
  app.add_option("--seq", o.seq, "tokens per sequence")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  std::string model = "gpt", preset;
  app.add_option("--model", model, "gpt (GPT-2's shape: LayerNorm, learned positions, GELU) or llama (RMSNorm, rotary "
                                   "positions, SwiGLU, grouped-query attention; see --preset)")
      ->check(CLI::IsMember({"gpt", "llama"}));
  auto* preset_option = app.add_option("--preset", preset,
                                       "a Llama shape by name (implies --model llama; the shape flags given change it):" +
                                           describe_presets());
  modules::LlamaConfig llama_flags;
  auto* layers = app.add_option("--layers", o.layers, "transformer blocks")->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}));
  auto* dim = app.add_option("--dim", o.dim, "model width")->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 20));
  auto* heads = app.add_option("--heads", o.heads, "attention heads")->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}));
  auto* kv_heads = app.add_option("--kv-heads", llama_flags.kv_heads,
                                  "llama: key/value heads, dividing --heads (default: --heads, or the preset's)")
                       ->check(CLI::Range(std::int64_t{1}, std::int64_t{4096}))
                       ->default_str("");
  auto* head_dim = app.add_option("--head-dim", llama_flags.head_dim, "llama: width of a head (default: dim / heads)")
                       ->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 16))
                       ->default_str("");
  auto* intermediate = app.add_option("--intermediate", llama_flags.intermediate,
                                      "llama: the MLP's hidden width (default: 8/3 x dim rounded up to 64, or the preset's)")
                           ->check(CLI::Range(std::int64_t{1}, std::int64_t{1} << 24))
                           ->default_str("");
  auto* rope_theta = app.add_option("--rope-theta", llama_flags.rope_theta, "llama: the rotary base (default 500000, or the preset's)")
                         ->check(kFinite)
                         ->check(CLI::Range(1.0 + 1e-9, 1e12))
                         ->default_str("");
  bool tie = false, untie = false;
  auto* tie_option = app.add_flag("--tie-embeddings", tie, "llama: the output layer uses the embedding table");
  auto* untie_option = app.add_flag("--untie-embeddings", untie, "llama: an output layer of its own")->excludes(tie_option);
  auto* vocab = app.add_option("--vocab", o.vocab,
                 "vocabulary: the synthetic task's, or the model's for a --data file of token ids (every id must be "
                 "below it; GPT-2's tokenizer: 50257); a Llama preset's own by default")->check(CLI::Range(std::int64_t{2}, std::int64_t{1} << 20));
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
  // The trainer's settings (trainer/settings.hpp): an option each, made from the table, checked
  // as given and applied over --config in the order given.
  std::vector<std::pair<const trainer::Setting*, std::string>> given;
  for (const auto& setting : trainer::settings()) {
    if (setting.flag.empty()) continue;
    const trainer::Setting* s = &setting;
    const std::string flag(s->flag);
    auto take = [&given, s, flag](const std::string& text) {
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
    option->type_name(s->kind == trainer::SettingKind::integer ? "INT"
                      : s->kind == trainer::SettingKind::bytes ? "SIZE"
                      : s->kind == trainer::SettingKind::real  ? "FLOAT"
                                                               : "TEXT");
    if (s->kind == trainer::SettingKind::choice && !s->choices.empty())
      option->check(CLI::IsMember(std::vector<std::string>(s->choices.begin(), s->choices.end())));
  }
  auto given_on_command_line = [&given](std::string_view name) {
    return std::any_of(given.begin(), given.end(), [name](const auto& g) { return g.first->name == name; });
  };
  std::vector<std::string> freeze;
  app.add_option("--freeze", freeze,
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
  std::vector<std::string> lora_targets;
  app.add_option("--lora-targets", lora_targets,
                 "with --lora-rank: the linear layers to adapt, by glob over their module paths (repeatable; "
                 "e.g. '*.attn.qkv' or 'h*.mlp.*'); with a Llama Hugging Face's projection names too (q_proj, k_proj, "
                 "v_proj, o_proj, gate_proj, up_proj, down_proj); default: q_proj and v_proj for a Llama, every "
                 "attention's qkv for a GPT");
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
  std::string tensorboard;
  auto* tensorboard_option = app.add_option(
      "--tensorboard", tensorboard,
      "write TensorBoard event files into this folder (rank 0; loss, lr, grad norm, tokens/s, step time, exposed "
      "communication, hit rate, swap bytes, peak memory each step): tensorboard --logdir FOLDER");
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
                 "OpenBLAS threads for the CPU matrix products (0: the cores divided by the ranks in this process)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--flight-recorder", o.flight_recorder,
                 "collective flight recorder: each rank writes its last collectives into this folder when a collective "
                 "times out or mismatches, a rank fails, or the process gets SIGUSR1; the diagnosis (who is behind, "
                 "where) goes to stderr");
  std::string flight_report;
  auto* report_option = app.add_option("--flight-report", flight_report,
                                       "print the diagnosis of a --flight-recorder folder and exit (0 when it holds records)");
  std::string log_level;
  auto* log_option = app.add_option("--log-level", log_level,
                                    "log levels, over COSHARD_LOG: a level (trace, debug, info, warn, error, off) and/or "
                                    "component=level items, comma-separated; components: async, collectives, offload, "
                                    "modules, zero, trainer, app (e.g. warn,zero=debug)");
  // A path given as '' would be ignored as if not given (--metrics '', --export ''): refused by name.
  const CLI::Validator non_empty(
      [](std::string& text) { return text.empty() ? std::string("an empty path (name a file or folder)") : std::string(); },
      "PATH");
  for (const char* name : {"--data", "--val-data", "--config", "--init", "--metrics", "--trace", "--checkpoint-dir", "--export",
                           "--tensorboard", "--flight-recorder", "--flight-report", "--adapter", "--export-adapter"})
    app.get_option(name)->check(non_empty);
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

  if (report_option->count()) return print_flight_diagnosis(flight_report, 0) ? 0 : 1;
  if (log_option->count()) {
    if (auto ok = log::configure(log_level); !ok) {
      std::fprintf(stderr, "coshard-train: --log-level: %s\n", ok.error().message().c_str());
      return 2;
    }
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
    if (!o.quiet)  // (on stderr under --print-config, whose stdout is the JSON)
      for (const auto& n : notes) std::fprintf(o.print_config ? stderr : stdout, "config note: %s\n", n.c_str());
  }
  for (const auto& [setting, text] : given)
    if (auto ok = setting->set(c, text, setting->flag); !ok) {  // (each was checked as it was given)
      std::fprintf(stderr, "coshard-train: %s\n", ok.error().message().c_str());
      return 2;
    }
  if (!given_on_command_line("decay_steps") && c.decay != trainer::LrDecay::none && c.decay_steps == 0)
    c.decay_steps = o.steps;
  if (!freeze.empty()) c.freeze = freeze;
  if (!lora_targets.empty()) c.lora_targets = lora_targets;
  // --adapter: the folder's LoRA settings, unless the command line or the config set a rank. An
  // alpha given that differs from the folder's is refused (the adapters' values mean another
  // product at another scale); a dropout given wins over the folder's, said in a note.
  std::optional<zero::PeftAdapterConfig> adapter_config;  // (its targets resolved once the model is known)
  if (!o.adapter.empty()) {
    auto peft = zero::read_peft_config(o.adapter);
    if (!peft) {
      std::fprintf(stderr, "coshard-train: --adapter %s: %s\n", o.adapter.c_str(), peft.error().message().c_str());
      return 2;
    }
    if (c.lora_rank != 0 && c.lora_rank != peft->r) {
      std::fprintf(stderr,
                   "coshard-train: --lora-rank %lld with --adapter %s, whose adapter_config.json says r=%lld: the "
                   "adapters have that rank (leave --lora-rank out to take the folder's)\n",
                   static_cast<long long>(c.lora_rank), o.adapter.c_str(), static_cast<long long>(peft->r));
      return 2;
    }
    const TrainerConfig defaults;
    const bool alpha_given = given_on_command_line("lora_alpha") || c.lora_alpha != defaults.lora_alpha;
    const bool dropout_given = given_on_command_line("lora_dropout") || c.lora_dropout != defaults.lora_dropout;
    if (alpha_given && static_cast<double>(c.lora_alpha) != static_cast<double>(static_cast<float>(peft->lora_alpha))) {
      std::fprintf(stderr,
                   "coshard-train: --lora-alpha %g with --adapter %s, whose adapter_config.json says lora_alpha=%g: the "
                   "adapters were trained at that scale (leave --lora-alpha out to take the folder's)\n",
                   static_cast<double>(c.lora_alpha), o.adapter.c_str(), peft->lora_alpha);
      return 2;
    }
    c.lora_rank = peft->r;
    c.lora_alpha = static_cast<float>(peft->lora_alpha);
    if (!dropout_given) {
      c.lora_dropout = static_cast<float>(peft->lora_dropout);
    } else if (static_cast<double>(c.lora_dropout) != peft->lora_dropout && !o.quiet) {
      std::fprintf(o.print_config ? stderr : stdout, "config note: --lora-dropout %g over the folder's lora_dropout %g (%s)\n",
                   static_cast<double>(c.lora_dropout), peft->lora_dropout, o.adapter.c_str());
    }
    if (lora_targets.empty()) adapter_config = std::move(*peft);
  }
  if ((!o.adapter.empty() || !o.export_adapter.empty()) && c.lora_rank == 0) {
    std::fprintf(stderr, "coshard-train: %s needs LoRA (--lora-rank)\n", o.adapter.empty() ? "--export-adapter" : "--adapter");
    return 2;
  }
  // Globs and lists into files, in order (each checked and opened later, before anything trains).
  for (auto [specs, files, first, flag] : {std::tuple{&o.data_specs, &o.data_files, &o.data, "--data"},
                                           std::tuple{&o.val_specs, &o.val_files, &o.val_data, "--val-data"}}) {
    if (specs->empty()) continue;
    auto expanded = trainer::expand_data_paths(*specs);
    if (!expanded) {
      std::fprintf(stderr, "coshard-train: %s: %s\n", flag, expanded.error().message().c_str());
      return 2;
    }
    *files = std::move(*expanded);
    *first = files->front().string();
  }
  // Samples: a prompt of bytes or of ids (not both), asked for by --sample-every or a prompt.
  if (prompt_option->count() && prompt_ids_option->count()) {
    std::fprintf(stderr, "coshard-train: --prompt and --prompt-ids: give one\n");
    return 2;
  }
  if (prompt_option->count()) {
    if (prompt_text.empty()) {
      std::fprintf(stderr, "coshard-train: --prompt '': an empty prompt (give at least one character)\n");
      return 2;
    }
    for (const unsigned char ch : prompt_text) o.prompt.push_back(static_cast<std::int32_t>(ch));
    o.prompt_is_text = true;
  }
  if (prompt_ids_option->count()) {
    std::size_t at = 0;
    while (at <= prompt_ids.size()) {
      const std::size_t end = std::min(prompt_ids.find(',', at), prompt_ids.size());
      const std::string item = prompt_ids.substr(at, end - at);
      std::int64_t id = -1;
      const auto [stop, ec] = std::from_chars(item.data(), item.data() + item.size(), id);
      if (item.empty() || ec != std::errc{} || stop != item.data() + item.size() || id < 0 || id > (std::int64_t{1} << 31) - 1) {
        std::fprintf(stderr, "coshard-train: --prompt-ids: '%s' is not a token id (expected ids from 0, comma-separated)\n",
                     item.substr(0, 64).c_str());
        return 2;
      }
      o.prompt.push_back(static_cast<std::int32_t>(id));
      at = end + 1;
    }
  }
  o.sampling = sample_every->count() > 0 || !o.prompt.empty();
  if (o.steps == 0 && o.prompt.empty() && o.val_specs.empty()) {
    std::fprintf(stderr, "coshard-train: --steps 0 trains nothing: it samples or validates (give --prompt or "
                         "--prompt-ids, or --val-data, and the weights with --init)\n");
    return 2;
  }
  // (on the synthetic task, validation draws held-out sequences of the same task)
  // (the config file's eval_every asks as --eval-every does)
  const bool eval_asked = given_on_command_line("eval_every") || given_on_command_line("eval_batches") || c.eval_every > 0;
  if (eval_asked && o.val_data.empty() && !o.data.empty()) {
    std::fprintf(stderr, "coshard-train: %s without --val-data: name the held-out data to evaluate on\n",
                 given_on_command_line("eval_every")     ? "--eval-every"
                 : given_on_command_line("eval_batches") ? "--eval-batches"
                                                         : "the config's eval_every");
    return 2;
  }
  o.validate = !o.val_data.empty() || eval_asked;
  c.record_timeline = !o.trace.empty();
  if (tensorboard_option->count()) c.tensorboard_dir = tensorboard;
  o.attention_given = given_on_command_line("attention");
  o.vocab_given = vocab->count() > 0;

  // The model: a GPT, or a Llama (a preset, a Hugging Face folder, or the flags alone, with the
  // flags given over a preset). The vocabulary is settled with the data, in main.
  std::error_code ec;
  o.init_is_folder = !o.init.empty() && std::filesystem::is_directory(o.init, ec);
  ModelFlags flags;
  flags.model = model;
  flags.model_given = app.get_option("--model")->count() > 0;
  if (preset_option->count()) flags.preset = preset;
  if (o.init_is_folder) flags.init_folder = o.init;
  flags.vocab = o.vocab;
  flags.layers = o.layers;
  flags.dim = o.dim;
  flags.heads = o.heads;
  flags.seq = o.seq;
  flags.vocab_given = vocab->count() > 0;
  flags.layers_given = layers->count() > 0;
  flags.dim_given = dim->count() > 0;
  flags.heads_given = heads->count() > 0;
  if (kv_heads->count()) flags.kv_heads = llama_flags.kv_heads;
  if (head_dim->count()) flags.head_dim = llama_flags.head_dim;
  if (intermediate->count()) flags.intermediate = llama_flags.intermediate;
  if (rope_theta->count()) flags.rope_theta = llama_flags.rope_theta;
  if (tie_option->count()) flags.tie_embeddings = tie;
  if (untie_option->count()) flags.tie_embeddings = !untie;
  auto resolved = resolve_model(flags);
  if (!resolved) {
    std::fprintf(stderr, "coshard-train: %s\n", resolved.error().message().c_str());
    return 2;
  }
  o.model = std::move(*resolved);
  // --adapter's target_modules as PEFT selects them (layers_to_transform, layers_pattern,
  // exclude_modules and a regular expression included): the same adapters over transformers'
  // module names of this Llama.
  if (adapter_config) {
    const std::string source = (std::filesystem::path(o.adapter) / zero::kPeftConfigName).string();
    if (o.model.kind == ModelChoice::Kind::llama) {
      auto targets = zero::peft_llama_targets(*adapter_config, o.model.llama.layers, !o.model.llama.tie_embeddings);
      if (!targets) {
        std::fprintf(stderr, "coshard-train: --adapter %s: %s\n", source.c_str(), targets.error().message().c_str());
        return 2;
      }
      c.lora_targets = std::move(*targets);
    } else if (adapter_config->target_modules_regex || !adapter_config->layers_to_transform.empty() ||
               !adapter_config->exclude_modules.empty()) {
      std::fprintf(stderr,
                   "coshard-train: --adapter %s: target_modules as a regular expression, layers_to_transform and "
                   "exclude_modules are read for a Llama only (this model is a GPT): give --lora-targets\n",
                   source.c_str());
      return 2;
    } else {
      c.lora_targets = adapter_config->target_modules;
    }
  }
  // A Llama exports a Hugging Face folder unless the path names a .safetensors file; a GPT a file.
  o.export_is_folder = o.model.kind == ModelChoice::Kind::llama && !o.export_path.empty() &&
                       std::filesystem::path(o.export_path).extension() != ".safetensors";
  if (auto ok = c.validate(); !ok) {
    std::fprintf(stderr, "coshard-train: %s\n", ok.error().message().c_str());
    return 2;
  }
  o.train = c;
  // (one rank of several under a launcher prints once every rank agreed to: main)
  const auto launch = collectives::read_launch_env();
  const bool with_others = launch && launch->launcher != collectives::Launcher::none && launch->world_size > 1;
  if (o.print_config && !with_others) {
    std::printf("%s\n", trainer::settings_json(c).c_str());
    return 0;
  }
  o.batch_given = batch_option->count() > 0;
  o.world_size_given = world_option->count() > 0;
  return std::nullopt;

}

}  // namespace coshard::train_app
