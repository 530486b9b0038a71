// Sharded checkpoints, export and import (see trainer.hpp for the protocol).
//
// On disk, under the checkpoint folder DIR:
//   DIR/step-00000042/manifest.json            format, step, world size, stage, dtype, optimizer,
//                                              units (names, parameters, numel), files (bytes, CRC-32),
//                                              the optimizer's step state
//   DIR/step-00000042/rank-00001.safetensors   rank 1's blocks: u<i>.param (dtype), u<i>.master (f32,
//                                              when dtype is not f32), u<i>.state1, u<i>.state2 (f32)
//   DIR/latest                                 "step-00000042"
// A save writes into DIR/step-00000042.partial/ and rank 0 renames it into place once every rank's
// file is confirmed; `latest` is replaced by rename after that. Rank i's file holds elements
// [i * shard, (i + 1) * shard) of each padded unit, so a load at another world size reads, for each
// unit, the elements of its new block from whichever old files hold them.
#include <fcntl.h>
#include <unistd.h>
#include <zlib.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <set>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/safetensors.hpp"
#include "coshard/trainer/checkpoint_manifest.hpp"
#include "files.hpp"
#include "trainer_impl.hpp"

namespace coshard::trainer {

using modules::DataType;
using modules::SafeDType;
using modules::Shape;
using modules::Tensor;
namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

constexpr std::string_view kFormat = CheckpointManifest::kFormat;
constexpr int kVersion = CheckpointManifest::kVersion;

std::string step_name(std::int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step-%08lld", static_cast<long long>(step));
  return buf;
}

std::string rank_file(int rank) { return checkpoint_rank_file(rank); }

// After a publish: the published checkpoints beyond the `keep` newest go, oldest first; never
// `latest` (the newest by step, as names sort). Best effort: a folder that cannot be removed
// stays and is tried again at the next publish.
void remove_oldest_checkpoints(const fs::path& dir, const std::string& latest, std::size_t keep);


// "u<unit>.<kind>": a block's tensor name in a rank file (appended, not `"u" + ...`: GCC 12 warns
// falsely about overlapping memcpy for that).
std::string tensor_name(std::size_t unit, std::string_view kind) {
  std::string name = "u";
  name += std::to_string(unit);
  name += '.';
  name += kind;
  return name;
}

// The tensors of a unit's block in a rank file, in file order: its params, then its master and
// the optimizer's states when the engine keeps them (ShardLayout).
enum class BlockKind : std::uint8_t { param, master, state1, state2 };
std::vector<BlockKind> block_kinds(zero::ShardLayout kept) {
  std::vector<BlockKind> kinds{BlockKind::param};
  if (kept.master) kinds.push_back(BlockKind::master);
  if (kept.states >= 1) kinds.push_back(BlockKind::state1);
  if (kept.states >= 2) kinds.push_back(BlockKind::state2);
  return kinds;
}
std::string_view name_of(BlockKind k) {
  static constexpr std::string_view names[] = {"param", "master", "state1", "state2"};
  return names[static_cast<int>(k)];
}
const Tensor& tensor_of(const zero::UnitShard& sh, BlockKind k) {
  switch (k) {
    case BlockKind::param: return sh.params;
    case BlockKind::master: return sh.master;
    case BlockKind::state1: return sh.state1;
    case BlockKind::state2: return sh.state2;
  }
  return sh.params;
}

Result<SafeDType> safe_dtype(DataType t) {
  if (auto safe = modules::safe_dtype_of(t)) return *safe;
  return fail(ErrorCode::unsupported, "checkpoint: dtype ", collectives::to_string(t), " has no safetensors name");
}

using modules::float_dtype_of;

using detail::crc32_of;

using detail::fsync_path;
using detail::read_file;
using detail::write_file_atomic;

// Writes one rank's staged file behind training: CRC-32 of the bytes, the io_uring write to a
// temporary name, seal (exact size, fsync, close), rename into place.
async::Task<Result<ShardFile>> write_rank_file(std::shared_ptr<offload::NvmeStore> store, std::string folder,
                                               int rank, async::PinnedBuffer staged, std::size_t bytes) {
  async::Runtime* rt = async::Runtime::current();
  const std::span<const std::byte> content(staged.data(), bytes);
  auto checksum = [content] { return crc32_of(content); };
  COSHARD_CO_TRY_ASSIGN(const std::uint32_t crc, co_await rt->spawn_blocking(std::move(checksum)));
  const std::string tmp = folder + "/" + rank_file(rank) + ".tmp";
  // The file rounded up to whole pages goes straight to the disk; seal cuts the padding. (The
  // buffer may be larger: it is kept from save to save.)
  const std::size_t padded =
      (bytes + offload::NvmeStore::kAlignment - 1) / offload::NvmeStore::kAlignment * offload::NvmeStore::kAlignment;
  COSHARD_CO_TRY(co_await store->write(tmp, 0, staged.bytes().first(padded)));
  COSHARD_CO_TRY(co_await store->seal(tmp, bytes));
  const fs::path dir = store->options().directory / folder;
  auto rename = [dir, rank]() -> Result<void> {
    std::error_code ec;
    fs::rename(dir / (rank_file(rank) + ".tmp"), dir / rank_file(rank), ec);
    if (ec) return fail(ErrorCode::io, "checkpoint: renaming ", (dir / rank_file(rank)).string(), ".tmp into place: ", ec.message());
    return fsync_path(dir, O_RDONLY | O_DIRECTORY);
  };
  COSHARD_CO_TRY(co_await rt->spawn_blocking(std::move(rename)));
  co_return ShardFile{rank_file(rank), bytes, crc, std::move(staged)};
}

std::string hex(std::span<const std::byte> bytes) {
  static constexpr char digits[] = "0123456789abcdef";
  std::string out;
  for (auto b : bytes) {
    out.push_back(digits[static_cast<unsigned>(b) >> 4]);
    out.push_back(digits[static_cast<unsigned>(b) & 15]);
  }
  return out;
}

}  // namespace

