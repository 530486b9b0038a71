// Parameters on NVMe: each shard is its master at the head of its unit's swap file, read ahead
// along the trace into a pinned buffer (offload_params.buffer_count slots), rounded to bf16/f16 on the host
// stream, and its buffer and slot handed back once the gather that copied out of it has passed.
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

async::Task<Result<offload::PinnedBlock>> Engine::State::read_shard(std::shared_ptr<offload::NvmeStore> store,
                                                            std::shared_ptr<offload::PinnedPool> pool,
                                                            std::string file, std::size_t bytes) {
  COSHARD_CO_TRY_ASSIGN(auto block, pool->acquire(bytes));
  // The whole page-rounded buffer: the swap file is padded to whole pages past the master.
  COSHARD_CO_TRY(co_await store->read(std::move(file), 0, block.pages()));
  co_return block;
}

Result<void> Engine::State::start_read(Unit& u, async::Semaphore::Permit slot) {
  async::Runtime* rt = async::Runtime::current();
  if (!rt) return fail(ErrorCode::internal, "Engine: a parameter read outside a runtime");
  const auto bytes = static_cast<std::size_t>(u.info.shard) * sizeof(float);  // the fp32 master
  u.read = rt->spawn(read_shard(store, pinned, subgroups[u.index].name, bytes));
  u.read_slot = std::move(slot);
  return {};
}

async::Task<Result<void>> Engine::State::ensure_read(Unit& u) {
  if (u.read_block) co_return Result<void>{};
  if (!u.read.valid()) {
    auto slot = read_slots->semaphore().try_acquire(1);
    if (!slot) {
      // Every slot is taken: by reads for units further along (the order departed from the
      // trace), which are dropped, or by gathers in flight, which give theirs back as they pass.
      COSHARD_CO_TRY(co_await drain_reads());
      slot = read_slots->semaphore().try_acquire(1);
    }
    if (!slot) {
      COSHARD_CO_TRY_ASSIGN(auto freed, co_await read_slots->semaphore().acquire(1));
      slot = std::move(freed);
    }
    COSHARD_CO_TRY(start_read(u, std::move(*slot)));
  }
  auto handle = std::move(u.read);
  auto block = co_await handle;
  if (!block) {
    u.read_slot.release();
    co_return fail(std::move(block).error().with_context("reading the parameters of unit " + u.info.name));
  }
  u.read_block = std::move(*block);
  stats.swap_bytes += u.read_block.size();
  if (narrow()) {  // bf16/f16: the master rounded, in place, on the host stream (off the reactor)
    const auto n = static_cast<std::size_t>(u.info.shard);
    void* data = u.read_block.data();
    const DataType dt = o.dtype;
    COSHARD_CO_TRY(host_stream->launch([data, n, dt] { modules::detail::narrow_in_place(data, n, dt); }));
    COSHARD_CO_TRY_ASSIGN(auto narrowed, host_stream->record());
    COSHARD_CO_TRY(co_await narrowed);
  }
  co_return Result<void>{};
}

Result<void> Engine::State::read_ahead() {
  if (!trace) return {};
  for (std::size_t i = trace_pos; i < trace->size(); ++i) {
    Unit& v = *units[(*trace)[i]];
    if (v.gather != Gather::released || v.read_block || v.read.valid()) continue;
    auto slot = read_slots->semaphore().try_acquire(1);
    if (!slot) break;
    COSHARD_TRY(start_read(v, std::move(*slot)));
  }
  return {};
}

async::Task<Result<void>> Engine::State::drain_reads() {
  Result<void> first{};
  for (auto& u : units) {
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

}  // namespace coshard::zero
