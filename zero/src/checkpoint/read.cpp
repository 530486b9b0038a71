// A saved checkpoint folder, read for a load (checkpoint/read.hpp): `latest` resolved, the
// manifest read and checked, each rank file read and checked on first use.
#include "checkpoint/read.hpp"

#include <algorithm>
#include <cstring>
#include <span>

#include "checkpoint/files.hpp"
#include "coshard/async/files.hpp"

namespace coshard::zero::detail {

using namespace modules;
namespace fs = std::filesystem;

std::string run_differences(const std::map<std::string, std::string>& saved, const std::map<std::string, std::string>& mine) {
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

Result<std::string> read_latest(const fs::path& dir) {
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

Result<CheckpointManifest> read_manifest(const fs::path& folder, std::size_t max_bytes) {
  const fs::path path = folder / "manifest.json";
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, max_bytes, "file"));
  return parse_checkpoint_manifest(std::string_view(reinterpret_cast<const char*>(bytes.data()), bytes.size()),
                                   path.string());
}

Result<void> check_run(const CheckpointManifest& m, const Loader& l, const std::string& where) {
  if (!m.run.empty()) {  // (saved without one: not compared)
    const std::string diffs = run_differences(m.run, l.run);
    if (!diffs.empty())
      return fail(ErrorCode::invalid_argument, where, ": a different run (", diffs,
                  "); these define a run and cannot change on resume (docs/reliability.md lists what can)");
  }
  if (m.dtype != to_string(l.dtype))
    return fail(ErrorCode::invalid_argument, where, ": saved in ", m.dtype, ", this run trains in ", to_string(l.dtype),
                ": resume it in ", m.dtype);
  if (m.optimizer != l.optimizer)
    return fail(ErrorCode::invalid_argument, where, ": optimizer ", m.optimizer, ", this run uses ", l.optimizer);
  return {};
}

namespace {

std::string describe_split(int dim, std::span<const std::int64_t> segments, std::span<const std::int64_t> whole) {
  std::string text = "along dimension " + std::to_string(dim) + " in segments [";
  for (std::size_t i = 0; i < segments.size(); ++i) text += (i ? ", " : "") + std::to_string(segments[i]);
  return text + "] of " + Shape::from(std::vector<std::int64_t>(whole.begin(), whole.end())).to_string();
}

}  // namespace

Result<void> check_same_split(const std::string& name, const Parameter& p, const CheckpointManifest::Unit::Split* saved,
                              const std::string& where) {
  const TensorSplit* mine = p.split();
  if (!mine && !saved) return {};
  const std::string theirs = saved ? "split " + describe_split(saved->dim, saved->segments, saved->whole) : "whole";
  const std::string ours = mine ? "splits it " + describe_split(mine->dim, mine->segments, mine->whole.dims()) : "keeps it whole";
  const bool same = mine && saved && mine->dim == saved->dim && mine->segments == saved->segments &&
                    std::equal(saved->whole.begin(), saved->whole.end(), mine->whole.dims().begin(), mine->whole.dims().end());
  if (same) return {};
  return fail(ErrorCode::invalid_argument, where, ": ", name, " was saved ", theirs, ", this model ", ours,
              " (another model, or a manifest edited?); nothing was loaded");
}

Unexpected trained_but_frozen_when_saved(const std::string& where, const std::string& what) {
  return fail(ErrorCode::invalid_argument, where, ": ", what, " was frozen when saved, so the checkpoint holds no ",
              "optimizer state for it, and this run trains it; freeze the same parameters to resume, or start a new ",
              "run from the checkpoint's weights");
}

Unexpected trained_but_left_out_when_saved(const std::string& where, const std::string& what) {
  return fail(ErrorCode::invalid_argument, where, ": ", what, " was frozen and left out when saved (a LoRA base: its ",
              "values come from the base weights), and this run trains it; freeze it to resume");
}

std::vector<std::byte>& bytes_of(Loaded::Block& block, BlockKind k) noexcept {
  switch (k) {
    case BlockKind::param: return block.params;
    case BlockKind::master: return block.master;
    case BlockKind::state1: return block.state1;
    case BlockKind::state2: return block.state2;
  }
  return block.params;
}

Result<SavedFolder> SavedFolder::open(const fs::path& dir) {
  SavedFolder out;
  std::error_code ec;
  if (fs::exists(dir / "manifest.json", ec)) {
    out.folder_ = dir;
  } else {
    if (!fs::exists(dir / "latest", ec))
      return fail(ErrorCode::io, "checkpoint ", dir.string(), ": neither a manifest.json nor a 'latest' file there");
    COSHARD_TRY_ASSIGN(auto name, read_latest(dir));
    out.folder_ = dir / name;
  }
  COSHARD_TRY_ASSIGN(out.m_, read_manifest(out.folder_));
  out.where_ = "checkpoint " + out.folder_.string();
  // A folder named for its step (as every save names it) must hold that step: a manifest edited or
  // copied from another folder would resume the run at a step it never reached.
  if (const std::string name = out.folder_.filename().string();
      is_checkpoint_folder_name(name) && checkpoint_folder_step(name) != out.m_.step)
    return fail(ErrorCode::invalid_argument, out.where_, ": its manifest says step ", out.m_.step,
                ", the folder's name step ", name.substr(5),
                " (a manifest edited or copied from another checkpoint; nothing was loaded)");
  return out;
}

Result<const SafetensorsFile*> SavedFolder::file(int rank) {
  if (auto it = files_.find(rank); it != files_.end()) return &it->second;
  const auto& rec = m_.files[static_cast<std::size_t>(rank)];
  const fs::path path = folder_ / rec.name;
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, std::numeric_limits<std::size_t>::max(), "file"));
  if (bytes.size() != rec.bytes)
    return fail(ErrorCode::io, path.string(), ": ", bytes.size(), " bytes, the manifest says ", rec.bytes,
                " (truncated or replaced)");
  if (const auto crc = async::crc32_of(bytes); crc != rec.crc32)
    return fail(ErrorCode::io, path.string(), ": CRC-32 ", crc, ", the manifest says ", rec.crc32, " (corrupt)");
  COSHARD_TRY_ASSIGN(auto parsed, SafetensorsFile::parse(std::move(bytes), path.string()));
  return &files_.emplace(rank, std::move(parsed)).first->second;
}

