// A checkpoint loaded at another tensor size than it was saved at (checkpoint/read.hpp): the
// units differ (each holds other parts, and small ones coalesce otherwise), so this goes parameter
// by parameter. Each saved folder is indexed (which unit and offset hold each parameter's part, of
// which split); each parameter of this rank's blocks is put together whole from the saved parts
// (its params, and its master and optimizer states: elementwise, so they cut as the params do),
// this rank's part is cut from it, and the elements of this rank's block go in. Everything is
// checked by name first: the same parameters, the same whole shapes, the same splits. A rank holds
// the saved parts of the parameters its blocks touch and one saved file at a time (Resharder).
#include <algorithm>
#include <cstring>
#include <map>
#include <unordered_map>

#include "checkpoint/files.hpp"
#include "checkpoint/read.hpp"

namespace coshard::zero::detail {

using namespace modules;

namespace {

// Where one tensor rank's part of a saved parameter is.
struct SavedPart {
  std::size_t unit = 0;
  std::int64_t offset = 0, numel = 0;                   // in the unit's elements
  const CheckpointManifest::Unit::Split* split = nullptr;  // null: saved whole (replicated, or no tensor parallelism)
  std::vector<std::int64_t> whole;                      // the whole parameter's shape
};
using SavedIndex = std::unordered_map<std::string, SavedPart>;


// Tensor rank `t` of `size`'s folder: every parameter's part, checked against this model's
// parameters (the same names, the same whole shapes).
Result<SavedIndex> index_folder(const SavedFolder& f, const Loader& l, int size, int t) {
  const CheckpointManifest& m = f.manifest();
  if (m.tensor_size != size || m.tensor_rank != t)
    return fail(ErrorCode::invalid_argument, f.where(), ": its manifest says tensor rank ", m.tensor_rank, " of ",
                m.tensor_size, ", its folder tensor rank ", t, " of ", size,
                size > 1 && m.tensor_size == 1 ? " (saved before checkpoints recorded their tensor splits: resume at "
                                                 "the tensor size it was saved at)"
                                               : " (a folder moved or copied from another checkpoint)");
  SavedIndex index;
  for (std::size_t j = 0; j < m.units.size(); ++j) {
    const auto& u = m.units[j];
    if (size > 1 && u.splits.empty())
      return fail(ErrorCode::invalid_argument, f.where(), ": unit ", u.name, " records no tensor splits (saved before "
                  "checkpoints did: resume at the tensor size it was saved at)");
    std::int64_t offset = 0;
    for (std::size_t k = 0; k < u.parameters.size(); ++k) {
      const std::string& name = u.parameters[k];
      const auto it = l.parameters.find(name);
      if (it == l.parameters.end() && l.elsewhere.contains(name) && !u.shapes.empty()) {
        offset += Shape::from(u.shapes[k]).numel();  // (another expert rank's expert)
        continue;
      }
      if (it == l.parameters.end())
        return fail(ErrorCode::invalid_argument, f.where(), ": it holds ", name,
                    ", which this model does not have (another model?)");
      SavedPart part{j, offset, 0, nullptr, {}};
      if (!u.shapes.empty()) {
        if (!u.splits.empty() && u.splits[k]) part.split = &*u.splits[k];
        part.whole = part.split ? part.split->whole : u.shapes[k];
        part.numel = Shape::from(u.shapes[k]).numel();
      } else {  // (a manifest from before shapes were recorded, saved whole: this model's whole shape)
        const Shape& whole = it->second->whole_shape();
        part.whole.assign(whole.dims().begin(), whole.dims().end());
        part.numel = whole.numel();
      }
      offset += part.numel;
      if (!index.emplace(name, std::move(part)).second)
        return fail(ErrorCode::invalid_argument, f.where(), ": ", name, " is in two units");
    }
    if (offset != u.numel)
      return fail(ErrorCode::invalid_argument, f.where(), ": unit ", u.name, " holds ", u.numel, " elements, its ",
                  "parameters at this model's shapes ", offset, " (another model?)");
  }
  return index;
}

// The same whole parameter, cut the same way where both are cut: what this model's `p` is.
Result<void> check_same_parameter(const std::string& name, const Parameter& p, const SavedPart& saved,
                                  const std::string& where) {
  const Shape& whole = p.whole_shape();
  if (!std::equal(saved.whole.begin(), saved.whole.end(), whole.dims().begin(), whole.dims().end()))
    return fail(ErrorCode::invalid_argument, where, ": ", name, " is ", Shape::from(saved.whole).to_string(), " whole in the checkpoint, ",
                whole.to_string(), " in this model (another model?)");
  const TensorSplit* mine = p.split();
  if (mine && saved.split) return check_same_split(name, p, saved.split, where);
  return {};
}

// Three passes, so that a rank holds one saved file at a time, not the checkpoint: which saved
// parts of which parameters this rank's blocks need (checked, staged empty), then every saved
// file read once, its pieces of those parts copied out and the file dropped, then each
// parameter put together whole, this rank's part cut and its block filled.
struct Resharder {
  std::vector<SavedFolder>& folders;
  std::vector<SavedIndex> indexes;  // [t]: folder t's
  const Loader& l;
  int saved_size = 1;
  std::string where;
  // One saved parameter of one kind: each saved tensor rank's part (rank 0's alone when saved whole).
  struct Staged {
    DataType dtype = DataType::f32;
    std::vector<std::vector<std::byte>> parts;
  };
  std::map<std::pair<std::string, std::string>, Staged> staged;  // by (parameter, kind)

