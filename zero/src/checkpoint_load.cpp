// Loading a sharded checkpoint (checkpoint.hpp has the layout), at any world size. Each rank
// resolves `latest`, reads the manifest, checks it against this engine (the run's identity,
// dtype, optimizer, units) and assembles its new block of every unit from whichever old rank
// files hold its elements, each file checked (size, CRC-32, tensor names and shapes) before use;
// all of it on the blocking pool, in host memory. The ranks then agree: unless every rank's part
// passed, nothing changes anywhere. Only then does each block go in as the optimizer placement
// visits its unit (with nvme offload, into the swap buffer that goes back to the store).
#include <algorithm>
#include <cstring>
#include <map>

#include "coshard/async/files.hpp"
#include "engine_state.hpp"
#include "tensor_parts.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;
namespace fs = std::filesystem;

std::string detail::run_differences(const std::map<std::string, std::string>& saved, const std::map<std::string, std::string>& mine) {
  std::string diffs;
  auto add = [&](const std::string& key, const std::string& before, const std::string& now) {
    diffs += (diffs.empty() ? "" : "; ") + key + ": saved " + before + ", this run " + now;
  };
  for (const auto& [key, value] : saved) {
    auto it = mine.find(key);
    if (it == mine.end()) add(key, value, "(not set)");
    else if (it->second != value) add(key, value, it->second);
  }
  for (const auto& [key, now] : mine)
    if (!saved.contains(key)) add(key, "(not set)", now);
  return diffs;
}

Result<std::string> detail::read_latest(const fs::path& dir) {
  const fs::path latest = dir / "latest";
  // `latest` holds one short line; anything else (a folder, a link to some other file) is named
  // by what it is, never echoed.
  auto bytes = async::read_regular_file(latest, 4096, "file");
  if (!bytes) return fail(std::move(bytes).error().with_context("checkpoint " + dir.string() + ": 'latest'"));
  std::string name(reinterpret_cast<const char*>(bytes->data()), bytes->size());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ')) name.pop_back();
  if (!is_checkpoint_folder_name(name)) {
    const bool printable = name.size() <= 64 && std::all_of(name.begin(), name.end(), [](char ch) {
      return ch >= 0x20 && ch < 0x7f;
    });
    return fail(ErrorCode::invalid_argument, "checkpoint ", latest.string(), ": ",
                printable ? "'" + name + "' is" : "holds " + std::to_string(bytes->size()) + " bytes,",
                " not a checkpoint folder name (expected step-NNNNNNNN)");
  }
  return name;
}

Result<CheckpointManifest> detail::read_manifest(const fs::path& folder, std::size_t max_bytes) {
  const fs::path path = folder / "manifest.json";
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, max_bytes, "file"));
  return parse_checkpoint_manifest(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                                   path.string());
}

namespace {

Result<fs::path> resolve_checkpoint(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir / "manifest.json", ec)) return dir;
  if (!fs::exists(dir / "latest", ec))
    return fail(ErrorCode::io, "checkpoint ", dir.string(), ": neither a manifest.json nor a 'latest' file there");
  COSHARD_TRY_ASSIGN(auto name, read_latest(dir));
  return dir / name;
}

// Everything one rank needs from a checkpoint, read and checked, in host memory.
struct Loaded {
  std::int64_t step = 0;
  std::vector<std::byte> optimizer_state;
  std::map<std::string, std::int64_t> steps_missed;  // CheckpointManifest::steps_missed
  // Per unit, the new block's bytes: params (dtype), master, state1, state2 (f32; empty if none).
  struct Block {
    std::vector<std::byte> params, master, state1, state2;
  };
  std::vector<Block> blocks;
  std::size_t units_left_out = 0;  // frozen units the save left out (CheckpointOptions::frozen_units)
};

// What the loading engine is, for the checks.
struct Loader {
  std::vector<FetchUnitInfo> units;
  ShardLayout kept;
  std::vector<std::int64_t> block_offsets;  // per unit: where this rank's block starts (0: stage 0, the whole unit)
  DataType dtype = DataType::f32;
  std::string optimizer;
  std::map<std::string, std::string> run;
};

// Every field of the run's identity against the checkpoint's, all differences in one message.
Result<void> check_identity(const CheckpointManifest& m, const std::map<std::string, std::string>& mine,
                            const std::string& where) {
  if (m.run.empty()) return {};  // saved without one
  const std::string diffs = run_differences(m.run, mine);
  if (diffs.empty()) return {};
  return fail(ErrorCode::invalid_argument, where, ": a different run (", diffs,
              "); these define a run and cannot change on resume (docs/reliability.md lists what can)");
}

Result<void> check_engine(const CheckpointManifest& m, const Loader& l, const std::string& where) {
  COSHARD_TRY(check_identity(m, l.run, where));
  if (m.dtype != to_string(l.dtype))
    return fail(ErrorCode::invalid_argument, where, ": saved in ", m.dtype, ", this run trains in ", to_string(l.dtype));
  if (m.optimizer != l.optimizer)
    return fail(ErrorCode::invalid_argument, where, ": optimizer ", m.optimizer, ", this run uses ", l.optimizer);
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
      return fail(ErrorCode::invalid_argument, where, ": unit ", b.name, " was frozen when saved, so the checkpoint ",
                  "holds no optimizer state for it, and this run trains it; freeze the same parameters to resume, ",
                  "or start a new run from the checkpoint's weights");
    if (!a.saved && !b.frozen)
      return fail(ErrorCode::invalid_argument, where, ": unit ", b.name, " was frozen and left out when saved (a LoRA ",
                  "base: its values come from the base weights), and this run trains it; freeze it to resume");
  }
  return {};
}

