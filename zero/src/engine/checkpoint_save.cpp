// Saving a sharded checkpoint (checkpoint.hpp has the layout and the protocol): this rank's
// blocks staged into one pinned, page-aligned safetensors image by copies on the compute stream
// as the optimizer placement visits each unit (with nvme offload, as the swapper reads it in);
// the file written behind training through the offload store (io_uring) into DIR/step-N.partial;
// then, at the publish, every rank's outcome exchanged, and rank 0 alone writing the manifest and
// renaming the folder and `latest` into place. Nothing is published unless every rank's file is.
#include <fcntl.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <functional>

#include "coshard/async/files.hpp"
#include "checkpoint/tensor_folders.hpp"
#include "checkpoint/saved_units.hpp"
#include "engine/state.hpp"
#include "tensor_parts.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace detail {

std::string checkpoint_folder_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::int64_t checkpoint_folder_step(std::string_view name) noexcept {
  std::int64_t step = 0;
  std::from_chars(name.data() + 5, name.data() + name.size(), step);
  return step;
}

// Appended, not `"u" + ...`: GCC 12 warns falsely about overlapping memcpy for that.
std::string block_tensor_name(std::size_t unit, std::string_view kind) {
  std::string name = "u";
  name += std::to_string(unit);
  name += '.';
  name += kind;
  return name;
}

std::vector<BlockKind> block_kinds(ShardLayout kept) {
  std::vector<BlockKind> kinds{BlockKind::param};
  if (kept.master) kinds.push_back(BlockKind::master);
  if (kept.states >= 1) kinds.push_back(BlockKind::state1);
  if (kept.states >= 2) kinds.push_back(BlockKind::state2);
  return kinds;
}

std::string_view name_of(BlockKind k) noexcept {
  static constexpr std::string_view names[] = {"param", "master", "state1", "state2"};
  return names[static_cast<int>(k)];
}

const Tensor& tensor_of(const UnitShard& sh, BlockKind k) noexcept {
  switch (k) {
    case BlockKind::param: return sh.params;
    case BlockKind::master: return sh.master;
    case BlockKind::state1: return sh.state1;
    case BlockKind::state2: return sh.state2;
  }
  return sh.params;
}

Result<SafeDType> safe_dtype(DataType t) {
  if (auto safe = safe_dtype_of(t)) return *safe;
  return fail(ErrorCode::unsupported, "checkpoint: dtype ", to_string(t), " has no safetensors name");
}

}  // namespace detail

