// The three places of a parameter shard (shard_placement.hpp). The NVMe reads themselves are
// param_reads.cpp's.
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

async::Task<Result<void>> ShardPlacement::make_ready(Engine::State&, Unit&) { co_return Result<void>{}; }
async::Task<Result<void>> ShardPlacement::settle(Engine::State&) { co_return Result<void>{}; }

namespace {

// On the device or in pinned host memory: the shard is a tensor of the unit.
class ShardsInMemory final : public ShardPlacement {
 public:
  explicit ShardsInMemory(bool device) : device_(device) {}
  Result<void> allocate(Engine::State& s, Unit& u) override {
    const Shape shard_shape{u.info.shard};
    const auto shard_bytes = static_cast<std::size_t>(u.info.shard) * s.element_size;
    if (!device_) {
      if (!s.swapped()) return {};  // the optimizer placement's pinned master or copy is the shard
      COSHARD_TRY_ASSIGN(u.host_param_block, s.pinned->acquire(shard_bytes));
      u.shard = Tensor(u.host_param_block.data(), shard_shape, s.o.dtype, async::Device::cpu());
      return {};
    }
    return s.residence->allocate_on_device(s, u);
  }
  Result<const void*> source(const Unit& u) const override { return static_cast<const void*>(u.shard.data()); }
  bool on_device() const noexcept override { return device_; }
  Result<void> write(Engine::State& s, Unit& u, std::span<const std::byte> mine) override {
    return s.ctx->copy_from_host(u.shard, mine);
  }

 private:
  bool device_;
};

class ShardsOnNvme final : public ShardPlacement {
 public:
  // offload_params.buffer_count slots, one per shard read from its start to its gather.
  Result<void> setup(Engine::State& s) override {
    s.read_slots = async::StreamBudget::create(static_cast<std::size_t>(s.o.offload_params.buffer_count));
    return {};
  }
  Result<void> allocate(Engine::State&, Unit&) override { return {}; }  // the shard is in its swap file
  bool ready(const Unit& u) const override { return static_cast<bool>(u.read_block); }
  async::Task<Result<void>> make_ready(Engine::State& s, Unit& u) override { co_return co_await s.ensure_read(u); }
  Result<const void*> source(const Unit& u) const override {
    if (!u.read_block)
      return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " gathered before its shard was read");
    return static_cast<const void*>(u.read_block.data());
  }
  bool on_device() const noexcept override { return false; }
  // The read buffer and its slot come back once the copy out of it has passed.
  Result<void> gathered(Engine::State& s, Unit& u, const async::Event& done) override {
    u.read_block.release_after(done);
    return s.read_slots->release_after(done, std::move(u.read_slot));
  }
  // Straight into the swap files: the optimizer placement's masters_from_shards takes them.
  Result<void> write(Engine::State& s, Unit&, std::span<const std::byte> mine) override {
    s.pending_shards.emplace_back(mine.begin(), mine.end());
    return {};
  }
  Result<void> read_ahead(Engine::State& s) override { return s.read_ahead(); }
  async::Task<Result<void>> settle(Engine::State& s) override { co_return co_await s.drain_reads(); }
};

}  // namespace

std::unique_ptr<ShardPlacement> make_shards_on_device() { return std::make_unique<ShardsInMemory>(true); }
std::unique_ptr<ShardPlacement> make_shards_on_host() { return std::make_unique<ShardsInMemory>(false); }
std::unique_ptr<ShardPlacement> make_shards_on_nvme() { return std::make_unique<ShardsOnNvme>(); }

}  // namespace coshard::zero