Result<Loaded> read_checkpoint(const fs::path& dir, const Loader& l) {
  COSHARD_TRY_ASSIGN(const fs::path folder, resolve_checkpoint(dir));
  COSHARD_TRY_ASSIGN(const CheckpointManifest m, read_manifest(folder));
  const std::string where = "checkpoint " + folder.string();
  // A folder named for its step (as every save names it) must hold that step: a manifest edited or
  // copied from another folder would resume the run at a step it never reached.
  if (const std::string name = folder.filename().string(); is_checkpoint_folder_name(name)) {
    const std::string digits = name.substr(5);
    const bool same = digits.find_first_not_of('0') == std::string::npos ? m.step == 0
                                                                          : digits.substr(digits.find_first_not_of('0')) == std::to_string(m.step);
    if (!same)
      return fail(ErrorCode::invalid_argument, where, ": its manifest says step ", m.step, ", the folder's name step ",
                  digits, " (a manifest edited or copied from another checkpoint; nothing was loaded)");
  }
  COSHARD_TRY(check_engine(m, l, where));

  const std::size_t elem = size_of(l.dtype);
  std::map<int, SafetensorsFile> files;  // old rank -> its file, read and checked
  auto file_of = [&](int old_rank) -> Result<const SafetensorsFile*> {
    if (auto it = files.find(old_rank); it != files.end()) return &it->second;
    const auto& rec = m.files[static_cast<std::size_t>(old_rank)];
    const fs::path path = folder / rec.name;
    COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, std::numeric_limits<std::size_t>::max(), "file"));
    if (bytes.size() != rec.bytes)
      return fail(ErrorCode::io, path.string(), ": ", bytes.size(), " bytes, the manifest says ", rec.bytes,
                  " (truncated or replaced)");
    if (const auto crc = async::crc32_of(bytes); crc != rec.crc32)
      return fail(ErrorCode::io, path.string(), ": CRC-32 ", crc, ", the manifest says ", rec.crc32, " (corrupt)");
    COSHARD_TRY_ASSIGN(auto file, SafetensorsFile::parse(std::move(bytes), path.string()));
    return &files.emplace(old_rank, std::move(file)).first->second;
  };

  Loaded out;
  out.step = m.step;
  out.optimizer_state = m.optimizer_state;
  out.steps_missed = m.steps_missed;
  for (std::size_t i = 0; i < l.units.size(); ++i) {
    const auto& info = l.units[i];
    const auto& mu = m.units[i];
    Loaded::Block block;
    const std::int64_t lo = l.block_offsets[i], hi = lo + info.shard;  // this rank's new block
    // One kind of tensor: copy [lo, min(hi, numel)) from the old files; padding stays zero.
    auto gather = [&](std::string_view kind, std::size_t size, DataType expect,
                      std::vector<std::byte>& dst) -> Result<void> {
      dst.assign(static_cast<std::size_t>(info.shard) * size, std::byte{0});
      const std::string name = block_tensor_name(i, kind);
      for (std::int64_t at = lo; at < std::min(hi, mu.numel);) {
        const int old_rank = static_cast<int>(at / mu.shard);
        const std::int64_t old_lo = old_rank * mu.shard;
        const std::int64_t upto = std::min({hi, mu.numel, old_lo + mu.shard});
        COSHARD_TRY_ASSIGN(const auto* file, file_of(old_rank));
        const auto* t = file->find(name);
        if (!t || float_dtype_of(t->dtype) != expect || t->shape.size() != 1 || t->shape[0] != mu.shard)
          return fail(ErrorCode::invalid_argument, where, ": ", m.files[static_cast<std::size_t>(old_rank)].name,
                      " lacks ", name, " as ", to_string(expect), "[", mu.shard, "]");
        const auto data = file->data(*t);
        std::memcpy(dst.data() + static_cast<std::size_t>(at - lo) * size,
                    data.data() + static_cast<std::size_t>(at - old_lo) * size, static_cast<std::size_t>(upto - at) * size);
        at = upto;
      }
      return {};
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
      if (l.dtype == DataType::f32 && lo < mu.numel) {
        COSHARD_TRY_ASSIGN(const auto* first, file_of(static_cast<int>(lo / mu.shard)));
        absent = first->find(block_tensor_name(i, "master")) == nullptr;
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

}  // namespace

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
  Loader loader{units(), shard_layout(), std::move(block_offsets), s.o.dtype, std::string(s.optimizer->name()),
                options.run};
  COSHARD_LOG_DEBUG(zero, "load_checkpoint {}: reading and checking this rank's part", dir.string());
  auto read = [&given, &dir, &loader, tensor]() -> Result<Loaded> {
    COSHARD_TRY(check_tensor_checkpoint(given, tensor));
    return read_checkpoint(dir, loader);
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
