// The three residences of parameter_residence.hpp.
#include "parameter_residence.hpp"

#include <algorithm>

#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

namespace {

// Stages 0-2: the whole unit is on every rank for the engine's life; its modules stay bound to it.
class Whole : public ParameterResidence {
 public:
  void estimate(MemoryEstimate& m, const ParameterSizes& p, const EngineOptions& o) const override {
    m.add(MemoryPlace::device, "parameters (" + std::string(collectives::to_string(o.dtype)) + ", whole)", p.whole);
  }
  Result<void> bind_at_creation(Engine::State&, FetchUnit& u) override { return u.bind(u.full); }
  async::Task<Result<void>> acquire(Engine::State&, FetchUnit&) override { co_return Result<void>{}; }
  Result<void> after_use(Engine::State&, FetchUnit&) override { return {}; }
  Result<void> end_pass(Engine::State&) override { return {}; }
  const Tensor& values(const FetchUnit& u) const override { return u.full; }
  Result<void> allocate_on_device(Engine::State& s, FetchUnit& u) override {
    auto& stream = s.ctx->stream();
    COSHARD_TRY_ASSIGN(u.full_block, s.ctx->allocator().allocate(u.info.padded_bytes, stream));
    u.full = Tensor(u.full_block.data(), Shape{u.info.padded}, s.o.dtype, s.ctx->device());
    COSHARD_TRY(stream.fill(u.full.data(), 0, u.info.padded_bytes));
    u.shard = u.full.slice(u.block_offset, Shape{u.info.shard});  // unsharded: the whole unit
    return {};
  }
  bool holds_whole() const noexcept override { return true; }
};

class WholeUnsharded final : public Whole {
 public:
  Result<void> after_step(Engine::State&) override { return {}; }  // stepped whole
  async::Task<Result<void>> follow_shards(Engine::State&) override { co_return Result<void>{}; }  // the block is the copy
  bool sharded() const noexcept override { return false; }
};

class WholeGatheredAfterStep final : public Whole {
 public:
  // Every rank gets the updated parameters, in one launch.
  Result<void> after_step(Engine::State& s) override { return s.gather_full_copies(); }
  async::Task<Result<void>> follow_shards(Engine::State& s) override {
    auto& compute = s.ctx->stream();
    auto& cs = s.comm->stream();
    COSHARD_CO_TRY(Engine::State::order(compute, cs));
    COSHARD_CO_TRY(s.gather_full_copies());
    COSHARD_CO_TRY(Engine::State::order(cs, compute));
    co_return Result<void>{};
  }
  bool sharded() const noexcept override { return true; }
};

class GatheredOnUse final : public ParameterResidence {
 public:
  // This rank's shards (unless offloaded), and the gathered units, never more than max_live_bytes.
  void estimate(MemoryEstimate& m, const ParameterSizes& p, const EngineOptions& o) const override {
    m.add(MemoryPlace::device, "parameter shards (" + std::string(collectives::to_string(o.dtype)) + ")", p.shards_on_device);
    m.add(MemoryPlace::device, "gathered parameters (max_live_bytes)", std::min(p.whole, o.max_live_bytes));
  }
  Result<void> bind_at_creation(Engine::State&, FetchUnit&) override { return {}; }  // bound when gathered
  async::Task<Result<void>> acquire(Engine::State& s, FetchUnit& u) override { co_return co_await s.fetch(u); }
  Result<void> after_use(Engine::State& s, FetchUnit& u) override {
    if (s.keep_after_use(u)) return {};
    return s.release(u);
  }
  Result<void> end_pass(Engine::State& s) override {
    for (auto& u : s.units) COSHARD_TRY(s.release(*u));
    return {};
  }
  Result<void> after_step(Engine::State&) override { return {}; }  // gathered at the next use
  async::Task<Result<void>> follow_shards(Engine::State&) override { co_return Result<void>{}; }
  const Tensor& values(const FetchUnit& u) const override { return u.gathered; }
  Result<void> allocate_on_device(Engine::State& s, FetchUnit& u) override {
    const auto bytes = static_cast<std::size_t>(u.info.shard) * s.element_size;
    COSHARD_TRY_ASSIGN(u.shard_block, s.ctx->allocator().allocate(bytes, s.ctx->stream()));
    u.shard = Tensor(u.shard_block.data(), Shape{u.info.shard}, s.o.dtype, s.ctx->device());
    return {};
  }
  bool holds_whole() const noexcept override { return false; }
  bool sharded() const noexcept override { return true; }
};

}  // namespace

std::unique_ptr<ParameterResidence> make_whole_unsharded() { return std::make_unique<WholeUnsharded>(); }
std::unique_ptr<ParameterResidence> make_whole_gathered_after_step() { return std::make_unique<WholeGatheredAfterStep>(); }
std::unique_ptr<ParameterResidence> make_gathered_on_use() { return std::make_unique<GatheredOnUse>(); }

std::unique_ptr<ParameterResidence> make_parameter_residence(int zero_stage) {
  if (zero_stage == 0) return make_whole_unsharded();
  if (zero_stage == 3) return make_gathered_on_use();
  return make_whole_gathered_after_step();
}

}  // namespace coshard::zero