// ---- save ----

async::Task<Result<void>> Trainer::save_checkpoint(const fs::path& dir) {
  Impl& s = *impl_;
  COSHARD_CO_TRY(co_await finish_checkpoint());
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::internal, "save_checkpoint: not on a runtime");
  const int rank = s.comm->rank();
  COSHARD_CO_TRY_ASSIGN(const SafeDType param_dtype, safe_dtype(s.config.dtype));

  // This rank's file: a safetensors layout of its blocks, assembled in one pinned, page-aligned
  // buffer by copies on the compute stream as the engine visits each unit's shard (with nvme
  // offload, as the swapper reads its state in); the host awaits their events, never blocks.
  const auto kinds = block_kinds(s.engine->shard_layout());
  const auto units_info = s.engine->units();
  std::vector<modules::SafeTensorLayout> layout;
  json units = json::array();
  for (std::size_t i = 0; i < units_info.size(); ++i) {
    const auto& info = units_info[i];
    const auto n = static_cast<std::size_t>(info.shard);
    for (const BlockKind k : kinds) {  // params in the compute dtype, the rest f32
      const bool param = k == BlockKind::param;
      layout.push_back({tensor_name(i, name_of(k)), param ? param_dtype : SafeDType::f32, {info.shard},
                        n * (param ? collectives::size_of(s.config.dtype) : sizeof(float))});
    }
    units.push_back({{"name", info.name}, {"parameters", info.parameters}, {"numel", info.numel},
                     {"padded", info.padded}, {"shard", info.shard}});
  }
  const std::map<std::string, std::string> file_metadata{{"format", std::string(kFormat)}, {"rank", std::to_string(rank)}};
  COSHARD_CO_TRY_ASSIGN(auto prefix, modules::safetensors_prefix(layout, file_metadata, rank_file(rank)));
  std::size_t total = prefix.size();
  for (const auto& p : layout) total += p.bytes;
  const std::size_t padded = (total + offload::NvmeStore::kAlignment - 1) / offload::NvmeStore::kAlignment *
                             offload::NvmeStore::kAlignment;
  // The last save's buffer when it is large enough (its write has finished: finish_checkpoint).
  async::PinnedBuffer staged = std::move(s.staging);
  if (staged.size() < padded) {
    staged.reset();
    COSHARD_CO_TRY_ASSIGN(staged, async::PinnedBuffer::allocate(padded));
  }
  std::memcpy(staged.data(), prefix.data(), prefix.size());
  std::memset(staged.data() + total, 0, padded - total);
  auto& compute = s.ctx->stream();
  std::size_t at = prefix.size();
  auto stage_unit = [&](const zero::UnitShard& sh) -> async::Task<Result<void>> {
    for (const BlockKind k : kinds) {
      const Tensor& source = tensor_of(sh, k);
      COSHARD_CO_TRY(compute.copy(staged.data() + at, source.data(), source.bytes()));
      at += source.bytes();
    }
    COSHARD_CO_TRY_ASSIGN(auto copied, compute.record());
    co_return co_await copied;
  };
  COSHARD_CO_TRY(co_await s.engine->visit_shards(stage_unit, false));
  if (at != total)
    co_return fail(ErrorCode::internal, "checkpoint: staged ", at, " bytes of a ", total, "-byte layout");

  PendingSave pending;
  pending.dir = dir;
  pending.step = s.steps;
  pending.name = step_name(s.steps);
  if (rank == 0) {
    COSHARD_CO_TRY_ASSIGN(auto state, co_await s.ctx->read_bytes(s.optimizer->step_state()));
    json m;
    m["format"] = kFormat;
    m["version"] = kVersion;
    m["step"] = s.steps;
    m["world_size"] = s.comm->size();
    m["zero_stage"] = s.config.zero_stage;
    m["dtype"] = std::string(collectives::to_string(s.config.dtype));
    m["optimizer"] = std::string(to_string(s.config.optimizer));
    m["optimizer_state"] = hex(state);
    m["seed"] = s.config.seed;
    m["run"] = s.config.identity();
    m["units"] = std::move(units);
    pending.manifest = m.dump(1);
  }
  // The file is written behind training (io_uring on this runtime); the staged buffer moves there.
  if (!s.store || s.store_dir != dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) co_return fail(ErrorCode::io, "checkpoint folder ", dir.string(), ": ", ec.message());
    offload::NvmeStoreOptions store_options;
    store_options.directory = dir;
    store_options.direct = offload::NvmeStore::supports_direct_io(dir);
    COSHARD_CO_TRY_ASSIGN(auto store, offload::NvmeStore::open(store_options));
    s.store = std::move(store);
    s.store_dir = dir;
  }
  pending.write = rt->spawn(write_rank_file(s.store, pending.name + ".partial", rank, std::move(staged), total));
  s.pending = std::move(pending);
  co_return Result<void>{};
}