  // The kinds of a unit's block this run keeps (a frozen unit: its parameters alone), each in its dtype.
  std::vector<BlockKind> kinds_of(const FetchUnitInfo& info) const {
    return info.frozen ? std::vector<BlockKind>{BlockKind::param} : block_kinds(l.kept);
  }
  DataType dtype_of(BlockKind k) const { return k == BlockKind::param ? l.dtype : DataType::f32; }

  // Calls visit(name, parameter's offset in the unit, [from, to) of it in this rank's block) for
  // each parameter of the unit with elements in the block [lo, lo + shard).
  template <class Visit>
  Result<void> for_each_in_block(const FetchUnitInfo& info, std::int64_t lo, Visit visit) {
    const std::int64_t hi = std::min(lo + info.shard, info.numel);
    std::int64_t offset = 0;
    for (const std::string& name : info.parameters) {
      const std::int64_t numel = l.parameters.at(name)->numel();
      const std::int64_t from = std::max(lo, offset), to = std::min(hi, offset + numel);
      if (from < to) COSHARD_TRY(visit(name, offset, from, to));
      offset += numel;
    }
    return {};
  }

  // Pass 1: one parameter's saved parts of one kind, checked and staged empty.
  Result<void> stage(const std::string& name, std::string_view kind, DataType dtype) {
    const SavedPart& first = indexes[0].at(name);
    Staged st{dtype, {}};
    const int parts = first.split ? saved_size : 1;
    for (int t = 0; t < parts; ++t) {
      const auto found = indexes[static_cast<std::size_t>(t)].find(name);
      if (found == indexes[static_cast<std::size_t>(t)].end() || (found->second.split == nullptr) != (first.split == nullptr))
        return fail(ErrorCode::invalid_argument, folders[static_cast<std::size_t>(t)].where(), ": ", name, " is ",
                    found == indexes[static_cast<std::size_t>(t)].end() ? "missing" : "split otherwise",
                    " (tensor rank 0's folder holds it ", first.split ? "split" : "whole", ")");
      const SavedPart& part = found->second;
      if (kind != "param" && folders[static_cast<std::size_t>(t)].manifest().units[part.unit].frozen)
        return trained_but_frozen_when_saved(where, name);
      st.parts.emplace_back(static_cast<std::size_t>(part.numel) * size_of(dtype));
    }
    staged.emplace(std::pair(name, std::string(kind)), std::move(st));
    return {};
  }

