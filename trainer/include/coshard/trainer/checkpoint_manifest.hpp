// The manifest of a sharded checkpoint (DIR/step-N/manifest.json): what a checkpoint holds and
// how to check it. Outside input (a file on disk): the parser trusts nothing, and every field's
// type and range is checked before use.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::trainer {

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
  };
  std::vector<Unit> units;
  struct File {
    std::string name;  // rank-00000.safetensors, ...
    std::uint64_t bytes = 0;
    std::uint32_t crc32 = 0;
  };
  std::vector<File> files;  // one per rank, in rank order
  // What defines the run and may not change on resume (TrainerConfig::run_identity and the
  // trainer's own seed): compared key by key with the resuming run's. Absent in older manifests.
  std::map<std::string, std::string> run;
};

// "rank-00003.safetensors"
std::string checkpoint_rank_file(int rank);
// "step-" and up to 18 digits: the name of a published checkpoint folder, the only names
// `latest` may point at.
bool is_checkpoint_folder_name(std::string_view name) noexcept;
// Parses and checks a manifest's text; `source` names it in errors.
Result<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, std::string_view source);

}  // namespace coshard::trainer