async::Task<Result<void>> Trainer::finish_checkpoint() {
  if (!impl_->pending) co_return Result<void>{};
  co_return co_await impl_->publish();
}

async::Task<Result<void>> Trainer::Impl::publish() {
  PendingSave p = std::move(*pending);
  pending.reset();
  auto written = co_await p.write;
  if (written) staging = std::move(written->staging);
  const int rank = comm->rank(), world = comm->size();
  // Every rank learns every rank's outcome: [ok, bytes, crc].
  std::vector<std::int64_t> mine{written ? 1 : 0, written ? static_cast<std::int64_t>(written->bytes) : 0,
                                 written ? static_cast<std::int64_t>(written->crc32) : 0};
  COSHARD_CO_TRY_ASSIGN(auto all, co_await exchange(mine));
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
    for (int r = 0; r < world; ++r)
      files.push_back({{"rank", r}, {"name", rank_file(r)}, {"bytes", all[static_cast<std::size_t>(3 * r + 1)]},
                       {"crc32", all[static_cast<std::size_t>(3 * r + 2)]}});
    manifest["files"] = std::move(files);
    const std::string text = manifest.dump(1);
    async::Runtime* rt = async::Runtime::current();
    // Named, not a temporary in the co_await (GCC 12 destroys such temporaries twice).
    auto publish_files = [dir = p.dir, name = p.name, text, keep = config.keep_checkpoints]() -> Result<void> {
      const fs::path partial = dir / (name + ".partial"), final_dir = dir / name;
      COSHARD_TRY(write_file_atomic(partial / "manifest.json", text));
      std::error_code ec;
      if (fs::exists(final_dir, ec)) {  // a checkpoint of this step already (a resumed run saving again)
        const fs::path old = dir / (name + ".replaced");
        fs::remove_all(old, ec);
        fs::rename(final_dir, old, ec);
        if (ec) return fail(ErrorCode::io, "moving the older ", final_dir.string(), " aside: ", ec.message());
      }
      fs::rename(partial, final_dir, ec);
      if (ec) return fail(ErrorCode::io, "publishing ", partial.string(), " as ", final_dir.string(), ": ", ec.message());
      COSHARD_TRY(fsync_path(dir, O_RDONLY | O_DIRECTORY));
      COSHARD_TRY(write_file_atomic(dir / "latest", name + "\n"));
      fs::remove_all(dir / (name + ".replaced"), ec);
      if (keep > 0) remove_oldest_checkpoints(dir, name, static_cast<std::size_t>(keep));
      return {};
    };
    auto done = co_await rt->spawn_blocking(std::move(publish_files));
    if (!done) {
      published = 0;
      error = done.error().message();
    }
  }
  // Everyone returns once rank 0 has published (or failed to).
  std::vector<std::int64_t> outcome{published};  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY_ASSIGN(auto status, co_await exchange(std::move(outcome)));
  if (status[0] != 1)
    co_return fail(ErrorCode::io, "checkpoint ", p.name, ": rank 0 could not publish it",
                   error.empty() ? std::string() : ": " + error);
  co_return Result<void>{};
}

