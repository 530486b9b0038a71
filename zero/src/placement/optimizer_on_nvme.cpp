// The optimizer's state on NVMe (ZeRO-Infinity): each unit's fp32 master and state is one file of
// the rank's claimed folder, streamed through pinned buffers by the swapper in sub-groups of at
// most sub_group_size elements (a piece of the master and of each state tensor): read ahead,
// stepped on the host stream, the new piece of the shard sent to the device, written back behind.
// With the parameters on NVMe too, the master at the head of the file is the shard. bf16/f16
// shards on the device take the master cast down through the staging buffer, one unit at a time.
#include <cstring>
#include <functional>

#include "placement/offload_sizes.hpp"
#include "placement/optimizer_placement.hpp"
#include "placement/step_in_backward.hpp"
#include "tensor_parts.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

namespace {

using UnitVisit = std::function<async::Task<Result<void>>(UnitShard)>;

// A unit in several sub-groups: its master and state put together in host memory for the visit
// (read piece by piece), and written back the same way when the visit wrote them.
async::Task<Result<void>> visit_pieced_unit(const OptimizerWiring& w, std::size_t k, const UnitVisit& visit_unit, bool written) {
  const FetchUnit& u = *w.units[k];
  const std::size_t regions = u.info.frozen ? 1 : 1 + w.optimizer.state_tensors();
  const auto n = static_cast<std::size_t>(u.info.shard);
  const std::size_t first = w.swap.first_piece[k];
  const std::span<const offload::SubGroup> groups(w.swap.subgroups.data() + first, w.swap.first_piece[k + 1] - first);
  std::vector<float> whole;
  try {
    whole.resize(regions * n);
  } catch (const std::bad_alloc&) {
    co_return fail(ErrorCode::out_of_memory, "visiting unit ", u.info.name, ": no host memory for its master and state (",
                   regions * n * sizeof(float), " bytes)");
  }
  auto copy = [&](bool in) {
    return [&, in](std::size_t j, std::span<std::byte> bytes) -> async::Task<Result<void>> {
      const SwapPiece& p = w.swap.pieces[first + j];
      const std::size_t stride = detail::swap_piece_bytes(p.count, 1);
      const std::size_t length = static_cast<std::size_t>(p.count) * sizeof(float);
      for (std::size_t r = 0; r < regions; ++r) {
        auto* array = reinterpret_cast<std::byte*>(whole.data() + r * n + static_cast<std::size_t>(p.begin));
        std::byte* piece = bytes.data() + r * stride;
        if (in)
          std::memcpy(array, piece, length);
        else
          std::memcpy(piece, array, length);
      }
      co_return Result<void>{};
    };
  };
  COSHARD_CO_TRY(co_await w.swap.swapper->for_each(groups, copy(true), false));
  auto view = [&](std::size_t r) { return Tensor(whole.data() + r * n, Shape{u.info.shard}, DataType::f32, async::Device::cpu()); };
  UnitShard shard{u.info, w.params_on_nvme() ? view(0) : u.shard, view(0), regions >= 2 ? view(1) : Tensor{},
                  regions >= 3 ? view(2) : Tensor{}};
  COSHARD_CO_TRY(co_await visit_unit(std::move(shard)));
  if (written) COSHARD_CO_TRY(co_await w.swap.swapper->initialize(groups, copy(false)));
  co_return Result<void>{};
}

class OptimizerOnNvme final : public HostOptimizer {
 public:
  // Masters and state in the swap files (a frozen unit's master too); the pinned pool beside.
  void estimate(MemoryEstimate& m, const OptimizerSizes& z, std::span<const FetchUnitInfo> units, const EngineOptions& o,
                std::size_t states) const override {
    m.add(MemoryPlace::nvme, fp32_masters_label(states) + " (swap files)", (1 + states) * z.trained_f32 + z.frozen_f32);
    if (o.swap_gradients && !o.step_in_backward) m.add(MemoryPlace::nvme, "gradient shards (swap files)", z.trained_f32);
    estimate_pinned(m, units, o, states);
    if (!o.step_in_backward && !o.swap_gradients && z.trained_f32 > 0)
      m.notes.push_back("with swap_gradients (or step_in_backward, gradient clipping off) no gradient shard is kept in "
                        "pinned memory: " + format_bytes(z.trained_f32) + " of this rank's fp32 gradient shards would stay out of it");
  }

