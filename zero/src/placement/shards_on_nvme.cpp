// Parameters on NVMe: each shard is its master at the head of its unit's swap file, read ahead
// along the trace into a pinned buffer (offload_params.buffer_count slots), rounded to bf16/f16 on the host
// stream, and its buffer and slot handed back once the gather that copied out of it has passed.
#include "coshard/async/runtime.hpp"
#include "coshard/async/stream_budget.hpp"
#include "kernels/half_convert.hpp"
#include "placement/shard_placement.hpp"

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
  Result<void> setup(const ShardWiring& w) override {
    read_slots_ = async::StreamBudget::create(static_cast<std::size_t>(w.buffer_count));
    return {};
  }
  Result<void> allocate(const ShardWiring&, FetchUnit&) override { return {}; }  // the shard is in its swap file
  bool ready(const FetchUnit& u) const override { return static_cast<bool>(u.read_block); }
  // The read started ahead, or one now.
  async::Task<Result<void>> make_ready(const ShardWiring& w, FetchUnit& u) override;
  Result<const void*> source(const FetchUnit& u) const override {
    if (!u.read_block)
      return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " gathered before its shard was read");
    return static_cast<const void*>(u.read_block.data());
  }
  bool on_device(const FetchUnit&) const noexcept override { return false; }
  // The read buffer and its slot come back once the copy out of it has passed.
  Result<void> gathered(FetchUnit& u, const async::Event& done) override {
    u.read_block.release_after(done);
    return read_slots_->release_after(done, std::move(u.read_slot));
  }
  // Straight into the swap files, unit by unit: the optimizer placement's masters_from_shards
  // calls it as it writes each.
  Result<void> write_all(const ShardWiring& w, BlockSource block_of) override {
    w.shard_values = std::move(block_of);
    return {};
  }
  // Starts reads for the units next in the trace that are neither gathered nor read, while slots
  // are free (never waits: a read that must happen now is make_ready's).
  Result<void> read_ahead(const ShardWiring& w) override;
  // Every read finished, unused buffers back (before the optimizer rewrites the swap files).
  async::Task<Result<void>> settle(const ShardWiring& w) override;

 private:
  Result<void> start_read(const ShardWiring& w, FetchUnit& u, async::Semaphore::Permit slot);
  std::shared_ptr<async::StreamBudget> read_slots_;
};

Result<void> ShardsOnNvme::start_read(const ShardWiring& w, FetchUnit& u, async::Semaphore::Permit slot) {
  async::Runtime* rt = async::Runtime::current();
  if (!rt) return fail(ErrorCode::internal, "Engine: a parameter read outside a runtime");
  const auto bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);  // the fp32 master
  u.read = rt->spawn(read_shard(w.store, w.pinned, w.swap_files[u.index], bytes));
  u.read_slot = std::move(slot);
  return {};
}

async::Task<Result<void>> ShardsOnNvme::make_ready(const ShardWiring& w, FetchUnit& u) {
  if (u.read_block) co_return Result<void>{};
  if (!u.read.valid()) {
    auto slot = read_slots_->semaphore().try_acquire(1);
    if (!slot) {
      // Every slot is taken: by reads for units further along (the order departed from the
      // trace), which are dropped, or by gathers in flight, which give theirs back as they pass.
      COSHARD_CO_TRY(co_await settle(w));
      slot = read_slots_->semaphore().try_acquire(1);
    }
    if (!slot) {
      COSHARD_CO_TRY_ASSIGN(auto freed, co_await read_slots_->semaphore().acquire(1));
      slot = std::move(freed);
    }
    COSHARD_CO_TRY(start_read(w, u, std::move(*slot)));
  }
  auto handle = std::move(u.read);
  auto block = co_await handle;
  if (!block) {
    u.read_slot.release();
    co_return fail(std::move(block).error().with_context("reading the parameters of unit " + u.info.name));
  }
  u.read_block = std::move(*block);
  w.stats.swap_bytes += u.read_block.size();
  if (w.io.dtype != DataType::f32) {  // bf16/f16: the master rounded, in place, on the host stream (off the reactor)
    const auto n = static_cast<std::size_t>(u.info.shard);
    void* data = u.read_block.data();
    const DataType dt = w.io.dtype;
    COSHARD_CO_TRY(w.host_stream->launch([data, n, dt] { modules::detail::narrow_in_place(data, n, dt); }));
    COSHARD_CO_TRY_ASSIGN(auto narrowed, w.host_stream->record());
    COSHARD_CO_TRY(co_await narrowed);
  }
  co_return Result<void>{};
}

Result<void> ShardsOnNvme::read_ahead(const ShardWiring& w) {
  const auto order = w.trace.order();
  for (std::size_t i = w.trace.pos(); i < order.size(); ++i) {
    FetchUnit& v = *w.units[order[i]];
    // (a unit holding its secondary slice gathers from it: its shard is not read this step)
    if (v.gather != Gather::released || v.read_block || v.read.valid() || v.secondary_holds) continue;
    auto slot = read_slots_->semaphore().try_acquire(1);
    if (!slot) break;
    COSHARD_TRY(start_read(w, v, std::move(*slot)));
  }
  return {};
}

async::Task<Result<void>> ShardsOnNvme::settle(const ShardWiring& w) {
  Result<void> first{};
  for (auto& u : w.units) {
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
