// Loading a sharded checkpoint (checkpoint.hpp has the layout), at any world size. Each rank
// resolves `latest`, reads the manifest, checks it against this engine (the run's identity,
// dtype, optimizer, units) and assembles its new block of every unit from whichever old rank
// files hold its elements, each file checked (size, CRC-32, tensor names and shapes) before use;
// all of it on the blocking pool, in host memory. (At another tensor size than saved, the blocks
// come parameter by parameter instead: checkpoint/reshard.cpp.) The ranks then agree: unless every rank's part
// passed, nothing changes anywhere. Only then does each block go in as the optimizer placement
// visits its unit (with nvme offload, into the swap buffer that goes back to the store).
#include <algorithm>
#include <cstring>
#include <map>

#include "checkpoint/read.hpp"
#include "checkpoint/tensor_folders.hpp"
#include "engine/state.hpp"
#include "expert_parts.hpp"
#include "tensor_parts.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;
namespace fs = std::filesystem;

namespace {

// The same units as saved, one by one (a load at the tensor size saved).
Result<void> check_units(const CheckpointManifest& m, const Loader& l, const std::string& where) {
  if (m.units.size() != l.units.size())
    return fail(ErrorCode::invalid_argument, where, ": ", m.units.size(), " fetch units, this model has ",
                l.units.size(), " (another model, or another module_granularity_bytes?)");
  for (std::size_t i = 0; i < l.units.size(); ++i) {
    const auto& a = m.units[i];
    const auto& b = l.units[i];
    if (a.parameters != b.parameters || a.numel != b.numel)
      return fail(ErrorCode::invalid_argument, where, ": unit ", i, " holds ", a.name, " (", a.numel,
                  " elements), this model's unit ", i, " is ", b.name, " (", b.numel, " elements)");
    if (a.frozen && !b.frozen && l.kept.states + (l.kept.master ? 1 : 0) > 0)
      return trained_but_frozen_when_saved(where, "unit " + b.name);
    if (!a.saved && !b.frozen) return trained_but_left_out_when_saved(where, "unit " + b.name);
    // Each parameter cut as this model cuts it (recorded since checkpoints of tensor parallelism
    // say how; older manifests do not).
    for (std::size_t k = 0; k < a.splits.size() && k < a.parameters.size(); ++k) {
      const auto p = l.parameters.find(a.parameters[k]);
      if (p == l.parameters.end()) continue;  // (the names were compared above)
      COSHARD_TRY(check_same_split(a.parameters[k], *p->second, a.splits[k] ? &*a.splits[k] : nullptr, where));
    }
  }
  return {};
}

}  // namespace

Result<Loaded> detail::read_checkpoint(SavedFolder& folder, const Loader& l) {
  const CheckpointManifest& m = folder.manifest();
  COSHARD_TRY(check_run(m, l, folder.where()));
  // Each tensor rank's units have the same names and sizes: only the manifest tells one tensor
  // rank's folder from another's (older manifests do not say).
  if (m.tensor_size > 1 && (m.tensor_size != l.tensor_size || m.tensor_rank != l.tensor_rank))
    return fail(ErrorCode::invalid_argument, folder.where(), ": its manifest says tensor rank ", m.tensor_rank, " of ",
                m.tensor_size, ", this rank is tensor rank ", l.tensor_rank, " of ", l.tensor_size,
                " (a folder moved or copied from another tensor rank's); nothing was loaded");
  COSHARD_TRY(check_units(m, l, folder.where()));

  const std::size_t elem = size_of(l.dtype);
  Loaded out;
  out.step = m.step;
  out.optimizer_state = m.optimizer_state;
  out.steps_missed = m.steps_missed;
  for (std::size_t i = 0; i < l.units.size(); ++i) {
    const auto& info = l.units[i];
    const auto& mu = m.units[i];
    Loaded::Block block;
    const std::int64_t lo = l.block_offsets[i], hi = std::min(lo + info.shard, mu.numel);  // this rank's new block
    // One kind of tensor: [lo, hi) from the old files; padding stays zero.
    auto gather = [&](std::string_view kind, std::size_t size, DataType expect,
                      std::vector<std::byte>& dst) -> Result<void> {
      dst.assign(static_cast<std::size_t>(info.shard) * size, std::byte{0});
      return lo < hi ? folder.read(i, kind, expect, size, lo, hi, dst.data()) : Result<void>{};
    };
    if (!mu.saved) {  // left out: this unit keeps the values it has (the base's)
      ++out.units_left_out;
      out.blocks.push_back(std::move(block));
      continue;
    }
    COSHARD_TRY(gather("param", elem, l.dtype, block.params));
    if (info.frozen) {  // nothing else: a frozen unit has no master or state here
      out.blocks.push_back(std::move(block));
      continue;
    }
    if (l.kept.master) {
      // An f32 run's master is its parameters: a checkpoint of a run that kept none (the
      // optimizer on the device) gives them.
      bool absent = false;
      if (l.dtype == DataType::f32 && lo < hi) {
        COSHARD_TRY_ASSIGN(const bool present, folder.has(i, "master", lo));
        absent = !present;
      }
      if (absent)
        block.master = block.params;
      else
        COSHARD_TRY(gather("master", 4, DataType::f32, block.master));
    }
    if (l.kept.states >= 1) COSHARD_TRY(gather("state1", 4, DataType::f32, block.state1));
    if (l.kept.states >= 2) COSHARD_TRY(gather("state2", 4, DataType::f32, block.state2));
    out.blocks.push_back(std::move(block));
  }
  return out;
}

