// Where this rank's parameter shards live (EngineOptions::offload_params, stage 3), chosen once
// when the engine is made: one interface, three implementations.
//
// - on the device: the shard is its own device buffer; a gather reads it in place. With a
//   device_memory_budget, some units' shards are on the device and the rest in pinned memory.
// - in pinned host memory (cpu): the shard is the optimizer's pinned fp32 master, or a pinned copy
//   in the compute dtype; a gather first copies it into its place in the gathered buffer on the
//   communication stream, then gathers in place (NCCL reads device memory only).
// - on NVMe: the shard is the fp32 master at the head of its unit's swap file, read ahead along
//   the trace into a pinned buffer (shards_on_nvme.cpp) and rounded to the compute dtype as it lands;
//   the buffer and its read slot come back once the gather that copied out of it has passed.
#pragma once

#include <functional>
#include <span>
#include <vector>

#include "coshard/async/event.hpp"
#include "coshard/async/task.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero {

namespace detail {
class FetchUnit;
}

class ShardPlacement {
 public:
  virtual ~ShardPlacement() = default;
  // What the placement needs before any unit gets storage (NVMe: the read slots).
  virtual Result<void> setup(Engine::State&) { return {}; }
  // u's storage when the engine is made: on the device its shard (stage 3) or its full copy with
  // the shard a view of it (stages 1-2); in host memory a pinned copy in the compute dtype when
  // the optimizer is on NVMe (otherwise the shard is the optimizer placement's pinned buffer); on
  // NVMe nothing.
  virtual Result<void> allocate(Engine::State& s, detail::FetchUnit& u) = 0;
  // Whether u's shard can be gathered now, with nothing to await first (NVMe: its read is in).
  virtual bool ready(const detail::FetchUnit&) const { return true; }
  // Makes it so (NVMe: the read started ahead, or one now).
  virtual async::Task<Result<void>> make_ready(Engine::State&, detail::FetchUnit&);
  // Where a gather reads this rank's shard, and whether that is device memory.
  virtual Result<const void*> source(const detail::FetchUnit& u) const = 0;
  virtual bool on_device(const detail::FetchUnit& u) const noexcept = 0;
  // A gather that read `source` is enqueued, `done` its event.
  virtual Result<void> gathered(Engine::State&, detail::FetchUnit&, const async::Event&) { return {}; }
  // This rank's block of every unit, in the compute dtype, from `block_of` (initialisation, a
  // load): written now (in memory), or called unit by unit as the optimizer placement's
  // masters_from_shards writes the swap files (NVMe: one unit's values in host memory at a time,
  // not the model's). `block_of` lives until masters_from_shards has returned.
  using BlockSource = std::function<Result<std::vector<std::byte>>(const detail::FetchUnit&)>;
  virtual Result<void> write_all(Engine::State& s, BlockSource block_of) = 0;
  // Reads for the units next along the trace, while there is room (never waits).
  virtual Result<void> read_ahead(Engine::State&) { return {}; }
  // Nothing read ahead is left in flight (a pass ends; the swap files are about to be rewritten).
  virtual async::Task<Result<void>> settle(Engine::State&);
};

// On the device or in pinned host memory, as each unit's FetchUnitInfo::shard_offloaded says.
std::unique_ptr<ShardPlacement> make_shards_in_memory();
std::unique_ptr<ShardPlacement> make_shards_on_nvme();

}  // namespace coshard::zero