namespace {

std::size_t round_up_to_pages(std::size_t bytes) {
  constexpr std::size_t a = offload::NvmeStore::kAlignment;
  return (bytes + a - 1) / a * a;
}

// One rank's staged file, behind training: CRC-32 of the bytes, the write to a temporary name,
// seal (exact size, fsync, close), rename into place.
async::Task<Result<ShardFile>> write_rank_file(std::shared_ptr<offload::NvmeStore> store, std::string folder,
                                               int rank, async::PinnedBuffer staged, std::size_t bytes) {
  async::Runtime* rt = async::Runtime::current();
  const std::span<const std::byte> content(staged.data(), bytes);
  auto checksum = [content] { return async::crc32_of(content); };
  COSHARD_CO_TRY_ASSIGN(const std::uint32_t crc, co_await rt->spawn_blocking(std::move(checksum)));
  const std::string name = checkpoint_rank_file(rank);
  const std::string tmp = folder + "/" + name + ".tmp";
  // The file rounded up to whole pages goes straight to the disk; seal cuts the padding. (The
  // buffer may be larger: it is kept from save to save.)
  COSHARD_CO_TRY(co_await store->write(tmp, 0, staged.bytes().first(round_up_to_pages(bytes))));
  COSHARD_CO_TRY(co_await store->seal(tmp, bytes));
  const fs::path dir = store->options().directory / folder;
  auto rename = [dir, name]() -> Result<void> {
    std::error_code ec;
    fs::rename(dir / (name + ".tmp"), dir / name, ec);
    if (ec) return fail(ErrorCode::io, "checkpoint: renaming ", (dir / name).string(), ".tmp into place: ", ec.message());
    return async::fsync_path(dir, O_RDONLY | O_DIRECTORY);
  };
  COSHARD_CO_TRY(co_await rt->spawn_blocking(std::move(rename)));
  co_return ShardFile{name, bytes, crc, std::move(staged)};
}

std::vector<std::int64_t> dims_of(const Shape& shape) { return {shape.dims().begin(), shape.dims().end()}; }

std::string hex(std::span<const std::byte> bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (auto b : bytes) {
    out.push_back(digits[static_cast<unsigned>(b) >> 4]);
    out.push_back(digits[static_cast<unsigned>(b) & 15]);
  }
  return out;
}

// After a publish: the published checkpoints beyond the `keep` newest go, oldest first; never
// `latest` (the newest by step, as names sort). Best effort: a folder that cannot be removed
// stays and is tried again at the next publish.
void remove_oldest_checkpoints(const fs::path& dir, const std::string& latest, std::size_t keep) {
  std::vector<std::pair<std::int64_t, fs::path>> published;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string n = entry.path().filename().string();
    if (is_checkpoint_folder_name(n) && entry.is_directory(ec)) published.emplace_back(checkpoint_folder_step(n), entry.path());
  }
  std::sort(published.begin(), published.end());
  for (std::size_t i = 0; i + keep < published.size(); ++i)
    if (published[i].second.filename() != latest) fs::remove_all(published[i].second, ec);
}

// Rank 0's half of a publish, on the blocking pool: the manifest into the partial folder, the
// folder renamed into place (an older one of the same step moved aside first), `latest`
// replaced, the oldest beyond `keep` removed.
Result<void> publish_files(const fs::path& dir, const std::string& name, const std::string& manifest, int keep,
                           const std::vector<std::uint64_t>& rank_bytes) {
  const fs::path partial = dir / (name + ".partial"), final_dir = dir / name;
  // Every rank's file must be in the folder published: ranks given different folders (a folder
  // local to each node) each wrote into their own, and a checkpoint of rank 0's file alone loads
  // nowhere.
  std::string unseen;
  int unseen_count = 0;
  for (std::size_t r = 0; r < rank_bytes.size(); ++r) {
    std::error_code ec;
    const auto size = fs::file_size(partial / checkpoint_rank_file(static_cast<int>(r)), ec);
    if (!ec && size == rank_bytes[r]) continue;
    if (++unseen_count <= 8) unseen += (unseen.empty() ? "" : ", ") + std::to_string(r);
  }
  if (unseen_count > 0)
    return fail(ErrorCode::io, "the files of ", unseen_count, " rank(s) (", unseen, unseen_count > 8 ? ", ..." : "",
                ") are not in ", partial.string(), " as they reported them written: every rank must save into one "
                "folder that all of them see (a shared filesystem; each rank's own --checkpoint-dir does not make a "
                "checkpoint); nothing is published");
  COSHARD_TRY(async::write_file_atomic(partial / "manifest.json", manifest));
  std::error_code ec;
  if (fs::exists(final_dir, ec)) {  // a checkpoint of this step already (a resumed run saving again)
    const fs::path old = dir / (name + ".replaced");
    fs::remove_all(old, ec);
    fs::rename(final_dir, old, ec);
    if (ec) return fail(ErrorCode::io, "moving the older ", final_dir.string(), " aside: ", ec.message());
  }
  fs::rename(partial, final_dir, ec);
  if (ec) return fail(ErrorCode::io, "publishing ", partial.string(), " as ", final_dir.string(), ": ", ec.message());
  COSHARD_TRY(async::fsync_path(dir, O_RDONLY | O_DIRECTORY));
  COSHARD_TRY(async::write_file_atomic(dir / "latest", name + "\n"));
  fs::remove_all(dir / (name + ".replaced"), ec);
  if (keep > 0) remove_oldest_checkpoints(dir, name, static_cast<std::size_t>(keep));
  return {};
}

