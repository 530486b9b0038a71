// What a ZeRO plan holds per rank, before anything is allocated: bytes on the compute device, in
// pinned and in pageable host memory, and on NVMe, item by item (DeepSpeed's
// estimate_zero3_model_states_mem_needs, for the whole plan). Engine::create refuses a plan the
// machine cannot hold, with the numbers, instead of growing until the system stops it; a trainer
// adds what only it knows (activations, checkpoint staging) and checks the sum the same way.
//
//   auto estimate = estimate_engine_memory(model, world, options, optimizer.state_tensors());
//   estimate->add(MemoryPlace::device, "activations", gpt_activation_bytes(gpt, rows, dtype));
//   auto machine = machine_memory(device, options.offload_optimizer.nvme_path);
//   if (auto ok = check_fits(*estimate, ranks_in_this_process, *machine); !ok) ...
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/device.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero {

enum class MemoryPlace : std::uint8_t {
  device,         // the compute device (the host's own memory when the device is the CPU)
  pinned_host,    // page-locked host memory (offload buffers, checkpoint staging)
  pageable_host,  // ordinary host memory
  nvme,           // files on the NVMe offload folder
};
std::string_view to_string(MemoryPlace p) noexcept;

struct MemoryItem {
  MemoryPlace place = MemoryPlace::device;
  std::string what;
  std::size_t bytes = 0;
};

// Per rank.
struct MemoryEstimate {
  std::vector<MemoryItem> items;
  std::vector<std::string> notes;  // what the lines do not show (e.g. what frozen units leave out)

  void add(MemoryPlace place, std::string what, std::size_t bytes);
  std::size_t bytes(MemoryPlace place) const noexcept;
  // One line per place with its total, its items indented below it (places with nothing left out),
  // then the notes.
  std::string describe() const;
};

// The fetch units Engine::create would make of `model` (the same names, sizes and padding, and
// with a device_memory_budget the same placement), without making anything. optimizer_states:
// the optimizer's state tensors (Optimizer::state_tensors(): 2 for AdamW), which a budget places.
Result<std::vector<FetchUnitInfo>> plan_units(Module& model, int world_size, const EngineOptions& options,
                                              std::size_t optimizer_states = 2);

// The engine's own holdings for `model` at `world_size` ranks with `options`: parameters (whole
// or shards), gathered parameters within max_live_bytes, gradients (whole, in flight, shards),
// fp32 masters and optimizer state (optimizer_states: Optimizer::state_tensors()), offload
// buffers and swap files. Activations are the model's, not counted here. Fails as Engine::create
// would on a plan it refuses (no parameters, max_live_bytes under the largest unit).
Result<MemoryEstimate> estimate_engine_memory(Module& model, int world_size, const EngineOptions& options,
                                              std::size_t optimizer_states);

// What this machine offers a process now.
struct MachineMemory {
  // Host memory this process may still use: the available memory (/proc/meminfo MemAvailable),
  // capped by its cgroup's memory.max and by RLIMIT_AS/RLIMIT_DATA, less what it already uses.
  std::size_t host_bytes = 0;
  // The compute device's free memory; none when the device is the CPU (its memory is the host's).
  std::optional<std::size_t> device_bytes;
  std::string device;  // "cpu", "cuda:0"
  // Free space for the NVMe offload folder (its nearest existing parent); none without one.
  std::optional<std::size_t> nvme_free_bytes;
  std::filesystem::path nvme_path;

  std::string describe() const;
};
Result<MachineMemory> machine_memory(async::Device device, const std::filesystem::path& nvme_path = {});

// Whether `ranks` ranks of one process (threads sharing the host, and the device) each holding
// `per_rank` fit: the first place that does not is named with both numbers.
Result<void> check_fits(const MemoryEstimate& per_rank, int ranks, const MachineMemory& machine);

// "1.50 GiB", "512 B": bytes for people (binary units, three significant digits).
std::string format_bytes(std::size_t bytes);

}  // namespace coshard::zero