  // The host placement's setup, then the rank's swap folder (claimed: a second run there is
  // refused), its store and swapper, and one sub-group file per unit.
  Result<void> setup(const OptimizerWiring& w, std::span<const FetchUnitInfo> units) override {
    const EngineOptions& o = w.o;
    if (o.offload_optimizer.nvme_path.empty())
      return fail(ErrorCode::invalid_argument, "offload_optimizer=nvme: needs a folder (nvme_path)");
    COSHARD_TRY(HostOptimizer::setup(w, units));
    // (tensor parallelism: the tensor ranks of one data rank each hold other parts, in folders apart)
    const int tensor = tensor_size(o), tensor_rank = tensor > 1 ? o.tensor_parallel->rank() : 0;
    const std::string tensor_part = tensor > 1 ? "-tensor" + std::to_string(tensor_rank) + "-of-" + std::to_string(tensor) : "";
    const std::string rank_folder = "rank" + std::to_string(w.rank) + "-of-" + std::to_string(w.world) + tensor_part;
    auto claimed = offload::SwapFolder::claim(
        o.offload_optimizer.nvme_path / rank_folder,
        "coshard rank " + std::to_string(w.rank) + " of " + std::to_string(w.world) +
            (tensor > 1 ? ", tensor rank " + std::to_string(tensor_rank) + " of " + std::to_string(tensor) : ""));
    if (!claimed) return fail(std::move(claimed).error().with_context("offload_optimizer=nvme"));
    w.swap.folder = std::move(*claimed);
    offload::NvmeStoreOptions store_options;
    store_options.directory = o.offload_optimizer.nvme_path;
    store_options.direct = offload::NvmeStore::supports_direct_io(o.offload_optimizer.nvme_path);
    COSHARD_TRY_ASSIGN(w.swap.store, offload::NvmeStore::open(store_options));
    offload::SwapperOptions swap_options;
    swap_options.buffer_count = o.offload_optimizer.buffer_count;
    COSHARD_TRY_ASSIGN(w.swap.swapper, offload::Swapper::create(*w.swap.store, w.host.pinned, swap_options));
    const std::string folder = rank_folder + "/unit";
    const std::size_t states = w.optimizer.state_tensors();
    const std::int64_t most = detail::swap_piece_elements(o);
    // (a frozen unit's file holds its master only: the parameters, with them on nvme)
    // A gradient piece in each buffer after the master and state: copied from the device just
    // before its step (grads_through_pass: never in the file), or read from the file's gradient
    // region after the state, where the pass beside backward wrote it (grads_to_nvme).
    const bool grad_region = w.grads_wait_for_a_pass();
    // (as the estimate's "two largest in flight")
    std::size_t largest = 0, second = 0;
    for (const auto& u : units) {
      if (u.frozen) continue;
      const std::size_t b = static_cast<std::size_t>(u.shard) * sizeof(float);
      if (b > largest) {
        second = largest;
        largest = b;
      } else {
        second = std::max(second, b);
      }
    }
    w.pass.pending_limit = largest + second;
    for (std::size_t k = 0; k < units.size(); ++k) {
      const auto& u = units[k];
      const std::size_t regions = u.frozen ? 1 : 1 + states;
      const bool with_grads = grad_region && !u.frozen;
      const std::uint64_t stride = offload::page_rounded(static_cast<std::size_t>(u.shard) * sizeof(float));
      w.swap.files.push_back(folder + std::to_string(k));
      w.swap.first_piece.push_back(w.swap.subgroups.size());
      for (std::int64_t begin = 0; begin < u.shard; begin += most) {
        const std::int64_t count = std::min<std::int64_t>(most, u.shard - begin);
        offload::SubGroup group{w.swap.files.back(), detail::swap_piece_bytes(count, regions + (with_grads ? 1 : 0))};
        if (count < u.shard || with_grads)  // a piece of each array (a whole shard is the file's head: no extents)
          for (std::size_t r = 0; r < regions; ++r)
            group.extents.push_back({r * stride + static_cast<std::uint64_t>(begin) * sizeof(float),
                                     static_cast<std::size_t>(count) * sizeof(float)});
        offload::SubGroup gradient{w.swap.files.back(), 0};  // (a frozen unit's: never used)
        if (with_grads && w.grads_to_nvme()) {
          const std::size_t bytes = static_cast<std::size_t>(count) * sizeof(float);
          gradient = {w.swap.files.back(), offload::page_rounded(bytes),
                      {{regions * stride + static_cast<std::uint64_t>(begin) * sizeof(float), bytes}}};
        }
        if (!u.frozen) {
          w.swap.stepped_pieces.push_back(w.swap.subgroups.size());
          w.swap.stepped_subgroups.push_back(group);
          if (with_grads && w.grads_to_nvme()) {  // its gradient piece, read beside the master and state
            w.swap.stepped_subgroups.back().extents.push_back(gradient.extents.front());
            w.swap.stepped_subgroups.back().read_only_extents = 1;
          }
        }
        w.swap.grad_subgroups.push_back(std::move(gradient));
        w.swap.subgroups.push_back(std::move(group));
        w.swap.pieces.push_back({k, begin, count});
      }
    }
    w.swap.first_piece.push_back(w.swap.subgroups.size());
    return {};
  }