// A unit's record in the manifest: its description, whether this save holds it, and what a load
// at another tensor size needs (each parameter's part shape, and its split under tensor parallelism).
json unit_record(const FetchUnitInfo& info, bool saved, const std::unordered_map<std::string, const Parameter*>& parameters,
                 bool tensor_parallel) {
  json record = {{"name", info.name},       {"parameters", info.parameters}, {"numel", info.numel},
                 {"padded", info.padded},   {"shard", info.shard},           {"shard_ranks", info.shard_ranks},
                 {"frozen", info.frozen},   {"saved", saved}};
  json shapes = json::array(), splits = json::array();
  for (const auto& name : info.parameters) {
    const Parameter* p = parameters.at(name);
    shapes.push_back(dims_of(p->shape()));
    const TensorSplit* split = p->split();
    splits.push_back(split ? json{{"dim", split->dim}, {"segments", split->segments}, {"whole", dims_of(split->whole)}}
                           : json(nullptr));
  }
  record["shapes"] = std::move(shapes);
  if (tensor_parallel) record["splits"] = std::move(splits);
  return record;
}

// The manifest's unit records (checkpoint/saved_units.hpp): an expert-parallel unit under the
// names of each expert rank it is listed for, with the first file holding its blocks.
json listed_records(const SavedUnits& listed, std::span<const FetchUnitInfo> units,
                    const std::function<bool(std::size_t)>& left_out,
                    const std::unordered_map<std::string, const Parameter*>& parameters, bool tensor_parallel) {
  json records = json::array();
  for (const auto& entry : listed.entries) {
    const FetchUnitInfo& info = units[entry.unit];
    json record = unit_record(info, !left_out(entry.unit), parameters, tensor_parallel);
    if (info.expert_parallel > 1) {
      record["name"] = entry.name;
      record["parameters"] = entry.parameters;
      record["first_file"] = entry.first_file;
    }
    records.push_back(std::move(record));
  }
  return records;
}

// The steps each parameter missed (no gradient), by name; empty when none did.
json steps_missed(const std::vector<std::unique_ptr<FetchUnit>>& units,
                  const std::unordered_map<const Parameter*, std::string>& names) {
  json missed = json::object();
  for (const auto& u : units)
    for (const auto& p : u->params)
      if (p.steps_missed > 0) missed[names.at(p.parameter)] = p.steps_missed;
  return missed;
}

// The steps this rank's parameters missed with, under expert parallelism (`experts`), those every
// other expert rank's experts missed: rank 0's manifest names every expert (one exchange).
async::Task<Result<json>> every_steps_missed(RankExchange& world, int rank, Module& model,
                                             const std::vector<std::unique_ptr<FetchUnit>>& units,
                                             const std::unordered_map<const Parameter*, std::string>& names, bool experts) {
  json missed = steps_missed(units, names);
  if (!experts) co_return missed;
  auto own = missed.get<std::map<std::string, std::int64_t>>();  // (named: GCC 12, as above)
  COSHARD_CO_TRY_ASSIGN(const auto elsewhere, co_await steps_missed_elsewhere(world, rank, model, std::move(own)));
  for (const auto& [name, n] : elsewhere) missed[name] = n;
  co_return missed;
}

// The store the rank files are written through (io_uring; O_DIRECT where `dir`'s filesystem allows),
// opened on `dir` unless the last save's is there already.
Result<void> open_store(CheckpointState& c, const fs::path& dir) {
  if (c.store && c.store_dir == dir) return {};
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return fail(ErrorCode::io, "checkpoint folder ", dir.string(), ": ", ec.message());
  offload::NvmeStoreOptions store_options;
  store_options.directory = dir;
  store_options.direct = offload::NvmeStore::supports_direct_io(dir);
  COSHARD_TRY_ASSIGN(auto store, offload::NvmeStore::open(store_options));
  c.store = std::move(store);
  c.store_dir = dir;
  return {};
}

}  // namespace

