// The readers of a DeepSpeed config's sections (deepspeed_sections.cpp), each onto a TrainerConfig
// through a ConfigReader, which keeps what is unknown, bad or accepted without effect. `element`:
// the compute dtype's size, the unit in which DeepSpeed counts the table's sizes.
#pragma once

#include <cstddef>

#include <nlohmann/json.hpp>

#include "coshard/trainer/config.hpp"
#include "deepspeed_reader.hpp"

namespace coshard::trainer::detail {

// fp16 and bf16 of a whole config (`doc`): read before the rest, since the dtype sizes `element`.
void read_precision(ConfigReader& r, const nlohmann::json& doc, TrainerConfig& c);
// zero_optimization; `whole`: a section of a whole config (else the bare section, keys named as is).
void read_zero_optimization(ConfigReader& r, const nlohmann::json& section, bool whole, TrainerConfig& c,
                            std::size_t element);
void read_optimizer(ConfigReader& r, const nlohmann::json& section, TrainerConfig& c, std::size_t element);
void read_scheduler(ConfigReader& r, const nlohmann::json& section, TrainerConfig& c);
void read_tensorboard(ConfigReader& r, const nlohmann::json& section, TrainerConfig& c);
void read_activation_checkpointing(ConfigReader& r, const nlohmann::json& section, TrainerConfig& c);
void read_tensor_parallel(ConfigReader& r, const nlohmann::json& section, TrainerConfig& c, std::size_t element);

}  // namespace coshard::trainer::detail