// ---- load ----

namespace {

using Manifest = CheckpointManifest;

void remove_oldest_checkpoints(const fs::path& dir, const std::string& latest, std::size_t keep) {
  std::vector<std::pair<std::int64_t, fs::path>> published;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string n = entry.path().filename().string();
    if (is_checkpoint_folder_name(n) && entry.is_directory(ec)) published.emplace_back(std::stoll(n.substr(5)), entry.path());
  }
  std::sort(published.begin(), published.end());
  for (std::size_t i = 0; i + keep < published.size(); ++i)
    if (published[i].second.filename() != latest) fs::remove_all(published[i].second, ec);
}

Result<fs::path> resolve_checkpoint(const fs::path& dir) {
  std::error_code ec;
  if (fs::exists(dir / "manifest.json", ec)) return dir;
  const fs::path latest = dir / "latest";
  if (!fs::exists(latest, ec))
    return fail(ErrorCode::io, "checkpoint ", dir.string(), ": neither a manifest.json nor a 'latest' file there");
  // `latest` holds one short line; anything else (a folder, a link to some other file) is named
  // by what it is, never echoed.
  auto bytes = read_file(latest, 4096);
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
  return dir / name;
}

Result<Manifest> read_manifest(const fs::path& folder) {
  const fs::path path = folder / "manifest.json";
  COSHARD_TRY_ASSIGN(auto bytes, read_file(path));
  return parse_checkpoint_manifest(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                                   path.string());
}

// Everything one rank needs from a checkpoint, read and checked, in host memory.
struct Loaded {
  std::int64_t step = 0;
  std::vector<std::byte> optimizer_state;
  // Per unit, the new block's bytes: params (dtype), master, state1, state2 (f32; empty if none).
  struct Block {
    std::vector<std::byte> params, master, state1, state2;
  };
  std::vector<Block> blocks;
};