Result<void> Engine::State::claim_checkpoint_folder(const fs::path& dir, const CheckpointOptions& options) {
  auto& lock = checkpoint.folder_lock;
  if (!lock.held() || !async::same_path(lock.path(), dir)) {
    lock.reset();
    auto claimed = async::FolderLock::claim(dir, "checkpoint folder",
                                            "coshard rank 0 of " + std::to_string(world) + " saving checkpoints",
                                            async::FolderLock::Sharing::process);
    if (!claimed) return fail(std::move(claimed).error().with_context("save_checkpoint"));
    lock = std::move(*claimed);
  }
  if (options.replace_other_run) return {};
  // The checkpoints this save would replace (the same step's) or supersede as `latest`.
  std::vector<fs::path> published{dir / checkpoint_folder_name(steps_done)};
  std::error_code ec;
  if (fs::exists(dir / "latest", ec))
    if (auto latest = read_latest(dir)) published.push_back(dir / *latest);
  for (const auto& folder : published) {
    if (!fs::exists(folder / "manifest.json", ec)) continue;
    // One we cannot read is not one we could tell apart either (a load names what is wrong).
    auto m = read_manifest(folder, std::size_t{64} << 20);
    if (!m) continue;
    const std::string diffs = run_differences(m->run, options.run);
    if (!diffs.empty())
      return fail(ErrorCode::invalid_argument, "save_checkpoint: ", folder.string(), " was saved by another run (",
                  diffs, "); saving here would replace or supersede it (CheckpointOptions::replace_other_run says "
                  "to, or save into a folder of this run's own)");
  }
  return {};
}

