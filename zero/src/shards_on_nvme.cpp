// Parameters on NVMe: each shard is its master at the head of its unit's swap file, read ahead
// along the trace into a pinned buffer (offload_params.buffer_count slots), rounded to bf16/f16 on the host
// stream, and its buffer and slot handed back once the gather that copied out of it has passed.
#include "engine_state.hpp"
#include "shard_placement.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

namespace {

async::Task<Result<offload::PinnedBlock>> read_shard(std::shared_ptr<offload::NvmeStore> store,
                                                     std::shared_ptr<offload::PinnedPool> pool, std::string file,
                                                     std::size_t bytes) {
  COSHARD_CO_TRY_ASSIGN(auto block, pool->acquire(bytes));
  // The whole page-rounded buffer: the swap file is padded to whole pages past the master.
  COSHARD_CO_TRY(co_await store->read(std::move(file), 0, block.pages()));
  co_return block;
}

class ShardsOnNvme final : public ShardPlacement {
 public:
  // offload_params.buffer_count slots, one per shard read from its start to its gather.
  Result<void> setup(Engine::State& s) override {
    read_slots_ = async::StreamBudget::create(static_cast<std::size_t>(s.o.offload_params.buffer_count));
    return {};
  }
  Result<void> allocate(Engine::State&, FetchUnit&) override { return {}; }  // the shard is in its swap file
  bool ready(const FetchUnit& u) const override { return static_cast<bool>(u.read_block); }
  // The read started ahead, or one now.
  async::Task<Result<void>> make_ready(Engine::State& s, FetchUnit& u) override;
  Result<const void*> source(const FetchUnit& u) const override {
    if (!u.read_block)
      return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " gathered before its shard was read");
    return static_cast<const void*>(u.read_block.data());
  }
  bool on_device(const FetchUnit&) const noexcept override { return false; }
  // The read buffer and its slot come back once the copy out of it has passed.
  Result<void> gathered(Engine::State&, FetchUnit& u, const async::Event& done) override {
    u.read_block.release_after(done);
    return read_slots_->release_after(done, std::move(u.read_slot));
  }
  // Straight into the swap files, unit by unit: the optimizer placement's masters_from_shards
  // calls it as it writes each.
  Result<void> write_all(Engine::State& s, BlockSource block_of) override {
    s.shard_values = std::move(block_of);
    return {};
  }
  // Starts reads for the units next in the trace that are neither gathered nor read, while slots
  // are free (never waits: a read that must happen now is make_ready's).
  Result<void> read_ahead(Engine::State& s) override;
  // Every read finished, unused buffers back (before the optimizer rewrites the swap files).
  async::Task<Result<void>> settle(Engine::State& s) override;

 private:
  Result<void> start_read(Engine::State& s, FetchUnit& u, async::Semaphore::Permit slot);
  std::shared_ptr<async::StreamBudget> read_slots_;
};

Result<void> ShardsOnNvme::start_read(Engine::State& s, FetchUnit& u, async::Semaphore::Permit slot) {
  async::Runtime* rt = async::Runtime::current();
  if (!rt) return fail(ErrorCode::internal, "Engine: a parameter read outside a runtime");
  const auto bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);  // the fp32 master
  u.read = rt->spawn(read_shard(s.store, s.pinned, s.swap_files[u.index], bytes));
  u.read_slot = std::move(slot);
  return {};
}

async::Task<Result<void>> ShardsOnNvme::make_ready(Engine::State& s, FetchUnit& u) {
  if (u.read_block) co_return Result<void>{};
  if (!u.read.valid()) {
    auto slot = read_slots_->semaphore().try_acquire(1);
    if (!slot) {
      // Every slot is taken: by reads for units further along (the order departed from the
      // trace), which are dropped, or by gathers in flight, which give theirs back as they pass.
      COSHARD_CO_TRY(co_await settle(s));
      slot = read_slots_->semaphore().try_acquire(1);
    }
    if (!slot) {
      COSHARD_CO_TRY_ASSIGN(auto freed, co_await read_slots_->semaphore().acquire(1));
      slot = std::move(freed);
    }
    COSHARD_CO_TRY(start_read(s, u, std::move(*slot)));
  }
  auto handle = std::move(u.read);
  auto block = co_await handle;
  if (!block) {
    u.read_slot.release();
    co_return fail(std::move(block).error().with_context("reading the parameters of unit " + u.info.name));
  }
  u.read_block = std::move(*block);
  s.stats.swap_bytes += u.read_block.size();
  if (s.narrow()) {  // bf16/f16: the master rounded, in place, on the host stream (off the reactor)
    const auto n = static_cast<std::size_t>(u.info.shard);
    void* data = u.read_block.data();
    const DataType dt = s.o.dtype;
    COSHARD_CO_TRY(s.host_stream->launch([data, n, dt] { modules::detail::narrow_in_place(data, n, dt); }));
    COSHARD_CO_TRY_ASSIGN(auto narrowed, s.host_stream->record());
    COSHARD_CO_TRY(co_await narrowed);
  }
  co_return Result<void>{};
}

Result<void> ShardsOnNvme::read_ahead(Engine::State& s) {
  const auto order = s.trace.order();
  for (std::size_t i = s.trace.pos(); i < order.size(); ++i) {
    FetchUnit& v = *s.units[order[i]];
    if (v.gather != Gather::released || v.read_block || v.read.valid()) continue;
    auto slot = read_slots_->semaphore().try_acquire(1);
    if (!slot) break;
    COSHARD_TRY(start_read(s, v, std::move(*slot)));
  }
  return {};
}

async::Task<Result<void>> ShardsOnNvme::settle(Engine::State& s) {
  Result<void> first{};
  for (auto& u : s.units) {
    if (u->read.valid()) {
      auto handle = std::move(u->read);
      auto block = co_await handle;
      if (!block && first) first = fail(std::move(block).error());
    }
    u->read_block.reset();
    u->read_slot.release();
  }
  co_return first;
}

}  // namespace

std::unique_ptr<ShardPlacement> make_shards_on_nvme() { return std::make_unique<ShardsOnNvme>(); }

}  // namespace coshard::zero