  // The host placement's start, then the pass of the swapper beside backward, when this step has
  // one: reading ahead to step (step_in_backward), or writing the gradients out (swap_gradients),
  // which adds each piece's statistics.
  async::Task<Result<void>> begin_step(const OptimizerWiring& w) override {
    COSHARD_CO_TRY(co_await HostOptimizer::begin_step(w));
    const bool pass_beside_backward = w.mode.stepping_in_backward || (w.grads_to_nvme() && w.mode.grads_out_in_backward);
    if (w.grads_to_nvme()) COSHARD_CO_TRY(w.optimizer.begin_grad_stats(*w.host.ctx));
    if (pass_beside_backward) COSHARD_CO_TRY(w.pass.start(w, w.mode.lr));
    co_return Result<void>{};
  }

  Result<void> add_unit(const OptimizerWiring& w, FetchUnit& u) override {
    if (u.info.frozen) return w.optimizer.add_frozen_group(*w.host.ctx, u.info.shard);  // its file: the master only
    if (w.grads_wait_for_a_pass()) return w.optimizer.add_swapped_group(*w.host.ctx, u.info.shard, w.settings.segments_of(u));
    COSHARD_TRY(add_host_grad(w, u));
    return w.optimizer.add_swapped_group(*w.host.ctx, u.host_grad, w.settings.segments_of(u));
  }

  async::Task<Result<void>> step(const OptimizerWiring& w, float lr) override {
    auto& compute = w.ctx().stream();
    // Gradients through the pass: it adds the statistics as it steps, so their sum comes after it.
    const bool through_pass = w.grads_through_pass();
    if (through_pass)
      COSHARD_CO_TRY(co_await local_grad_stats(w));
    else if (w.grads_to_nvme())
      COSHARD_CO_TRY(co_await gradients_out(w));
    else
      COSHARD_CO_TRY(co_await exchange_grad_stats(w));
    if (w.mode.stepping_in_backward) {
      // The swapper's pass has every unit now; its last copies to the device are on the
      // communication stream, which the compute stream waits for below.
      COSHARD_CO_TRY(co_await w.pass.finish());
    } else {
      // Each unit's master and state come in from NVMe (read ahead), are stepped on the host,
      // the new shard goes to the device, and the sub-group goes back (written behind).
      const auto read_before = w.swap.swapper->stats().bytes_read, written_before = w.swap.swapper->stats().bytes_written;
      auto step_unit = [&](std::size_t i, std::span<std::byte> bytes) -> async::Task<Result<void>> {
        return step_swapped_piece(w, w.swap.stepped_pieces[i], bytes, lr, compute);
      };
      COSHARD_CO_TRY(co_await w.swap.swapper->for_each(w.swap.stepped_subgroups, step_unit, true));
      w.stats.swap_bytes += (w.swap.swapper->stats().bytes_read - read_before) + (w.swap.swapper->stats().bytes_written - written_before);
    }
    if (through_pass) COSHARD_CO_TRY(co_await sum_grad_stats(w));
    COSHARD_CO_TRY(w.optimizer.finish_step(*w.host.ctx));
    COSHARD_CO_TRY_ASSIGN(auto finished, w.host.stream->record());
    COSHARD_CO_TRY(co_await after(compute, finished));
    if (w.mode.stepping_in_backward) co_return order(w.comm().stream(), compute);
    co_return Result<void>{};
  }