async::Task<Result<void>> Engine::save_checkpoint(const fs::path& given, CheckpointOptions options) {
  State& s = *s_;
  // Tensor parallelism: each tensor rank's data group saves and publishes a folder of its own.
  const fs::path dir = tensor_checkpoint_dir(given, s.o);
  COSHARD_CO_TRY(s.outside_loop("save_checkpoint"));
  if (options.keep < 0)
    co_return fail(ErrorCode::invalid_argument, "save_checkpoint: keep=", options.keep,
                   ": expected >= 0 (0 keeps every checkpoint)");
  // A run identity the load would refuse is refused here, before anything is written.
  if (auto error = run_identity_error(options.run); !error.empty())
    co_return fail(ErrorCode::invalid_argument, "save_checkpoint: CheckpointOptions::run: ", error,
                   " (a checkpoint saved with it could not be loaded)");
  COSHARD_CO_TRY(co_await finish_checkpoint());
  {
    // Rank 0 claims the folder and checks whose checkpoints are there; every rank learns the outcome
    // before anything is staged or written.
    auto claimed = s.rank == 0 ? s.claim_checkpoint_folder(dir, options) : Result<void>{};
    auto agreed = co_await s.ranks_agree.every_rank_agrees(claimed.has_value(), "save_checkpoint into " + dir.string(),
                                               "nothing was saved");
    if (!claimed) co_return claimed;
    COSHARD_CO_TRY(agreed);
  }
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::invalid_argument, "save_checkpoint: must be awaited on a coshard Runtime");
  COSHARD_CO_TRY_ASSIGN(const SafeDType param_dtype, safe_dtype(s.o.dtype));

  // This rank's file: a safetensors image of its blocks (params in the compute dtype, the rest f32).
  const auto kinds = block_kinds(shard_layout());
  const auto units_info = units();
  std::vector<SafeTensorLayout> layout;
  const auto parameters = s.by_name();
  // (expert parallelism: every expert rank's experts listed, this rank's saved under their entry)
  const SavedUnits listed = saved_units(units_info, *s.model, s.rank, s.world);
  // Each block is written once: by the ranks holding copy 0 of it (the first shard group; rank 0
  // alone at stage 0, where every rank holds the whole unit), so rank i's file holds block i.
  auto written = [&](std::size_t i) { return s.units[i]->group->replica == 0; };
  // (a frozen unit left out: CheckpointOptions::frozen_units)
  auto left_out = [&](std::size_t i) { return !options.frozen_units && s.units[i]->info.frozen; };
  for (std::size_t i = 0; i < units_info.size(); ++i) {
    const auto& info = units_info[i];
    const auto n = static_cast<std::size_t>(info.shard);
    for (const BlockKind k : kinds) {
      if (!written(i) || left_out(i)) break;
      const bool param = k == BlockKind::param;
      if (info.frozen && !param) continue;  // a frozen unit: its parameters only
      layout.push_back({block_tensor_name(listed.key_of[i], name_of(k)), param ? param_dtype : SafeDType::f32,
                        {info.shard}, n * (param ? s.element_size : sizeof(float))});
    }
  }
  json unit_records = listed_records(listed, units_info, left_out, parameters, tensor_size(s.o) > 1);
  COSHARD_CO_TRY_ASSIGN(json missed, co_await every_steps_missed(s.ranks_agree, s.rank, *s.model, s.units, s.names,
                                                                  listed.entries.size() != units_info.size()));
  const std::string file_name = checkpoint_rank_file(s.rank);
  const std::map<std::string, std::string> file_metadata{{"format", std::string(CheckpointManifest::kFormat)},
                                                         {"rank", std::to_string(s.rank)}};
  COSHARD_CO_TRY_ASSIGN(auto prefix, safetensors_prefix(layout, file_metadata, file_name));
  std::size_t total = prefix.size();
  for (const auto& p : layout) total += p.bytes;
  const std::size_t padded = round_up_to_pages(total);
  // The last save's buffer when it is large enough (its write has finished: finish_checkpoint).
  async::PinnedBuffer staged = std::move(s.checkpoint.staging);
  if (staged.size() < padded) {
    staged.reset();
    COSHARD_CO_TRY_ASSIGN(staged, async::PinnedBuffer::allocate(padded));
  }
  std::memcpy(staged.data(), prefix.data(), prefix.size());
  std::memset(staged.data() + total, 0, padded - total);
  auto& compute = s.ctx->stream();
  std::size_t at = prefix.size();
  std::size_t visited = 0;
  auto stage_unit = [&](const UnitShard& sh) -> async::Task<Result<void>> {
    const std::size_t i = visited++;
    if (!written(i) || left_out(i)) co_return Result<void>{};
    for (const BlockKind k : kinds) {
      if (sh.info.frozen && k != BlockKind::param) continue;
      const Tensor& source = tensor_of(sh, k);
      COSHARD_CO_TRY(compute.copy(staged.data() + at, source.data(), source.bytes()));
      at += source.bytes();
    }
    COSHARD_CO_TRY_ASSIGN(auto copied, compute.record());
    co_return co_await copied;
  };
  COSHARD_CO_TRY(co_await visit_shards(stage_unit, false));
  if (at != total)
    co_return fail(ErrorCode::internal, "checkpoint: staged ", at, " bytes of a ", total, "-byte layout");

  PendingSave pending{
      .dir = dir, .name = checkpoint_folder_name(s.steps_done), .manifest = {}, .keep = options.keep, .write = {}, .steps_left = 2};
  if (s.rank == 0) {
    COSHARD_CO_TRY_ASSIGN(auto state, co_await s.ctx->read_bytes(s.optimizer->step_state()));
    json m = {{"format", CheckpointManifest::kFormat},        {"version", CheckpointManifest::kVersion},
              {"step", s.steps_done},                          {"world_size", s.world},
              {"zero_stage", s.o.zero_stage},                  {"dtype", std::string(to_string(s.o.dtype))},
              {"optimizer", std::string(s.optimizer->name())}, {"optimizer_state", hex(state)}};
    if (tensor_size(s.o) > 1)
      m["tensor_parallel"] = {{"size", tensor_size(s.o)}, {"rank", s.o.tensor_parallel->rank()}};
    m["run"] = std::move(options.run);
    m["units"] = std::move(unit_records);
    if (!missed.empty()) m["steps_missed"] = std::move(missed);
    pending.manifest = m.dump(1);
  }
  // The file is written behind training (io_uring on this runtime); the staged buffer moves there.
  auto& c = s.checkpoint;
  COSHARD_CO_TRY(open_store(c, dir));
  COSHARD_LOG_DEBUG(zero, "checkpoint {}: {} bytes staged; writing {} behind training", pending.name, total,
                    (dir / (pending.name + ".partial") / file_name).string());
  pending.write = rt->spawn(write_rank_file(c.store, pending.name + ".partial", s.rank, std::move(staged), total));
  c.pending = std::move(pending);
  co_return Result<void>{};
}

