// The optimizer's state on NVMe (ZeRO-Infinity): each unit's fp32 master and state is one
// sub-group file of the rank's claimed folder, streamed through pinned buffers by the swapper:
// read ahead, stepped on the host stream, the new shard sent to the device, written back behind.
// With the parameters on NVMe too, the master at the head of the file is the shard. bf16/f16
// shards on the device take the master cast down through the staging buffer, one unit at a time.
#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

namespace {

class OptimizerOnNvme final : public HostOptimizer {
 public:
  // Masters and state in the swap files (a frozen unit's master too); the pinned pool beside.
  void estimate(MemoryEstimate& m, const OptimizerSizes& z, std::span<const FetchUnitInfo> units, const EngineOptions& o,
                std::size_t states) const override {
    m.add(MemoryPlace::nvme, fp32_masters_label(states) + " (swap files)", (1 + states) * z.trained_f32 + z.frozen_f32);
    estimate_pinned(m, units, o, states);
  }

  // The host placement's setup, then the rank's swap folder (claimed: a second run there is
  // refused), its store and swapper, and one sub-group file per unit.
  Result<void> setup(Engine::State& s, std::span<const FetchUnitInfo> units) override {
    const EngineOptions& o = s.o;
    if (o.offload_optimizer.nvme_path.empty())
      return fail(ErrorCode::invalid_argument, "offload_optimizer=nvme: needs a folder (nvme_path)");
    COSHARD_TRY(HostOptimizer::setup(s, units));
    const std::string rank_folder = "rank" + std::to_string(s.rank) + "-of-" + std::to_string(s.world);
    auto claimed = offload::SwapFolder::claim(o.offload_optimizer.nvme_path / rank_folder,
                                              "coshard rank " + std::to_string(s.rank) + " of " + std::to_string(s.world));
    if (!claimed) return fail(std::move(claimed).error().with_context("offload_optimizer=nvme"));
    s.swap_folder = std::move(*claimed);
    offload::NvmeStoreOptions store_options;
    store_options.directory = o.offload_optimizer.nvme_path;
    store_options.direct = offload::NvmeStore::supports_direct_io(o.offload_optimizer.nvme_path);
    COSHARD_TRY_ASSIGN(s.store, offload::NvmeStore::open(store_options));
    offload::SwapperOptions swap_options;
    swap_options.buffer_count = o.offload_optimizer.buffer_count;
    COSHARD_TRY_ASSIGN(s.swapper, offload::Swapper::create(*s.store, s.pinned, swap_options));
    const std::string folder = rank_folder + "/unit";
    const std::size_t per_element = 4 * (1 + s.optimizer->state_tensors());  // master and state, f32
    // (a frozen unit's file holds its master only: the parameters, with them on nvme)
    for (std::size_t k = 0; k < units.size(); ++k) {
      const auto& u = units[k];
      s.subgroups.push_back({folder + std::to_string(k), static_cast<std::size_t>(u.shard) * (u.frozen ? sizeof(float) : per_element)});
      if (!u.frozen) s.stepped_units.push_back(k);
    }
    return {};
  }

  Result<void> add_unit(Engine::State& s, Unit& u) override {
    if (u.info.frozen) return s.optimizer->add_frozen_group(*s.host_ctx, u.info.shard);  // its file: the master only
    COSHARD_TRY(add_host_grad(s, u));
    return s.optimizer->add_swapped_group(*s.host_ctx, u.host_grad, s.segments_of(u));
  }

  async::Task<Result<void>> step(Engine::State& s, float lr) override {
    auto& compute = s.ctx->stream();
    COSHARD_CO_TRY(co_await exchange_grad_stats(s));
    if (s.stepping_in_backward) {
      // The swapper's pass has every unit now; its last copies to the device are on the
      // communication stream, which the compute stream waits for below.
      auto handle = std::move(s.swap_step);
      COSHARD_CO_TRY(co_await handle);
      s.backward_order = s.handed_order;
      COSHARD_CO_TRY(s.optimizer->finish_step(*s.host_ctx));
      COSHARD_CO_TRY_ASSIGN(auto finished, s.host_stream->record());
      COSHARD_CO_TRY(co_await Engine::State::after(compute, finished));
      co_return Engine::State::order(s.comm->stream(), compute);
    }
    // Each unit's master and state come in from NVMe (read ahead), are stepped on the host,
    // the new shard goes to the device, and the sub-group goes back (written behind).
    const auto read_before = s.swapper->stats().bytes_read, written_before = s.swapper->stats().bytes_written;
    // (frozen units are never read nor written by a step)
    std::vector<offload::SubGroup> stepped;
    for (std::size_t k : s.stepped_units) stepped.push_back(s.subgroups[k]);
    auto step_unit = [&](std::size_t i, std::span<std::byte> bytes) -> async::Task<Result<void>> {
      return s.step_swapped_unit(s.stepped_units[i], bytes, lr, compute);
    };
    COSHARD_CO_TRY(co_await s.swapper->for_each(stepped, step_unit, true));
    COSHARD_CO_TRY(s.optimizer->finish_step(*s.host_ctx));
    COSHARD_CO_TRY_ASSIGN(auto finished, s.host_stream->record());
    COSHARD_CO_TRY(co_await Engine::State::after(compute, finished));
    s.stats.swap_bytes += (s.swapper->stats().bytes_read - read_before) + (s.swapper->stats().bytes_written - written_before);
    co_return Result<void>{};
  }

