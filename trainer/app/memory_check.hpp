// coshard-train's memory estimate: what each rank of the run will hold (device, pinned and
// pageable host, NVMe), from the model's shape and the configuration alone, against what this
// machine offers; printed by --estimate, and checked before every run so a plan that cannot fit
// is refused with the numbers instead of growing until the system stops it.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "coshard/async/device.hpp"
#include "model_choice.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "coshard/trainer/config.hpp"

namespace coshard::train_app {

struct RunShape {
  ModelChoice model;
  std::int64_t batch = 0;  // global rows a step
  std::int64_t seq = 0;
  int world = 1;           // ranks in all
  int ranks_here = 1;      // ranks in this process (threads share its host memory and device)
  async::Device device = async::Device::cpu();
  bool checkpoints = false;
  bool export_model = false;
};

struct RunMemory {
  zero::MemoryEstimate per_rank;
  std::optional<zero::MachineMemory> machine;  // none when it could not be read
  std::string machine_error;                      // then: why
};

Result<RunMemory> estimate_run(const trainer::TrainerConfig& config, const RunShape& shape);
// The estimate, this process's totals and the machine, as --estimate prints them.
std::string describe_run(const RunMemory& memory, const RunShape& shape, const trainer::TrainerConfig& config);
// Fails naming the first place that cannot hold the run (nothing to check without the machine).
Result<void> check_run(const RunMemory& memory, const RunShape& shape);

}  // namespace coshard::train_app