  // Pass 2: every saved file that holds a piece of a staged part, read once, in order; its pieces
  // copied out, then the file dropped.
  Result<void> read_staged() {
    struct Copy {
      std::size_t unit;
      int block;  // the unit's block the file holds
      std::string_view kind;
      DataType dtype;
      std::int64_t lo, hi;  // the unit's elements, within the file's block
      std::byte* dst;
    };
    std::vector<std::map<int, std::vector<Copy>>> by_file(folders.size());  // [t][saved rank]
    for (auto& [key, st] : staged) {
      const std::size_t size = size_of(st.dtype);
      for (std::size_t t = 0; t < st.parts.size(); ++t) {
        const SavedPart& part = indexes[t].at(key.first);
        const auto& saved_unit = folders[t].manifest().units[part.unit];
        const std::int64_t shard = saved_unit.shard;
        for (std::int64_t at = part.offset; at < part.offset + part.numel;) {
          const int block = static_cast<int>(at / shard);
          const std::int64_t upto = std::min(part.offset + part.numel, (block + 1) * shard);
          by_file[t][saved_unit.first_file + block].push_back(
              {part.unit, block, key.second, st.dtype, at, upto,
               st.parts[t].data() + static_cast<std::size_t>(at - part.offset) * size});
          at = upto;
        }
      }
    }
    for (std::size_t t = 0; t < folders.size(); ++t)
      for (const auto& [rank, copies] : by_file[t]) {
        for (const Copy& c : copies) {
          // An f32 run's master is its parameters: a checkpoint of a run that kept none gives them.
          const std::string_view fallback = c.kind == "master" && l.dtype == DataType::f32 ? "param" : "";
          COSHARD_TRY(folders[t].read_from(c.block, c.unit, c.kind, fallback, c.dtype, size_of(c.dtype), c.lo, c.hi, c.dst));
        }
        folders[t].release(rank);
      }
    return {};
  }

  // Pass 3: a staged parameter whole (its staging released).
  std::vector<double> whole_values(const std::string& name, std::string_view kind) {
    const auto it = staged.find(std::pair(name, std::string(kind)));
    const SavedPart& first = indexes[0].at(name);
    std::vector<double> whole;
    if (!first.split) {
      whole = decode_values(it->second.parts[0], it->second.dtype);
    } else {
      whole.resize(static_cast<std::size_t>(Shape::from(first.whole).numel()));
      for (int t = 0; t < saved_size; ++t) {
        const TensorSplit split{first.split->dim, first.split->segments, saved_size, t, Shape::from(first.whole)};
        split.place_part(decode_values(it->second.parts[static_cast<std::size_t>(t)], it->second.dtype), whole);
      }
    }
    staged.erase(it);
    return whole;
  }