// Every field of the run's identity against the checkpoint's, all differences in one message.
Result<void> check_identity(const Manifest& m, const std::map<std::string, std::string>& mine, const std::string& where) {
  if (m.run.empty()) return {};  // saved before run identities were recorded
  std::string diffs;
  auto add = [&](const std::string& key, const std::string& saved, const std::string& now) {
    diffs += (diffs.empty() ? "" : "; ") + key + ": saved " + saved + ", this run " + now;
  };
  for (const auto& [key, saved] : m.run) {
    auto it = mine.find(key);
    if (it == mine.end()) add(key, saved, "(not set)");
    else if (it->second != saved) add(key, saved, it->second);
  }
  for (const auto& [key, now] : mine)
    if (!m.run.contains(key)) add(key, "(not set)", now);
  if (diffs.empty()) return {};
  return fail(ErrorCode::invalid_argument, where, ": a different run (", diffs,
              "); these define a run and cannot change on resume (docs/reliability.md lists what can)");
}

Result<Loaded> read_checkpoint(const fs::path& dir, const std::vector<zero::FetchUnitInfo>& shards,
                               zero::ShardLayout kinds, int rank, DataType dtype, std::string_view optimizer,
                               const std::map<std::string, std::string>& identity) {
  COSHARD_TRY_ASSIGN(const fs::path folder, resolve_checkpoint(dir));
  COSHARD_TRY_ASSIGN(const Manifest m, read_manifest(folder));
  const std::string where = "checkpoint " + folder.string();
  COSHARD_TRY(check_identity(m, identity, where));
  if (m.dtype != collectives::to_string(dtype))
    return fail(ErrorCode::invalid_argument, where, ": saved in ", m.dtype, ", this run trains in ",
                collectives::to_string(dtype));
  if (m.optimizer != optimizer)
    return fail(ErrorCode::invalid_argument, where, ": optimizer ", m.optimizer, ", this run uses ", optimizer);
  if (m.units.size() != shards.size())
    return fail(ErrorCode::invalid_argument, where, ": ", m.units.size(), " fetch units, this model has ",
                shards.size(), " (another model, or another module_granularity_bytes?)");
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto& a = m.units[i];
    const auto& b = shards[i];
    if (a.parameters != b.parameters || a.numel != b.numel)
      return fail(ErrorCode::invalid_argument, where, ": unit ", i, " holds ", a.name, " (", a.numel,
                  " elements), this model's unit ", i, " is ", b.name, " (", b.numel, " elements)");
  }

  const std::size_t elem = collectives::size_of(dtype);
  std::map<int, modules::SafetensorsFile> files;  // old rank -> its file, read and checked
  auto file_of = [&](int old_rank) -> Result<const modules::SafetensorsFile*> {
    if (auto it = files.find(old_rank); it != files.end()) return &it->second;
    const auto& rec = m.files[static_cast<std::size_t>(old_rank)];
    const fs::path path = folder / rec.name;
    COSHARD_TRY_ASSIGN(auto bytes, read_file(path));
    if (bytes.size() != rec.bytes)
      return fail(ErrorCode::io, path.string(), ": ", bytes.size(), " bytes, the manifest says ", rec.bytes,
                  " (truncated or replaced)");
    if (const auto crc = crc32_of(bytes); crc != rec.crc32)
      return fail(ErrorCode::io, path.string(), ": CRC-32 ", crc, ", the manifest says ", rec.crc32, " (corrupt)");
    COSHARD_TRY_ASSIGN(auto file, modules::SafetensorsFile::parse(std::move(bytes), path.string()));
    return &files.emplace(old_rank, std::move(file)).first->second;
  };

  Loaded out;
  out.step = m.step;
  out.optimizer_state = m.optimizer_state;
  for (std::size_t i = 0; i < shards.size(); ++i) {
    const auto& info = shards[i];
    const auto& mu = m.units[i];
    Loaded::Block block;
    const std::int64_t lo = rank * info.shard, hi = lo + info.shard;  // this rank's new block
    // One kind of tensor: copy [lo, min(hi, numel)) from the old files; padding stays zero.
    auto gather = [&](std::string_view kind, std::size_t size, DataType expect,
                      std::vector<std::byte>& dst) -> Result<void> {
      dst.assign(static_cast<std::size_t>(info.shard) * size, std::byte{0});
      const std::string name = tensor_name(i, kind);
      for (std::int64_t at = lo; at < std::min(hi, mu.numel);) {
        const int old_rank = static_cast<int>(at / mu.shard);
        const std::int64_t old_lo = old_rank * mu.shard;
        const std::int64_t upto = std::min({hi, mu.numel, old_lo + mu.shard});
        COSHARD_TRY_ASSIGN(const auto* file, file_of(old_rank));
        const auto* t = file->find(name);
        if (!t || float_dtype_of(t->dtype) != expect || t->shape.size() != 1 || t->shape[0] != mu.shard)
          return fail(ErrorCode::invalid_argument, where, ": ", m.files[static_cast<std::size_t>(old_rank)].name,
                      " lacks ", name, " as ", collectives::to_string(expect), "[", mu.shard, "]");
        const auto data = file->data(*t);
        std::memcpy(dst.data() + static_cast<std::size_t>(at - lo) * size,
                    data.data() + static_cast<std::size_t>(at - old_lo) * size, static_cast<std::size_t>(upto - at) * size);
        at = upto;
      }
      return {};
    };
    COSHARD_TRY(gather("param", elem, dtype, block.params));
    if (kinds.master) {
      // An f32 run's master is its parameters: a checkpoint of a run that kept none (the
      // optimizer on the device) gives them.
      bool absent = false;
      if (dtype == DataType::f32 && lo < mu.numel) {
        COSHARD_TRY_ASSIGN(const auto* first, file_of(static_cast<int>(lo / mu.shard)));
        absent = first->find(tensor_name(i, "master")) == nullptr;
      }
      if (absent)
        block.master = block.params;
      else
        COSHARD_TRY(gather("master", 4, DataType::f32, block.master));
    }
    if (kinds.states >= 1) COSHARD_TRY(gather("state1", 4, DataType::f32, block.state1));
    if (kinds.states >= 2) COSHARD_TRY(gather("state2", 4, DataType::f32, block.state2));
    out.blocks.push_back(std::move(block));
  }
  return out;
}

}  // namespace

