// Sharded checkpoints of a ZeRO engine (Engine::save_checkpoint, load_checkpoint): what they
// hold on disk, the options a save and a load take, and the manifest that describes one.
//
// On disk, under the checkpoint folder DIR:
//   DIR/step-00000042/manifest.json            format, step, world size, stage, dtype, optimizer,
//                                              units (names, parameters, numel), files (bytes, CRC-32),
//                                              the optimizer's step state, the run's identity
//   DIR/step-00000042/rank-00001.safetensors   rank 1's blocks: u<i>.param (dtype), u<i>.master (f32,
//                                              when kept apart), u<i>.state1, u<i>.state2 (f32)
//   DIR/latest                                 "step-00000042"
// With tensor parallelism (EngineOptions::tensor_parallel) of size T, each tensor rank t's data
// group saves the same under DIR/tensor-t-of-T/, its manifest recording each parameter's part
// shape and split (CheckpointManifest::Unit::shapes, splits), so that a load at another tensor
// size puts each split parameter's values (and its master and optimizer states, elementwise)
// together whole from the old parts and cuts the new ones.
// Rank i's file holds elements [i * shard, (i + 1) * shard) of each padded unit, for the ranks i of
// the unit's first shard group (every rank, unless hybrid sharding shards it over fewer; rank 0
// (expert parallelism: the experts each run of ranks holds are listed for every run, under their
// own names, their blocks in that run's files: Unit::first_file)
// alone at stage 0), so a load at another world size, stage or shard group size reads, for each
// unit, the elements of its new block from whichever old files hold them.
//
// A save stages this rank's blocks in a pinned buffer (the host awaits the copies' events; it
// never blocks) and writes its file behind training into DIR/step-N.partial/. Publishing (the
// next finish_checkpoint, save_checkpoint or load_checkpoint, or the begin_step of the second
// step after the save, whichever comes first) waits for every rank's file; rank 0 writes the
// manifest, renames the folder into place and then replaces `latest`. A crash at any point leaves
// the previous checkpoint whole and `latest` pointing at it.
//
// Outside input: the manifest parser trusts nothing, and every field's type and range is checked
// before use; a load checks every rank's part (sizes, CRC-32, identity, units) before anything
// changes on any rank.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::zero {

struct CheckpointOptions {
  // What defines the run, by name (the data, the seed, the model's shape when the parameters do
  // not show it, ...): a save records it; a load compares it key by key with the checkpoint's and
  // names every difference. A checkpoint saved without one is not compared.
  std::map<std::string, std::string> run;
  // Published checkpoints kept in DIR (save): after each publish the oldest beyond this many go,
  // never the one `latest` names. 0: all are kept.
  int keep = 0;
  // save: a published checkpoint in DIR of the same step, or the one `latest` names, saved by a
  // run of another identity (`run` differs) is another run's work: the save is refused, naming
  // the differences, unless this is true.
  bool replace_other_run = false;
  // save: false leaves out the frozen units' parameters (a LoRA run's base: the checkpoint holds the
  // adapters and their optimizer state alone). A load then keeps the values those units have, so it
  // needs them given first (initialize with the run's seed, load_parameters or load_hf_llama with
  // the same base, whose identity `run` should name): an engine given no values is refused.
  bool frozen_units = true;
};

struct CheckpointManifest {
  static constexpr std::string_view kFormat = "coshard-checkpoint";
  static constexpr int kVersion = 1;

  std::int64_t step = 0;
  int world = 0;
  int zero_stage = 0;
  std::string dtype, optimizer;
  std::vector<std::byte> optimizer_state;  // 32 bytes: the optimizer's device step state
  struct Unit {
    std::string name;
    std::vector<std::string> parameters;
    std::int64_t numel = 0, shard = 0;  // rank i's file holds elements [i * shard, (i + 1) * shard)
    // The ranks whose files hold its blocks, [0, shard_ranks): its shard group's size when saved
    // (hybrid sharding writes each block once, from the first group; 1 at stage 0).
    int shard_ranks = 0;
    // The first rank file holding its blocks: its blocks are in the files of ranks [first_file,
    // first_file + shard_ranks). 0 but for an expert-parallel unit (FetchUnitInfo::expert_parallel),
    // saved once for each expert rank q under that rank's names, by the run of world / P ranks
    // holding those experts (first_file = q * world / P). Absent in older manifests: 0.
    int first_file = 0;
    // Every parameter frozen: the files hold its parameters only (no master, no state), so a run
    // that trains it cannot resume from here (a run that freezes a unit saved trained can).
    bool frozen = false;
    // Its parameters are in the files (false: a frozen unit left out, CheckpointOptions::frozen_units).
    bool saved = true;
    // Each parameter's shape as saved (this tensor rank's part of a split one), in `parameters`'
    // order; their elements lie one after another in the unit. Empty in older manifests.
    std::vector<std::vector<std::int64_t>> shapes;
    // Each parameter's tensor-parallel split (modules::TensorSplit, of `tensor_size` parts of which
    // this folder holds part `tensor_rank`), or nothing for a replicated one; empty when saved
    // without tensor parallelism or in older manifests.
    struct Split {
      int dim = 0;
      std::vector<std::int64_t> segments, whole;
    };
    std::vector<std::optional<Split>> splits;
  };
  std::vector<Unit> units;
  struct File {
    std::string name;  // rank-00000.safetensors, ...
    std::uint64_t bytes = 0;
    std::uint32_t crc32 = 0;
  };
  std::vector<File> files;  // one per rank, in rank order
  // The tensor-parallel size of the save and the tensor rank whose folder this is (1 and 0: none).
  int tensor_size = 1, tensor_rank = 0;
  // CheckpointOptions::run of the save. Absent in older manifests.
  std::map<std::string, std::string> run;
  // The parameters that were left out of some of the steps (no gradient), with how many: their
  // AdamW bias correction counts their own steps, as PyTorch's does. Absent in older manifests
  // (every parameter then counts the optimizer's steps).
  std::map<std::string, std::int64_t> steps_missed;
};

// "rank-00003.safetensors"
std::string checkpoint_rank_file(int rank);
// "step-" and up to 18 digits: the name of a published checkpoint folder, the only names
// `latest` may point at.
bool is_checkpoint_folder_name(std::string_view name) noexcept;
// "tensor-1-of-2": tensor rank 1 of 2's folder of checkpoints; whether a name is one (rank below
// size, size from 2), and if so its size (0: not one).
std::string tensor_folder_name(int rank, int size);
int tensor_folder_size(std::string_view name) noexcept;
// Parses and checks a manifest's text; `source` names it in errors.
Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, std::string_view source);

}  // namespace coshard::zero