  // Every sub-group written anew: the master from the shard, the state zero.
  async::Task<Result<void>> masters_from_shards(Engine::State& s) override {
    auto fill = [&s](std::size_t k, std::span<std::byte> bytes) -> async::Task<Result<void>> {
      const Unit& u = *s.units[k];
      if (s.params_on_nvme()) {  // the values were computed on the host, in the compute dtype
        if (!s.shard_values) co_return fail(ErrorCode::internal, "Engine: no values for the swap file of unit ", u.info.name);
        COSHARD_CO_TRY_ASSIGN(const auto values, s.shard_values(u));
        if (!s.narrow()) {
          std::copy(values.begin(), values.end(), bytes.begin());
          co_return Result<void>{};
        }
        co_return co_await s.cast_on_host(s.o.dtype, values.data(), DataType::f32, bytes.data(), u.info.shard);
      }
      if (!s.narrow()) {
        COSHARD_CO_TRY(s.ctx->stream().copy(bytes.data(), u.shard.data(), u.shard.bytes()));
        COSHARD_CO_TRY_ASSIGN(auto copied, s.ctx->stream().record());
        co_return co_await copied;
      }
      // bf16/f16: the shard (through the staging buffer when on the device) widened on the host.
      Tensor source = u.shard;
      if (!u.info.shard_offloaded) {
        source = s.staging_for(u);
        COSHARD_CO_TRY(s.ctx->stream().copy(source.data(), u.shard.data(), u.shard.bytes()));
      }
      COSHARD_CO_TRY_ASSIGN(auto copied, s.ctx->stream().record());
      COSHARD_CO_TRY(co_await Engine::State::after(*s.host_stream, copied));
      co_return co_await s.cast_on_host(s.o.dtype, source.data(), DataType::f32, bytes.data(), u.info.shard);
    };
    auto written = co_await s.swapper->initialize(s.subgroups, fill);
    s.shard_values = nullptr;
    co_return written;
  }

  async::Task<Result<void>> visit(Engine::State& s, const Engine::ShardVisitor& use, bool written) override {
    auto visit_group = [&s, &use, written](std::size_t k, std::span<std::byte> bytes) -> async::Task<Result<void>> {
      UnitShard shard = s.swapped_shard(k, bytes);
      const Tensor master = shard.master;
      const bool frozen = s.units[k]->info.frozen;
      if (frozen) shard.master = {};  // a frozen unit is its parameters only
      if (s.params_on_nvme() && s.narrow()) {
        // bf16/f16 on nvme: the parameters are the master rounded, made for the visit (what a load
        // writes there is dropped: the master it loads decides them; a frozen unit has none, so
        // its parameters written there are widened into the file).
        shard.params = s.staging_for(*s.units[k]);
        COSHARD_CO_TRY(co_await s.cast_on_host(DataType::f32, master.data(), s.o.dtype, shard.params.data(),
                                               shard.info.shard));
        COSHARD_CO_TRY(co_await use(shard));
        if (frozen && written)
          COSHARD_CO_TRY(co_await s.cast_on_host(s.o.dtype, shard.params.data(), DataType::f32, master.data(),
                                                 shard.info.shard));
        co_return Result<void>{};
      }
      co_return co_await use(shard);
    };
    co_return co_await s.swapper->for_each(s.subgroups, visit_group, written);
  }

  // The swapper's pass beside backward steps the unit when its sub-group is in.
  Result<void> step_in_backward(Engine::State& s, Unit& u) override { return s.hand_to_swap_step(u); }

 protected:
  Result<void> hand_over_late(Engine::State& s, Unit& u) override { return s.hand_to_swap_step(u); }
};

}  // namespace

UnitShard Engine::State::swapped_shard(std::size_t k, std::span<std::byte> bytes) const {
  const Unit& u = *units[k];
  const Shape shape{u.info.shard};
  const std::size_t states = optimizer->state_tensors();
  const auto len = static_cast<std::size_t>(u.info.shard) * sizeof(float);
  auto* base = bytes.data();
  auto view = [&](std::size_t i) { return Tensor(base + i * len, shape, DataType::f32, async::Device::cpu()); };
  if (u.info.frozen) return {u.info, params_on_nvme() ? view(0) : u.shard, view(0), {}, {}};  // its file: the master only
  return {u.info, params_on_nvme() ? view(0) : u.shard, view(0), states >= 1 ? view(1) : Tensor{},
          states >= 2 ? view(2) : Tensor{}};
}

async::Task<Result<void>> Engine::State::step_swapped_unit(std::size_t k, std::span<std::byte> bytes, float lr, async::Stream& to) {
  Unit& u = *units[k];
  const UnitShard shard = swapped_shard(k, bytes);
  const Tensor& master = shard.master;
  // bf16/f16: cast down in the same pass, into the pinned shard itself (parameters offloaded to
  // cpu: nothing left to copy) or into the staging buffer on its way to the device.
  Tensor narrowed;
  if (narrow() && !params_on_nvme()) narrowed = u.info.shard_offloaded ? u.shard : staging_for(u);
  COSHARD_CO_TRY(optimizer->apply_group(*host_ctx, first_group + k, lr, master, shard.state1, shard.state2, narrowed));
  COSHARD_CO_TRY_ASSIGN(auto stepped, host_stream->record());
  if (params_on_nvme() || (narrowed && narrowed.data() == u.shard.data())) co_return co_await stepped;
  COSHARD_CO_TRY(co_await after(to, stepped));
  COSHARD_CO_TRY(to.copy(u.shard.data(), narrowed ? narrowed.data() : master.data(), u.shard.bytes()));
  if (!u.info.shard_offloaded) stats.swap_bytes += u.shard.bytes();
  COSHARD_CO_TRY_ASSIGN(auto copied, to.record());
  co_return co_await copied;
}

std::unique_ptr<OptimizerPlacement> make_optimizer_on_nvme() { return std::make_unique<OptimizerOnNvme>(); }

}  // namespace coshard::zero