async::Task<Result<void>> Trainer::load_checkpoint(const fs::path& dir) {
  Impl& s = *impl_;
  COSHARD_CO_TRY(co_await finish_checkpoint());
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::internal, "load_checkpoint: not on a runtime");
  const auto shards = s.engine->units();
  const zero::ShardLayout kinds = s.engine->shard_layout();
  const int rank = s.comm->rank();
  const DataType dtype = s.config.dtype;
  const std::string optimizer(to_string(s.config.optimizer));
  const auto identity = s.config.identity();
  auto read = [&dir, &shards, kinds, rank, dtype, &optimizer, &identity]() {
    return read_checkpoint(dir, shards, kinds, rank, dtype, optimizer, identity);
  };
  auto loaded = co_await rt->spawn_blocking(std::move(read));
  // No state changes unless every rank read and checked its part.
  std::vector<std::int64_t> outcome{loaded ? 1 : 0};  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY_ASSIGN(auto oks, co_await s.exchange(std::move(outcome)));
  if (!loaded) co_return fail(std::move(loaded).error());
  for (int r = 0; r < s.comm->size(); ++r)
    if (oks[static_cast<std::size_t>(r)] != 1)
      co_return fail(ErrorCode::invalid_argument, "checkpoint ", dir.string(), ": rank ", r,
                     " refused it (its error says why); nothing was loaded");

  // Every rank checked its part: each unit's block goes in as the engine visits it (with nvme
  // offload, into the swap buffer that is then written back to the store).
  std::size_t next = 0;
  auto load_unit = [&](const zero::UnitShard& sh) -> async::Task<Result<void>> {
    const auto& b = loaded->blocks[next++];
    COSHARD_CO_TRY(s.ctx->copy_from_host(sh.params, b.params));
    if (!b.master.empty()) COSHARD_CO_TRY(s.ctx->copy_from_host(sh.master, b.master));
    if (!b.state1.empty()) COSHARD_CO_TRY(s.ctx->copy_from_host(sh.state1, b.state1));
    if (!b.state2.empty()) COSHARD_CO_TRY(s.ctx->copy_from_host(sh.state2, b.state2));
    COSHARD_CO_TRY_ASSIGN(auto copied, s.ctx->stream().record());
    co_return co_await copied;
  };
  COSHARD_CO_TRY(co_await s.engine->visit_shards(load_unit, true));
  COSHARD_CO_TRY(s.ctx->copy_from_host(s.optimizer->step_state(), loaded->optimizer_state));
  s.steps = loaded->step;
  co_return Result<void>{};
}

