// Parameter shards in memory, on the device or pinned host memory (shard_placement.hpp); on
// NVMe: shards_on_nvme.cpp.
#include "placement/shard_placement.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

async::Task<Result<void>> ShardPlacement::make_ready(const ShardWiring&, FetchUnit&) { co_return Result<void>{}; }
async::Task<Result<void>> ShardPlacement::settle(const ShardWiring&) { co_return Result<void>{}; }

namespace {

// On the device or in pinned host memory, unit by unit (FetchUnitInfo::shard_offloaded: all
// alike, or split by a device_memory_budget): the shard is a tensor of the unit.
class ShardsInMemory final : public ShardPlacement {
 public:
  Result<void> allocate(const ShardWiring& w, FetchUnit& u) override {
    const Shape shard_shape{u.info.shard};
    const auto shard_bytes = static_cast<std::size_t>(u.info.shard) * w.io.element_size();
    if (u.info.shard_offloaded) {
      if (!w.optimizer_on_nvme) return {};  // the optimizer placement's pinned master or copy is the shard
      COSHARD_TRY_ASSIGN(u.host_param_block, w.pinned->acquire(shard_bytes));
      u.shard = Tensor(u.host_param_block.data(), shard_shape, w.io.dtype, async::Device::cpu());
      return {};
    }
    return w.residence.allocate_on_device(w.residence_wiring, u);
  }
  Result<const void*> source(const FetchUnit& u) const override { return static_cast<const void*>(u.shard.data()); }
  bool on_device(const FetchUnit& u) const noexcept override { return !u.info.shard_offloaded; }
  Result<void> write_all(const ShardWiring& w, BlockSource block_of) override {
    for (auto& u : w.units) {
      COSHARD_TRY_ASSIGN(const auto bytes, block_of(*u));
      COSHARD_TRY(w.io.ctx.copy_from_host(u->shard, bytes));
    }
    return {};
  }
};

}  // namespace

std::unique_ptr<ShardPlacement> make_shards_in_memory() { return std::make_unique<ShardsInMemory>(); }

}  // namespace coshard::zero