async::Task<Result<void>> Engine::load_checkpoint(const fs::path& given, const CheckpointOptions& options) {
  State& s = *s_;
  const int tensor = tensor_size(s.o);
  const fs::path dir = tensor_checkpoint_dir(given, s.o);  // (tensor parallelism: this rank's folder)
  COSHARD_CO_TRY(s.outside_loop("load_checkpoint"));
  COSHARD_CO_TRY(co_await finish_checkpoint());
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::invalid_argument, "load_checkpoint: must be awaited on a coshard Runtime");
  // Stage 0 loads the whole of every unit (its block starts at 0 on every rank). A stage-0
  // checkpoint's blocks are whole units (shard = numel), so its rank 0 file alone serves any run;
  // likewise a hybrid one's blocks of a unit are in the files of its first shard group.
  std::vector<std::int64_t> block_offsets;
  for (const auto& u : s.units) block_offsets.push_back(u->block_offset);
  const int tensor_rank = tensor > 1 ? s.o.tensor_parallel->rank() : 0;
  Loader loader{units(), shard_layout(), std::move(block_offsets), s.o.dtype, std::string(s.optimizer->name()),
                options.run, s.by_name(), tensor, tensor_rank, experts_elsewhere(*s.model)};
  COSHARD_LOG_DEBUG(zero, "load_checkpoint {}: reading and checking this rank's part", dir.string());
  auto read = [&given, &loader, tensor, tensor_rank]() -> Result<Loaded> {
    // The tensor size saved there (the newest, if several): this rank's own folder at this size,
    // else every folder of that size, resharded.
    COSHARD_TRY_ASSIGN(const SavedTensorLayout layout, saved_tensor_layout(given, tensor));
    // (expert parallelism: the checkpoint lists every expert rank's experts, this rank takes its
    // own parameter by parameter, whatever expert-parallel size saved it)
    if (layout.size == tensor && loader.elsewhere.empty()) {
      COSHARD_TRY_ASSIGN(auto folder, SavedFolder::open(layout.dirs[static_cast<std::size_t>(tensor_rank)]));
      return read_checkpoint(folder, loader);
    }
    COSHARD_LOG_INFO(zero, "load_checkpoint {}: saved at tensor size {}, this run's is {}: resharding every parameter",
                     given.string(), layout.size, tensor);
    std::vector<SavedFolder> folders;
    for (const auto& d : layout.dirs) {
      COSHARD_TRY_ASSIGN(auto folder, SavedFolder::open(d));
      folders.push_back(std::move(folder));
    }
    return read_resharded(folders, loader, tensor);
  };
  auto loaded = co_await rt->spawn_blocking(std::move(read));
  // No state changes unless every rank read and checked its part.
  std::string what = "checkpoint " + dir.string();  // named: GCC 12 destroys temporaries in co_await twice
  auto agreed = co_await s.ranks_agree.every_rank_can_load(loaded.has_value(), std::move(what));
  if (tensor > 1) {
    // Every tensor rank's folder at the same step, or none loads (a save cut short between two
    // folders' publishes leaves them apart); every tensor rank exchanges whatever it found.
    const bool ok = loaded && agreed;
    std::vector<std::int64_t> mine{ok ? 1 : 0, ok ? loaded->step : -1};
    COSHARD_CO_TRY_ASSIGN(const auto all, co_await s.tensor_agree.all_ranks(std::move(mine)));
    if (ok)
      for (int t = 0; t < tensor; ++t) {
        const std::int64_t t_ok = all[static_cast<std::size_t>(2 * t)], t_step = all[static_cast<std::size_t>(2 * t + 1)];
        if (t_ok != 1)
          co_return fail(ErrorCode::invalid_argument, "checkpoint ", given.string(), ": tensor rank ", t,
                         " could not load its folder (its error says why); nothing was loaded");
        if (t_step != loaded->step)
          co_return fail(ErrorCode::invalid_argument, "checkpoint ", given.string(), ": tensor rank ", t,
                         "'s folder is at step ", t_step, ", this rank's (", dir.filename().string(), ") at step ",
                         loaded->step, " (a save cut short between the folders' publishes: point each folder's "
                         "'latest' at a step they all hold); nothing was loaded");
      }
  }
  if (!loaded) co_return fail(std::move(loaded).error());
  COSHARD_CO_TRY(std::move(agreed));

  // An engine given no values yet (no initialize) gets some first: the visit below rewrites
  // every block in place, and with nvme offload reads each swap file before writing it.
  COSHARD_LOG_DEBUG(zero, "load_checkpoint {}: every rank can load step {}; writing the shards", dir.string(), loaded->step);
  if (!s.has_values) {
    // Units left out keep the values they have: an engine given none would train on made-up ones.
    if (loaded->units_left_out > 0)
      co_return fail(ErrorCode::invalid_argument, "checkpoint ", dir.string(), " leaves out ", loaded->units_left_out,
                     " frozen units (a LoRA base), whose values must be given first: initialize with the run's seed, ",
                     "or load the base weights, then load_checkpoint");
    COSHARD_CO_TRY(co_await initialize(0));
  }
  // Every rank checked its part: each unit's block goes in as the placement visits it (with nvme
  // offload, into the swap buffer that is then written back to the store).
  Context& ctx = *s.ctx;
  std::size_t next = 0;
  auto load_unit = [&](const UnitShard& sh) -> async::Task<Result<void>> {
    const auto& b = loaded->blocks[next++];
    if (!b.params.empty()) COSHARD_CO_TRY(ctx.copy_from_host(sh.params, b.params));
    if (!b.master.empty()) COSHARD_CO_TRY(ctx.copy_from_host(sh.master, b.master));
    if (!b.state1.empty()) COSHARD_CO_TRY(ctx.copy_from_host(sh.state1, b.state1));
    if (!b.state2.empty()) COSHARD_CO_TRY(ctx.copy_from_host(sh.state2, b.state2));
    COSHARD_CO_TRY_ASSIGN(auto copied, ctx.stream().record());
    co_return co_await copied;
  };
  COSHARD_CO_TRY(co_await visit_shards(load_unit, true));
  COSHARD_CO_TRY(ctx.copy_from_host(s.optimizer->step_state(), loaded->optimizer_state));
  s.steps_done = loaded->step;
  for (auto& u : s.units)
    for (auto& p : u->params) {
      const auto it = loaded->steps_missed.find(s.names.at(p.parameter));
      p.steps_missed = it == loaded->steps_missed.end() ? 0 : static_cast<std::int32_t>(it->second);
    }
  COSHARD_CO_TRY(s.settings().set_steps_missed());
  COSHARD_LOG_INFO(zero, "loaded checkpoint {} (step {})", dir.string(), loaded->step);
  co_return Result<void>{};
}

}  // namespace coshard::zero