  // Every sub-group written anew: the master from the shard, the state zero.
  async::Task<Result<void>> masters_from_shards(const OptimizerWiring& w) override {
    // nvme parameters: a unit's values are made at its first piece (the pieces come in order) and
    // kept for the rest.
    std::vector<std::byte> values;
    auto fill = [&](std::size_t i, std::span<std::byte> bytes) -> async::Task<Result<void>> {
      const SwapPiece& p = w.swap.pieces[i];
      const FetchUnit& u = *w.units[p.unit];
      const std::size_t esize = w.element_size();
      if (w.params_on_nvme()) {  // the values were computed on the host, in the compute dtype
        if (!w.shard_values) co_return fail(ErrorCode::internal, "Engine: no values for the swap file of unit ", u.info.name);
        if (p.begin == 0) {
          values = {};  // (the last unit's go first)
          COSHARD_CO_TRY_ASSIGN(values, w.shard_values(u));
        }
        const std::byte* from = values.data() + static_cast<std::size_t>(p.begin) * esize;
        if (!w.narrow()) {
          std::copy(from, from + static_cast<std::size_t>(p.count) * esize, bytes.begin());
          co_return Result<void>{};
        }
        co_return co_await w.host.cast(w.o.dtype, from, DataType::f32, bytes.data(), p.count);
      }
      const auto offset = static_cast<std::size_t>(p.begin) * esize, length = static_cast<std::size_t>(p.count) * esize;
      if (!w.narrow()) {
        COSHARD_CO_TRY(w.ctx().stream().copy(bytes.data(), static_cast<const std::byte*>(u.shard.data()) + offset, length));
        COSHARD_CO_TRY_ASSIGN(auto copied, w.ctx().stream().record());
        co_return co_await copied;
      }
      // bf16/f16: the shard (through the staging buffer when on the device) widened on the host.
      const std::byte* source = static_cast<const std::byte*>(u.shard.data()) + offset;
      if (!u.info.shard_offloaded) {
        auto* staged = static_cast<std::byte*>(w.host.staging.data());
        COSHARD_CO_TRY(w.ctx().stream().copy(staged, source, length));
        source = staged;
      }
      COSHARD_CO_TRY_ASSIGN(auto copied, w.ctx().stream().record());
      COSHARD_CO_TRY(co_await after(*w.host.stream, copied));
      co_return co_await w.host.cast(w.o.dtype, source, DataType::f32, bytes.data(), p.count);
    };
    auto written = co_await w.swap.swapper->initialize(w.swap.subgroups, fill);
    w.shard_values = nullptr;
    co_return written;
  }

  // Unit by unit: a run of units of one sub-group each in one pass of the swapper (read ahead,
  // the visit on its buffer); a unit in several sub-groups is put together in host memory first
  // (its master and state whole, for the visit) and, when written, written back piece by piece.
  async::Task<Result<void>> visit(const OptimizerWiring& w, const Engine::ShardVisitor& use, bool written) override {
    UnitVisit visit_unit = [&w, &use, written](UnitShard shard) -> async::Task<Result<void>> {
      const Tensor master = shard.master;
      const bool frozen = shard.info.frozen;
      if (frozen) shard.master = {};  // a frozen unit is its parameters only
      if (w.params_on_nvme() && w.narrow()) {
        // bf16/f16 on nvme: the parameters are the master rounded, made for the visit (what a load
        // writes there is dropped: the master it loads decides them; a frozen unit has none, so
        // its parameters written there are widened into the file).
        shard.params = w.host.staging_for(shard.info.shard, w.o.dtype);
        COSHARD_CO_TRY(co_await w.host.cast(DataType::f32, master.data(), w.o.dtype, shard.params.data(),
                                               shard.info.shard));
        COSHARD_CO_TRY(co_await use(shard));
        if (frozen && written)
          COSHARD_CO_TRY(co_await w.host.cast(w.o.dtype, shard.params.data(), DataType::f32, master.data(),
                                                 shard.info.shard));
        co_return Result<void>{};
      }
      co_return co_await use(shard);
    };
    std::vector<offload::SubGroup> run;  // units of one sub-group each, in order
    std::vector<std::size_t> run_pieces;
    auto visit_run = [&]() -> async::Task<Result<void>> {
      auto visit_piece = [&](std::size_t j, std::span<std::byte> bytes) -> async::Task<Result<void>> {
        return visit_unit(swapped_shard(w, run_pieces[j], bytes));
      };
      auto visited = co_await w.swap.swapper->for_each(run, visit_piece, written);
      run.clear();
      run_pieces.clear();
      co_return visited;
    };
    for (std::size_t k = 0; k < w.units.size(); ++k) {
      const std::size_t first = w.swap.first_piece[k], end = w.swap.first_piece[k + 1];
      if (end - first == 1) {
        run.push_back(w.swap.subgroups[first]);
        run_pieces.push_back(first);
        continue;
      }
      if (!run.empty()) COSHARD_CO_TRY(co_await visit_run());
      COSHARD_CO_TRY(co_await visit_pieced_unit(w, k, visit_unit, written));
    }
    if (!run.empty()) COSHARD_CO_TRY(co_await visit_run());
    co_return Result<void>{};
  }

