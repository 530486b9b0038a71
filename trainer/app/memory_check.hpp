// coshard-train's memory estimate: what each rank of the run will hold (device, pinned and
// pageable host, NVMe), from the model's shape and the configuration alone, against what this
// machine offers; printed by --estimate, and checked before every run so a plan that cannot fit
// is refused with the numbers instead of growing until the system stops it.
#pragma once

#include <algorithm>
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

// Whether an estimate leaves a tenth of the device's free memory unclaimed (false where the
// device's free memory is unknown: the CPU, or a machine that could not be read).
inline bool fits_with_headroom(const RunMemory& memory, int ranks_here) {
  if (!memory.machine || !memory.machine->device_bytes) return false;
  const double need = static_cast<double>(memory.per_rank.bytes(zero::MemoryPlace::device)) * std::max(ranks_here, 1);
  return need <= 0.9 * static_cast<double>(*memory.machine->device_bytes);
}

// coshard-train's attention when --attention is not given. On a GPU where the fused kernels would
// run, with heads of 128 or more: materialized (the T x T probabilities kept) wherever the run fits
// with it, with headroom. Measured on an H200 (#37): at head size 128 the materialized form ran a
// layer's forward and backward 2.7 times faster than the fused kernels; at 64 they were even (and
// whole training steps of Llama-3.2-1B and GPT-2 1.5B ran as fast or faster fused, with 19-24 GB
// less device memory), so smaller heads stay fused. Elsewhere, and where it would not fit:
// config.attention as it is. Returns the chosen kernels with their estimate.
inline constexpr std::int64_t kMaterializedFromHeadSize = 128;
struct AttentionChoice {
  modules::AttentionKernels kernels;
  RunMemory memory;
};
Result<AttentionChoice> choose_attention(const trainer::TrainerConfig& config, const RunShape& shape,
                                         RunMemory as_configured);

}  // namespace coshard::train_app