async::Task<Result<void>> Engine::finish_checkpoint() {
  COSHARD_CO_TRY(s_->outside_loop("finish_checkpoint"));
  if (!s_->checkpoint.pending) co_return Result<void>{};
  co_return co_await s_->publish_checkpoint();
}

async::Task<Result<void>> Engine::State::publish_checkpoint() {
  PendingSave p = std::move(*checkpoint.pending);
  checkpoint.pending.reset();
  auto written = co_await p.write;
  if (written) checkpoint.staging = std::move(written->staging);
  // Every rank learns every rank's outcome: [ok, bytes, crc].
  std::vector<std::int64_t> mine{written ? 1 : 0, written ? static_cast<std::int64_t>(written->bytes) : 0,
                                 written ? static_cast<std::int64_t>(written->crc32) : 0};
  COSHARD_LOG_DEBUG(zero, "checkpoint {}: this rank's file {}; exchanging every rank's outcome", p.name,
                    written ? "written" : "failed");
  COSHARD_CO_TRY_ASSIGN(auto all, co_await ranks_agree.all_ranks(std::move(mine)));
  if (!written) co_return fail(std::move(written).error().with_context("checkpoint " + p.name));
  for (int r = 0; r < world; ++r)
    if (all[static_cast<std::size_t>(3 * r)] != 1)
      co_return fail(ErrorCode::io, "checkpoint ", p.name, ": rank ", r,
                     " could not write its shard file; the checkpoint is not published");

  std::int64_t published = 1;
  std::string error;
  if (rank == 0) {
    auto manifest = json::parse(p.manifest);
    json files = json::array();
    std::vector<std::uint64_t> rank_bytes;
    for (int r = 0; r < world; ++r) rank_bytes.push_back(static_cast<std::uint64_t>(all[static_cast<std::size_t>(3 * r + 1)]));
    for (int r = 0; r < world; ++r)
      files.push_back({{"rank", r}, {"name", checkpoint_rank_file(r)}, {"bytes", all[static_cast<std::size_t>(3 * r + 1)]},
                       {"crc32", all[static_cast<std::size_t>(3 * r + 2)]}});
    manifest["files"] = std::move(files);
    // Named, not a temporary in the co_await (GCC 12 destroys such temporaries twice).
    auto publish = [dir = p.dir, name = p.name, text = manifest.dump(1), keep = p.keep, rank_bytes]() {
      return publish_files(dir, name, text, keep, rank_bytes);
    };
    auto done = co_await async::Runtime::current()->spawn_blocking(std::move(publish));
    if (!done) {
      published = 0;
      error = done.error().message();
    }
  }
  // Everyone returns once rank 0 has published (or failed to).
  std::vector<std::int64_t> outcome{published};  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY_ASSIGN(auto status, co_await ranks_agree.all_ranks(std::move(outcome)));
  if (status[0] != 1)
    co_return fail(ErrorCode::io, "checkpoint ", p.name, ": rank 0 could not publish it",
                   error.empty() ? std::string() : ": " + error);
  COSHARD_LOG_INFO(zero, "checkpoint {} published in {}", p.name, p.dir.string());
  co_return Result<void>{};
}

}  // namespace coshard::zero