  // The swapper's pass beside backward steps the unit when its sub-group is in.
  Result<void> step_in_backward(const OptimizerWiring& w, FetchUnit& u) override { return w.pass.hand_over(w, u); }

 protected:
  Result<void> hand_over_late(const OptimizerWiring& w, FetchUnit& u) override { return w.pass.hand_over(w, u); }

 private:
  // grads_to_nvme: every gradient shard written out and its statistics added (the units not
  // handed over during backward now: unused this step, or every unit after several
  // micro-batches, whose pass starts here), then their sums over the ranks, before any unit steps.
  async::Task<Result<void>> gradients_out(const OptimizerWiring& w) {
    if (!w.pass.running()) COSHARD_CO_TRY(w.pass.start(w, 0.0f));
    for (auto& u : w.units)
      if (!u->info.frozen && !u->grads_out) COSHARD_CO_TRY(w.pass.hand_over(w, *u));
    w.pass.all_handed_over();  // every unit is handed over
    COSHARD_CO_TRY(co_await w.pass.finish());
    co_return co_await sum_grad_stats(w);
  }
};

}  // namespace

UnitShard detail::swapped_shard(const OptimizerWiring& w, std::size_t i, std::span<std::byte> bytes) {
  const SwapPiece& p = w.swap.pieces[i];
  const FetchUnit& u = *w.units[p.unit];
  const Shape shape{p.count};
  const std::size_t states = w.optimizer.state_tensors();
  const std::size_t stride = detail::swap_piece_bytes(p.count, 1);
  auto* base = bytes.data();
  auto view = [&](std::size_t r) { return Tensor(base + r * stride, shape, DataType::f32, async::Device::cpu()); };
  const Tensor params = w.params_on_nvme() ? view(0) : u.shard.slice(p.begin, shape);
  if (u.info.frozen) return {u.info, params, view(0), {}, {}};  // its file: the master only
  return {u.info, params, view(0), states >= 1 ? view(1) : Tensor{}, states >= 2 ? view(2) : Tensor{}};
}

async::Task<Result<void>> detail::step_swapped_piece(const OptimizerWiring& w, std::size_t i, std::span<std::byte> bytes,
                                                     float lr, async::Stream& to) {
  const SwapPiece& p = w.swap.pieces[i];
  FetchUnit& u = *w.units[p.unit];
  const UnitShard shard = swapped_shard(w, i, bytes);
  const Tensor& master = shard.master;
  // bf16/f16: cast down in the same pass, into the pinned shard itself (parameters offloaded to
  // cpu: nothing left to copy) or into the staging buffer on its way to the device.
  // The piece's gradient in the buffer's region after the master and state: taken from the
  // device shard now (grads_through_pass), or read there from the file (grads_to_nvme).
  Tensor grads;
  if (w.grads_wait_for_a_pass())
    grads = Tensor(bytes.data() + detail::swap_piece_bytes(p.count, 1 + w.optimizer.state_tensors()), Shape{p.count},
                   DataType::f32, async::Device::cpu());
  if (w.grads_through_pass()) {
    if (!u.grad_shard) co_return fail(ErrorCode::internal, "Engine: unit ", u.info.name, " stepped without its gradient shard");
    COSHARD_CO_TRY(w.pass.take_gradient_piece(w, u, p, grads));
  }
  Tensor narrowed;
  const bool into_shard = w.narrow() && u.info.shard_offloaded;
  if (w.narrow() && !w.params_on_nvme())
    narrowed = into_shard ? u.shard.slice(p.begin, Shape{p.count}) : w.host.staging_for(p.count, w.o.dtype);
  COSHARD_CO_TRY(w.optimizer.apply_group_range(*w.host.ctx, w.settings.first_group + p.unit, p.begin, lr, master, shard.state1,
                                              shard.state2, narrowed, grads));
  COSHARD_CO_TRY_ASSIGN(auto stepped, w.host.stream->record());
  if (w.params_on_nvme() || into_shard) co_return co_await stepped;
  COSHARD_CO_TRY(co_await after(to, stepped));
  const Tensor target = u.shard.slice(p.begin, Shape{p.count});
  COSHARD_CO_TRY(to.copy(target.data(), narrowed ? narrowed.data() : master.data(), target.bytes()));
  if (!u.info.shard_offloaded) w.stats.swap_bytes += target.bytes();
  COSHARD_CO_TRY_ASSIGN(auto copied, to.record());
  co_return co_await copied;
}

std::unique_ptr<OptimizerPlacement> make_optimizer_on_nvme() { return std::make_unique<OptimizerOnNvme>(); }

}  // namespace coshard::zero