Result<bool> SavedFolder::has(std::size_t unit, std::string_view kind, std::int64_t at) {
  const auto& mu = m_.units[unit];
  COSHARD_TRY_ASSIGN(const auto* f, file(mu.first_file + static_cast<int>(at / mu.shard)));
  return f->find(block_tensor_name(unit, kind)) != nullptr;
}

Result<void> SavedFolder::read(std::size_t unit, std::string_view kind, DataType expect, std::size_t size,
                               std::int64_t lo, std::int64_t hi, std::byte* dst) {
  const std::int64_t shard = m_.units[unit].shard;
  for (std::int64_t at = lo; at < hi;) {
    const int block = static_cast<int>(at / shard);
    const std::int64_t upto = std::min(hi, (block + 1) * shard);
    COSHARD_TRY(read_from(block, unit, kind, {}, expect, size, at, upto, dst + static_cast<std::size_t>(at - lo) * size));
    at = upto;
  }
  return {};
}

Result<void> SavedFolder::read_from(int block, std::size_t unit, std::string_view kind, std::string_view fallback,
                                    DataType expect, std::size_t size, std::int64_t lo, std::int64_t hi, std::byte* dst) {
  const auto& mu = m_.units[unit];
  const int rank = mu.first_file + block;
  COSHARD_TRY_ASSIGN(const auto* f, file(rank));
  std::string name = block_tensor_name(unit, kind);
  const auto* t = f->find(name);
  if (!t && !fallback.empty()) t = f->find(name = block_tensor_name(unit, fallback));
  if (!t || float_dtype_of(t->dtype) != expect || t->shape.size() != 1 || t->shape[0] != mu.shard)
    return fail(ErrorCode::invalid_argument, where_, ": ", m_.files[static_cast<std::size_t>(rank)].name, " lacks ", name,
                " as ", to_string(expect), "[", mu.shard, "]");
  const std::int64_t rank_lo = block * mu.shard;
  const auto data = f->data(*t);
  std::memcpy(dst, data.data() + static_cast<std::size_t>(lo - rank_lo) * size, static_cast<std::size_t>(hi - lo) * size);
  return {};
}

}  // namespace coshard::zero::detail
