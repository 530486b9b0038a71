// The three residences of parameter_residence.hpp.
#include "parameter_residence.hpp"

#include <algorithm>

#include "stream_order.hpp"

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
  Result<void> bind_at_creation(const ResidenceWiring&, FetchUnit& u) override { return u.bind(u.full); }
  async::Task<Result<void>> acquire(const ResidenceWiring&, FetchUnit&) override { co_return Result<void>{}; }
  Result<void> after_use(const ResidenceWiring&, FetchUnit&) override { return {}; }
  Result<void> end_pass(const ResidenceWiring&) override { return {}; }
  const Tensor& values(const FetchUnit& u) const override { return u.full; }
  Result<void> allocate_on_device(const ResidenceWiring& w, FetchUnit& u) override {
    auto& stream = w.io.ctx.stream();
    COSHARD_TRY_ASSIGN(u.full_block, w.io.ctx.allocator().allocate(u.info.padded_bytes, stream));
    u.full = Tensor(u.full_block.data(), Shape{u.info.padded}, w.io.dtype, w.io.ctx.device());
    COSHARD_TRY(stream.fill(u.full.data(), 0, u.info.padded_bytes));
    u.shard = u.full.slice(u.block_offset, Shape{u.info.shard});  // unsharded: the whole unit
    return {};
  }
  bool holds_whole() const noexcept override { return true; }
};

class WholeUnsharded final : public Whole {
 public:
  Result<void> after_step(const ResidenceWiring&) override { return {}; }  // stepped whole
  async::Task<Result<void>> follow_shards(const ResidenceWiring&) override { co_return Result<void>{}; }  // the block is the copy
  bool sharded() const noexcept override { return false; }
};

class WholeGatheredAfterStep final : public Whole {
 public:
  // Every rank gets the updated parameters, in one launch.
  Result<void> after_step(const ResidenceWiring& w) override { return gather_full_copies(w); }
  async::Task<Result<void>> follow_shards(const ResidenceWiring& w) override {
    auto& compute = w.io.ctx.stream();
    auto& cs = w.io.world.stream();
    COSHARD_CO_TRY(order(compute, cs));
    COSHARD_CO_TRY(gather_full_copies(w));
    COSHARD_CO_TRY(order(cs, compute));
    co_return Result<void>{};
  }
  bool sharded() const noexcept override { return true; }

 private:
  // Every rank's shard into every rank's full copy, in one launch per shard group on the
  // communication stream (after what is enqueued there).
  static Result<void> gather_full_copies(const ResidenceWiring& w) {
    auto& cs = w.io.world.stream();
    COSHARD_TRY_ASSIGN(auto started, w.timeline.mark(cs));
    COSHARD_TRY(launch_by_group(w.io.world, w.groups, w.units, false, [&](FetchUnit& u, collectives::Coalesced& group) {
      group.all_gather(u.shard.data(), u.full.data(), static_cast<std::size_t>(u.info.shard), w.io.dtype)
          .purpose(u.gather_purpose);
      w.stats.gathered_bytes += u.info.padded_bytes;
    }));
    COSHARD_TRY_ASSIGN(auto finished, w.timeline.mark(cs));
    w.timeline.span(false, "all_gather", kParameters, std::move(started), std::move(finished));
    return {};
  }
};

class GatheredOnUse final : public ParameterResidence {
 public:
  // This rank's shards (unless offloaded), and the gathered units, never more than max_live_bytes.
  void estimate(MemoryEstimate& m, const ParameterSizes& p, const EngineOptions& o) const override {
    m.add(MemoryPlace::device, "parameter shards (" + std::string(collectives::to_string(o.dtype)) + ")", p.shards_on_device);
    m.add(MemoryPlace::device, "gathered parameters (max_live_bytes)", std::min(p.whole, o.max_live_bytes));
  }
  Result<void> bind_at_creation(const ResidenceWiring&, FetchUnit&) override { return {}; }  // bound when gathered
  async::Task<Result<void>> acquire(const ResidenceWiring& w, FetchUnit& u) override { co_return co_await w.gathers.fetch(u); }
  Result<void> after_use(const ResidenceWiring& w, FetchUnit& u) override {
    if (w.gathers.keep_after_use(u)) return {};
    return w.gathers.release(u);
  }
  Result<void> end_pass(const ResidenceWiring& w) override {
    for (auto& u : w.units) COSHARD_TRY(w.gathers.release(*u));
    return {};
  }
  Result<void> after_step(const ResidenceWiring&) override { return {}; }  // gathered at the next use
  async::Task<Result<void>> follow_shards(const ResidenceWiring&) override { co_return Result<void>{}; }
  const Tensor& values(const FetchUnit& u) const override { return u.gathered; }
  Result<void> allocate_on_device(const ResidenceWiring& w, FetchUnit& u) override {
    const auto bytes = static_cast<std::size_t>(u.info.shard) * w.io.element_size();
    COSHARD_TRY_ASSIGN(u.shard_block, w.io.ctx.allocator().allocate(bytes, w.io.ctx.stream()));
    u.shard = Tensor(u.shard_block.data(), Shape{u.info.shard}, w.io.dtype, w.io.ctx.device());
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
