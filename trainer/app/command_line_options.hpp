// coshard-train's options as CLI11 declares them: every option with its range, its help and the
// order --help lists it in. What the command line gives beyond Options (values read once it is
// parsed, and the options whose count says whether they were given) is a CommandLine, which
// command_line.cpp reads after parsing.
#pragma once

#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "coshard/modules/llama.hpp"
#include "coshard/trainer/settings.hpp"
#include "command_line.hpp"

#include <CLI/CLI.hpp>

namespace coshard::train_app {

// The options bind its members: it stays where it is (neither moved nor copied) while the App lives.
struct CommandLine {
  CommandLine() = default;
  CommandLine(const CommandLine&) = delete;
  CommandLine& operator=(const CommandLine&) = delete;

  std::string prompt_text, prompt_ids;
  std::string model = "gpt", preset;
  modules::LlamaConfig llama_flags;  // the Llama shape flags given (each counted on its option)
  bool tie = false, untie = false;
  std::string expert_fetch = "routed";
  // The trainer's settings given, in order, with their text: applied over --config.
  std::vector<std::pair<const trainer::Setting*, std::string>> given;
  std::vector<std::string> freeze, lora_targets;
  std::string tensorboard, flight_report, log_level;

  CLI::Option* world_option = nullptr;
  CLI::Option* prompt_option = nullptr;
  CLI::Option* prompt_ids_option = nullptr;
  CLI::Option* sample_every = nullptr;
  CLI::Option* batch_option = nullptr;
  CLI::Option* model_option = nullptr;
  CLI::Option* preset_option = nullptr;
  CLI::Option* layers = nullptr;
  CLI::Option* dim = nullptr;
  CLI::Option* heads = nullptr;
  CLI::Option* kv_heads = nullptr;
  CLI::Option* head_dim = nullptr;
  CLI::Option* intermediate = nullptr;
  CLI::Option* rope_theta = nullptr;
  CLI::Option* router_aux_loss_coef = nullptr;
  CLI::Option* experts = nullptr;
  CLI::Option* experts_per_token = nullptr;
  CLI::Option* expert_width = nullptr;
  CLI::Option* tie_option = nullptr;
  CLI::Option* untie_option = nullptr;
  CLI::Option* vocab = nullptr;
  CLI::Option* tensorboard_option = nullptr;
  CLI::Option* report_option = nullptr;
  CLI::Option* log_option = nullptr;

  // A trainer setting (by its name in the settings table) given on the command line.
  bool given_on_command_line(std::string_view name) const;
};

// Declares every option of coshard-train on `app`, bound to `o` and `cl`, in --help's order.
void add_options(CLI::App& app, Options& o, CommandLine& cl);

}  // namespace coshard::train_app
