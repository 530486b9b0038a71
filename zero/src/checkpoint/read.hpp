// Reading a sharded checkpoint's folder (checkpoint.hpp has the layout) for a load: what the
// loading engine is, what a rank takes from the files (its new blocks), and one saved folder
// with its rank files, each read and checked (size, CRC-32, tensor names and shapes) on first use.
// engine/checkpoint_load.cpp loads at the tensor size saved; checkpoint/reshard.cpp at another.
// Private: not installed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "checkpoint/files.hpp"
#include "coshard/modules/safetensors.hpp"
#include "coshard/zero/checkpoint.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

// What the loading engine is, for the checks and the cuts.
struct Loader {
  std::vector<FetchUnitInfo> units;
  ShardLayout kept;
  std::vector<std::int64_t> block_offsets;  // per unit: where this rank's block starts (0: stage 0, the whole unit)
  DataType dtype = DataType::f32;
  std::string optimizer;
  std::map<std::string, std::string> run;
  std::unordered_map<std::string, const Parameter*> parameters;  // by full name (their shapes and splits)
  int tensor_size = 1, tensor_rank = 0;                           // EngineOptions::tensor_parallel's
  // Expert parallelism: the names of the experts other expert ranks hold (in the checkpoint, not in
  // this rank's model), passed over by a load parameter by parameter.
  std::unordered_set<std::string> elsewhere{};
};

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

// The run's identity, dtype and optimizer against the checkpoint's, every difference named.
Result<void> check_run(const CheckpointManifest& m, const Loader& l, const std::string& where);

// A parameter's tensor-parallel cut as a manifest records it (`saved`, null: whole) against this
// model's `p`: the same dimension, segments and whole, else refused naming both (parts put
// together along a false cut trained on, 2e-5 off).
Result<void> check_same_split(const std::string& name, const Parameter& p, const CheckpointManifest::Unit::Split* saved,
                              const std::string& where);

// The refusals of a resume that trains `what` ("unit h0.attn", or a parameter), which the save
// froze: the checkpoint holds no optimizer state for it, or (left out) no values either.
Unexpected trained_but_frozen_when_saved(const std::string& where, const std::string& what);
Unexpected trained_but_left_out_when_saved(const std::string& where, const std::string& what);

// Where a loaded block keeps each kind's bytes.
std::vector<std::byte>& bytes_of(Loaded::Block& block, BlockKind k) noexcept;

// One published checkpoint folder: `dir` itself when it holds a manifest, else the folder its
// `latest` names; a manifest whose step is not its folder's name is refused.
class SavedFolder {
 public:
  static Result<SavedFolder> open(const std::filesystem::path& dir);

  const CheckpointManifest& manifest() const noexcept { return m_; }
  const std::filesystem::path& folder() const noexcept { return folder_; }
  // "checkpoint <folder>", for errors.
  const std::string& where() const noexcept { return where_; }

  // Whether unit `unit`'s block of `kind` is in the file holding element `at` of it.
  Result<bool> has(std::size_t unit, std::string_view kind, std::int64_t at);
  // Elements [lo, hi) of unit `unit`'s `kind` (hi at most its numel), as `expect` elements of
  // `size` bytes each, into dst, from whichever rank files hold them.
  Result<void> read(std::size_t unit, std::string_view kind, DataType expect, std::size_t size, std::int64_t lo,
                    std::int64_t hi, std::byte* dst);
  // The same from the file of the unit's block `block` alone (rank first_file + block; [lo, hi)
  // within that block); `fallback`, unless empty, is read where the file holds no `kind` (an f32
  // run's master: its parameters).
  Result<void> read_from(int block, std::size_t unit, std::string_view kind, std::string_view fallback, DataType expect,
                         std::size_t size, std::int64_t lo, std::int64_t hi, std::byte* dst);
  // Drops a rank file read into memory (read and checked again if asked for again).
  void release(int rank) { files_.erase(rank); }

 private:
  Result<const modules::SafetensorsFile*> file(int rank);

  std::filesystem::path folder_;
  CheckpointManifest m_;
  std::string where_;
  std::map<int, modules::SafetensorsFile> files_;  // saved rank -> its file, read and checked
};

// A load at the tensor size the folders were saved at: this rank's blocks from its folder.
Result<Loaded> read_checkpoint(SavedFolder& folder, const Loader& l);
// A load at another tensor size (this run's: `tensor_size`): `folders[t]` is tensor rank t's of
// the save (one, at size 1); this rank's parts (its parameters' splits) cut from the whole
// parameters put together.
Result<Loaded> read_resharded(std::vector<SavedFolder>& folders, const Loader& l, int tensor_size);

}  // namespace coshard::zero::detail