// ---- export and import ----

async::Task<Result<void>> Trainer::export_safetensors(const fs::path& path) {
  Impl& s = *impl_;
  COSHARD_CO_TRY_ASSIGN(auto params, co_await s.engine->gather_parameters());
  std::int64_t ok = 1;
  std::string error;
  if (s.comm->rank() == 0) {
    COSHARD_CO_TRY_ASSIGN(const SafeDType dt, safe_dtype(s.config.dtype));
    auto write = [&]() -> Result<void> {
      std::vector<modules::SafeTensorView> views;
      for (const auto& p : params) {
        const auto dims = p.shape.dims();
        views.push_back({p.name, dt, std::vector<std::int64_t>(dims.begin(), dims.end()), p.bytes});
      }
      return modules::save_safetensors(path, views, {{"format", "pt"}, {"producer", "coshard"}});
    };
    auto done = co_await async::Runtime::current()->spawn_blocking(std::move(write));
    if (!done) {
      ok = 0;
      error = done.error().message();
    }
  }
  std::vector<std::int64_t> outcome{ok};  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY_ASSIGN(auto status, co_await s.exchange(std::move(outcome)));
  if (status[0] != 1)
    co_return fail(ErrorCode::io, "export to ", path.string(), " failed on rank 0", error.empty() ? "" : ": ", error);
  co_return Result<void>{};
}

async::Task<Result<void>> Trainer::load_safetensors(const fs::path& path) {
  Impl& s = *impl_;
  const DataType dtype = s.config.dtype;
  auto read = [&path, dtype]() -> Result<std::vector<zero::GatheredParameter>> {
        COSHARD_TRY_ASSIGN(auto file, modules::SafetensorsFile::load(path));
        std::vector<zero::GatheredParameter> out;
        for (const auto& t : file.tensors()) {
          const auto from = float_dtype_of(t.dtype);
          if (!from)
            return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name, " is ", modules::to_string(t.dtype),
                        "; expected a float dtype (F64, F32, BF16, F16)");
          if (t.shape.size() > 4)
            return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name, " has ", t.shape.size(),
                        " dimensions (at most 4)");
          const modules::Shape shape = modules::Shape::from(t.shape);
          const auto values = modules::decode_values(file.data(t), *from);
          // Non-finite initial weights would only skip every step (inf/NaN gradients) and exit 0.
          for (std::size_t i = 0; i < values.size(); ++i)
            if (!std::isfinite(values[i]))
              return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name, " element ", i, " is ",
                          values[i], "; initial weights must be finite");
          out.push_back({t.name, shape, modules::encode_values(values, dtype)});
        }
        return out;
  };
  auto values = co_await async::Runtime::current()->spawn_blocking(std::move(read));
  if (!values) co_return fail(std::move(values).error());
  COSHARD_CO_TRY(co_await s.engine->load_parameters(*values));
  co_return Result<void>{};
}

}  // namespace coshard::trainer