  // Pass 3: this rank's block of a unit: every kind the run keeps, each parameter's part cut from
  // the whole and its elements within the block copied in.
  Result<Loaded::Block> block(const FetchUnitInfo& info, std::int64_t lo) {
    Loaded::Block out;
    for (const BlockKind k : kinds_of(info)) {
      std::vector<std::byte>& dst = bytes_of(out, k);
      const DataType dtype = dtype_of(k);
      const std::size_t size = size_of(dtype);
      dst.assign(static_cast<std::size_t>(info.shard) * size, std::byte{0});
      COSHARD_TRY(for_each_in_block(info, lo, [&](const std::string& name, std::int64_t offset, std::int64_t from,
                                                  std::int64_t to) -> Result<void> {
        const Parameter& p = *l.parameters.at(name);
        auto whole = whole_values(name, name_of(k));
        std::vector<double> part;
        if (const TensorSplit* split = p.split()) {
          part.resize(static_cast<std::size_t>(p.numel()));
          split->take_part(whole, part);
        } else {
          part = std::move(whole);
        }
        const auto bytes = encode_values(
            std::span<const double>(part).subspan(static_cast<std::size_t>(from - offset), static_cast<std::size_t>(to - from)),
            dtype);
        std::memcpy(dst.data() + static_cast<std::size_t>(from - lo) * size, bytes.data(), bytes.size());
        return {};
      }));
    }
    return out;
  }
};

}  // namespace

Result<Loaded> read_resharded(std::vector<SavedFolder>& folders, const Loader& l, int tensor_size) {
  const int saved_size = static_cast<int>(folders.size());
  const CheckpointManifest& m0 = folders.front().manifest();
  const std::string where = folders.front().where() + " (saved at tensor size " + std::to_string(saved_size) +
                            ", loading at " + std::to_string(tensor_size) + ")";
  Resharder r{folders, {}, l, saved_size, where, {}};
  for (int t = 0; t < saved_size; ++t) {
    const SavedFolder& f = folders[static_cast<std::size_t>(t)];
    COSHARD_TRY(check_run(f.manifest(), l, f.where()));
    if (f.manifest().step != m0.step)
      return fail(ErrorCode::invalid_argument, where, ": tensor rank ", t, "'s folder is at step ", f.manifest().step,
                  ", tensor rank 0's at step ", m0.step, " (a save cut short between the folders' publishes: point each ",
                  "folder's 'latest' at a step they all hold); nothing was loaded");
    if (f.manifest().optimizer_state != m0.optimizer_state)
      return fail(ErrorCode::invalid_argument, where, ": tensor rank ", t, "'s folder holds another optimizer step state ",
                  "than tensor rank 0's (folders of different runs?); nothing was loaded");
    COSHARD_TRY_ASSIGN(auto index, index_folder(f, l, saved_size, t));
    r.indexes.push_back(std::move(index));
  }
  // This model's every parameter in the checkpoint, the same whole, split the same way.
  for (const auto& [name, p] : l.parameters) {
    const auto it = r.indexes[0].find(name);
    if (it == r.indexes[0].end())
      return fail(ErrorCode::invalid_argument, where, ": this model's ", name, " is not in it (another model?)");
    COSHARD_TRY(check_same_parameter(name, *p, it->second, where));
  }

  Loaded out;
  out.step = m0.step;
  out.optimizer_state = m0.optimizer_state;
  for (const auto& f : folders) out.steps_missed.insert(f.manifest().steps_missed.begin(), f.manifest().steps_missed.end());
  std::vector<bool> left_out_unit(l.units.size(), false);
  for (std::size_t i = 0; i < l.units.size(); ++i) {
    const FetchUnitInfo& info = l.units[i];
    // Frozen units left out of the save (a LoRA base) keep the values they have: all of a unit's
    // parameters, or none of them.
    std::size_t left_out = 0;
    for (const std::string& name : info.parameters) {
      const SavedPart& part = r.indexes[0].at(name);
      left_out += folders[0].manifest().units[part.unit].saved ? 0 : 1;
    }
    if (left_out > 0) {
      if (!info.frozen) return trained_but_left_out_when_saved(where, "unit " + info.name);
      if (left_out != info.parameters.size())
        return fail(ErrorCode::invalid_argument, where, ": unit ", info.name, " holds parameters left out of the ",
                    "checkpoint (frozen, their values from the base weights) beside saved ones at tensor size ", tensor_size,
                    ": resume at tensor size ", saved_size, ", or save with the frozen units in");
      ++out.units_left_out;
      out.blocks.emplace_back();
      left_out_unit[i] = true;
      continue;
    }
    out.blocks.emplace_back();  // (filled in pass 3)
    for (const BlockKind k : r.kinds_of(info))
      COSHARD_TRY(r.for_each_in_block(info, l.block_offsets[i], [&](const std::string& name, std::int64_t, std::int64_t,
                                                                    std::int64_t) {
        return r.stage(name, name_of(k), r.dtype_of(k));
      }));
  }
  COSHARD_TRY(r.read_staged());
  for (std::size_t i = 0; i < l.units.size(); ++i) {
    if (left_out_unit[i]) continue;
    COSHARD_TRY_ASSIGN(out.blocks[i], r.block(l.units[i], l.block_offsets[i]));
  }
  return out;
}

}  // namespace coshard::zero::detail
