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
//
// Each acts on the units through ShardWiring, never the engine's whole state.
#pragma once

#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/event.hpp"
#include "coshard/async/task.hpp"
#include "coshard/offload/nvme_store.hpp"
#include "coshard/offload/pinned_pool.hpp"
#include "coshard/zero/engine.hpp"
#include "fetch_trace.hpp"
#include "fetch_unit.hpp"
#include "parameter_residence.hpp"

namespace coshard::zero {

struct ShardWiring;

class ShardPlacement {
 public:
  virtual ~ShardPlacement() = default;
  // What the placement needs before any unit gets storage (NVMe: the read slots).
  virtual Result<void> setup(const ShardWiring&) { return {}; }
  // u's storage when the engine is made: on the device its shard (stage 3) or its full copy with
  // the shard a view of it (stages 1-2); in host memory a pinned copy in the compute dtype when
  // the optimizer is on NVMe (otherwise the shard is the optimizer placement's pinned buffer); on
  // NVMe nothing.
  virtual Result<void> allocate(const ShardWiring& w, detail::FetchUnit& u) = 0;
  // Whether u's shard can be gathered now, with nothing to await first (NVMe: its read is in).
  virtual bool ready(const detail::FetchUnit&) const { return true; }
  // Makes it so (NVMe: the read started ahead, or one now).
  virtual async::Task<Result<void>> make_ready(const ShardWiring&, detail::FetchUnit&);
  // Where a gather reads this rank's shard, and whether that is device memory.
  virtual Result<const void*> source(const detail::FetchUnit& u) const = 0;
  virtual bool on_device(const detail::FetchUnit& u) const noexcept = 0;
  // A gather that read `source` is enqueued, `done` its event.
  virtual Result<void> gathered(detail::FetchUnit&, const async::Event&) { return {}; }
  // This rank's block of every unit, in the compute dtype, from `block_of` (initialisation, a
  // load): written now (in memory), or called unit by unit as the optimizer placement's
  // masters_from_shards writes the swap files (NVMe: one unit's values in host memory at a time,
  // not the model's). `block_of` lives until masters_from_shards has returned.
  using BlockSource = std::function<Result<std::vector<std::byte>>(const detail::FetchUnit&)>;
  virtual Result<void> write_all(const ShardWiring& w, BlockSource block_of) = 0;
  // Reads for the units next along the trace, while there is room (never waits).
  virtual Result<void> read_ahead(const ShardWiring&) { return {}; }
  // Nothing read ahead is left in flight (a pass ends; the swap files are about to be rewritten).
  virtual async::Task<Result<void>> settle(const ShardWiring&);
};

// What a shard placement acts through: the units and their io, the fetch trace (what to read
// ahead), the step's counters, the parameter residence (a shard on the device is its storage),
// and what the optimizer placement made before the units got storage: the pinned pool, the NVMe
// store with each unit's swap file, the host stream; and `shard_values`, where NVMe shards leave
// their values for the optimizer placement's masters_from_shards.
struct ShardWiring {
  detail::UnitIo io;
  const std::vector<std::unique_ptr<detail::FetchUnit>>& units;
  const detail::FetchTrace& trace;
  EngineStepStats& stats;
  ParameterResidence& residence;
  ResidenceWiring residence_wiring;
  bool optimizer_on_nvme;
  const std::shared_ptr<offload::PinnedPool>& pinned;
  const std::shared_ptr<offload::NvmeStore>& store;
  const std::vector<std::string>& swap_files;
  async::Stream* host_stream;
  int buffer_count;  // offload_params.buffer_count: the shards read at once (NVMe)
  ShardPlacement::BlockSource& shard_values;
};

// On the device or in pinned host memory, as each unit's FetchUnitInfo::shard_offloaded says.
std::unique_ptr<ShardPlacement> make_shards_in_memory();
std::unique_ptr<ShardPlacement> make_shards_on_nvme();

}  // namespace coshard::zero
