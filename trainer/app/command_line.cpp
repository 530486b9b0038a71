// parse_command_line: the options declared (command_line_options.cpp) and parsed, then what they
// mean together: --config with the command line's settings over it, --adapter's folder, the data
// files, the prompt, what the run does (trains, samples, validates) and the model it builds.
#include "command_line.hpp"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <filesystem>
#include <optional>
#include <tuple>

#include "coshard/async/log.hpp"
#include "coshard/trainer/data.hpp"
#include "coshard/trainer/settings.hpp"
#include "coshard/zero/peft.hpp"
#include "command_line_options.hpp"
#include "flight_dumps.hpp"

namespace coshard::train_app {

using trainer::TrainerConfig;

namespace {

// Every command-line error exits 2 (CLI11's own codes vary with the kind of error); --help 0.
std::optional<int> parse_or_exit(CLI::App& app, int argc, char** argv) {
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
  return std::nullopt;
}

// --flight-report only reads a folder and exits; --log-level holds before anything logs.
std::optional<int> apply_tool_options(const CommandLine& cl) {
  if (cl.report_option->count()) return print_flight_diagnosis(cl.flight_report, 0) ? 0 : 1;
  if (cl.log_option->count()) {
    if (auto ok = log::configure(cl.log_level); !ok) {
      std::fprintf(stderr, "coshard-train: --log-level: %s\n", ok.error().message().c_str());
      return 2;
    }
  }
  return std::nullopt;
}

// --config first, then every option given on the command line over it.
std::optional<int> read_trainer_config(const Options& o, const CommandLine& cl, TrainerConfig& c) {
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
  for (const auto& [setting, text] : cl.given)
    if (auto ok = setting->set(c, text, setting->flag); !ok) {  // (each was checked as it was given)
      std::fprintf(stderr, "coshard-train: %s\n", ok.error().message().c_str());
      return 2;
    }
  if (!cl.given_on_command_line("decay_steps") && c.decay != trainer::LrDecay::none && c.decay_steps == 0)
    c.decay_steps = o.steps;
  if (!cl.freeze.empty()) c.freeze = cl.freeze;
  if (!cl.lora_targets.empty()) c.lora_targets = cl.lora_targets;
  return std::nullopt;
}

// --adapter: the folder's LoRA settings, unless the command line or the config set a rank. An
// alpha given that differs from the folder's is refused (the adapters' values mean another
// product at another scale); a dropout given wins over the folder's, said in a note. The folder's
// config is kept in `adapter_config` when its targets are taken (resolved once the model is known).
std::optional<int> take_adapter_settings(const Options& o, const CommandLine& cl, TrainerConfig& c,
                                         std::optional<zero::PeftAdapterConfig>& adapter_config) {
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
    const bool alpha_given = cl.given_on_command_line("lora_alpha") || c.lora_alpha != defaults.lora_alpha;
    const bool dropout_given = cl.given_on_command_line("lora_dropout") || c.lora_dropout != defaults.lora_dropout;
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
    if (cl.lora_targets.empty()) adapter_config = std::move(*peft);
  }
  if ((!o.adapter.empty() || !o.export_adapter.empty()) && c.lora_rank == 0) {
    std::fprintf(stderr, "coshard-train: %s needs LoRA (--lora-rank)\n", o.adapter.empty() ? "--export-adapter" : "--adapter");
    return 2;
  }
  return std::nullopt;
}

// Globs and lists into files, in order (each checked and opened later, before anything trains).
std::optional<int> expand_data_files(Options& o) {
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
  return std::nullopt;
}

// Samples: a prompt of bytes or of ids (not both), asked for by --sample-every or a prompt.
std::optional<int> read_prompt(Options& o, const CommandLine& cl) {
  if (cl.prompt_option->count() && cl.prompt_ids_option->count()) {
    std::fprintf(stderr, "coshard-train: --prompt and --prompt-ids: give one\n");
    return 2;
  }
  if (cl.prompt_option->count()) {
    if (cl.prompt_text.empty()) {
      std::fprintf(stderr, "coshard-train: --prompt '': an empty prompt (give at least one character)\n");
      return 2;
    }
    for (const unsigned char ch : cl.prompt_text) o.prompt.push_back(static_cast<std::int32_t>(ch));
    o.prompt_is_text = true;
  }
  if (cl.prompt_ids_option->count()) {
    const std::string& prompt_ids = cl.prompt_ids;
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
  o.sampling = cl.sample_every->count() > 0 || !o.prompt.empty();
  return std::nullopt;
}

// What the run does besides training: --steps 0 must sample or validate, and validation asked
// for needs data to validate on.
std::optional<int> check_sampling_and_validation(Options& o, const CommandLine& cl, const TrainerConfig& c) {
  if (o.steps == 0 && o.prompt.empty() && o.val_specs.empty()) {
    std::fprintf(stderr, "coshard-train: --steps 0 trains nothing: it samples or validates (give --prompt or "
                         "--prompt-ids, or --val-data, and the weights with --init)\n");
    return 2;
  }
  // (on the synthetic task, validation draws held-out sequences of the same task)
  // (the config file's eval_every asks as --eval-every does)
  const bool eval_asked = cl.given_on_command_line("eval_every") || cl.given_on_command_line("eval_batches") || c.eval_every > 0;
  if (eval_asked && o.val_data.empty() && !o.data.empty()) {
    std::fprintf(stderr, "coshard-train: %s without --val-data: name the held-out data to evaluate on\n",
                 cl.given_on_command_line("eval_every")     ? "--eval-every"
                 : cl.given_on_command_line("eval_batches") ? "--eval-batches"
                                                            : "the config's eval_every");
    return 2;
  }
  o.validate = !o.val_data.empty() || eval_asked;
  return std::nullopt;
}

// The model: a GPT, or a Llama (a preset, a Hugging Face folder, or the flags alone, with the
// flags given over a preset). The vocabulary is settled with the data, in main.
std::optional<int> choose_model(Options& o, const CommandLine& cl) {
  std::error_code ec;
  o.init_is_folder = !o.init.empty() && std::filesystem::is_directory(o.init, ec);
  ModelFlags flags;
  flags.model = cl.model;
  flags.model_given = cl.model_option->count() > 0;
  if (cl.preset_option->count()) flags.preset = cl.preset;
  if (o.init_is_folder) flags.init_folder = o.init;
  flags.vocab = o.vocab;
  flags.layers = o.layers;
  flags.dim = o.dim;
  flags.heads = o.heads;
  flags.seq = o.seq;
  flags.vocab_given = cl.vocab->count() > 0;
  flags.layers_given = cl.layers->count() > 0;
  flags.dim_given = cl.dim->count() > 0;
  flags.heads_given = cl.heads->count() > 0;
  if (cl.kv_heads->count()) flags.kv_heads = cl.llama_flags.kv_heads;
  if (cl.head_dim->count()) flags.head_dim = cl.llama_flags.head_dim;
  if (cl.intermediate->count()) flags.intermediate = cl.llama_flags.intermediate;
  if (cl.rope_theta->count()) flags.rope_theta = cl.llama_flags.rope_theta;
  if (cl.router_aux_loss_coef->count()) flags.router_aux_loss_coef = cl.llama_flags.moe.aux_loss_coef;
  if (cl.experts->count()) flags.experts = cl.llama_flags.moe.experts;
  flags.expert_fetch = cl.expert_fetch;
  if (cl.experts_per_token->count()) flags.experts_per_token = cl.llama_flags.moe.top_k;
  if (cl.expert_width->count()) flags.expert_width = cl.llama_flags.moe.intermediate;
  if (cl.tie_option->count()) flags.tie_embeddings = cl.tie;
  if (cl.untie_option->count()) flags.tie_embeddings = !cl.untie;
  auto resolved = resolve_model(flags);
  if (!resolved) {
    std::fprintf(stderr, "coshard-train: %s\n", resolved.error().message().c_str());
    return 2;
  }
  o.model = std::move(*resolved);
  return std::nullopt;
}

// --adapter's target_modules as PEFT selects them (layers_to_transform, layers_pattern,
// exclude_modules and a regular expression included): the same adapters over transformers'
// module names of this Llama.
std::optional<int> take_adapter_targets(const Options& o, const zero::PeftAdapterConfig& adapter_config, TrainerConfig& c) {
  const std::string source = (std::filesystem::path(o.adapter) / zero::kPeftConfigName).string();
  if (o.model.kind == ModelChoice::Kind::llama) {
    auto targets = zero::peft_llama_targets(adapter_config, o.model.llama);
    if (!targets) {
      std::fprintf(stderr, "coshard-train: --adapter %s: %s\n", source.c_str(), targets.error().message().c_str());
      return 2;
    }
    c.lora_targets = std::move(*targets);
  } else if (adapter_config.target_modules_regex || !adapter_config.layers_to_transform.empty() ||
             !adapter_config.exclude_modules.empty()) {
    std::fprintf(stderr,
                 "coshard-train: --adapter %s: target_modules as a regular expression, layers_to_transform and "
                 "exclude_modules are read for a Llama only (this model is a GPT): give --lora-targets\n",
                 source.c_str());
    return 2;
  } else {
    c.lora_targets = adapter_config.target_modules;
  }
  return std::nullopt;
}

}  // namespace

std::optional<int> parse_command_line(int argc, char** argv, Options& o) {
  CommandLine cl;  // (before the App: its options bind cl's members)
  CLI::App app{"coshard-train: trains a GPT or a Llama with ZeRO stages 0-3 (coshard)"};
  add_options(app, o, cl);
  if (auto done = parse_or_exit(app, argc, argv)) return done;
  if (auto done = apply_tool_options(cl)) return done;

  TrainerConfig c;
  if (auto done = read_trainer_config(o, cl, c)) return done;
  std::optional<zero::PeftAdapterConfig> adapter_config;
  if (auto done = take_adapter_settings(o, cl, c, adapter_config)) return done;
  if (auto done = expand_data_files(o)) return done;
  if (auto done = read_prompt(o, cl)) return done;
  if (auto done = check_sampling_and_validation(o, cl, c)) return done;
  c.record_timeline = !o.trace.empty();
  if (cl.tensorboard_option->count()) c.tensorboard_dir = cl.tensorboard;
  o.attention_given = cl.given_on_command_line("attention");
  o.vocab_given = cl.vocab->count() > 0;

  if (auto done = choose_model(o, cl)) return done;
  if (adapter_config) {
    if (auto done = take_adapter_targets(o, *adapter_config, c)) return done;
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
  const bool launched = launch && launch->launcher != collectives::Launcher::none;
  const int world = launched ? launch->world_size : cl.world_option->count() > 0 ? o.world_size : 0;  // (0: not known yet)
  if (auto ok = c.validate_for_world(world); !ok) {
    std::fprintf(stderr, "coshard-train: %s\n", ok.error().message().c_str());
    return 2;
  }
  if (o.print_config && !with_others) {
    std::printf("%s\n", trainer::settings_json(c).c_str());
    return 0;
  }
  o.batch_given = cl.batch_option->count() > 0;
  o.world_size_given = cl.world_option->count() > 0;
  return std::nullopt;
}

}  // namespace coshard::train_app
