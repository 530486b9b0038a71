// The files of a sharded checkpoint as save and load name them (checkpoint.hpp has the layout),
// and what the engine keeps between a save and its publish, and from one save to the next.
// Private: not installed.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/folder_lock.hpp"
#include "coshard/async/join_handle.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/modules/safetensors.hpp"
#include "coshard/offload/nvme_store.hpp"
#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

// "step-00000042": a published checkpoint's folder, and back (`name` must be one:
// is_checkpoint_folder_name, whose 18 digits at most always fit).
std::string checkpoint_folder_name(std::int64_t step);
std::int64_t checkpoint_folder_step(std::string_view name) noexcept;
// "u<unit>.<kind>": a block's tensor name in a rank file.
std::string block_tensor_name(std::size_t unit, std::string_view kind);

// The tensors of a unit's block in a rank file, in file order: its params, then its master and
// the optimizer's states when the engine keeps them (ShardLayout).
enum class BlockKind : std::uint8_t { param, master, state1, state2 };
std::vector<BlockKind> block_kinds(ShardLayout kept);
std::string_view name_of(BlockKind k) noexcept;
const Tensor& tensor_of(const UnitShard& shard, BlockKind k) noexcept;

// Every field of two run identities that differs, as "key: saved A, this run B; ..." (empty: the same).
std::string run_differences(const std::map<std::string, std::string>& saved, const std::map<std::string, std::string>& mine);

// The bounds a run identity is held to, on save (a refusal before anything is written) and on load
// alike, so that whatever is saved loads: at most kRunFields fields, each key at most kRunKeyChars
// characters and each value at most kRunValueChars. The error text names the field (empty: fits).
inline constexpr std::size_t kRunFields = 256, kRunKeyChars = 256, kRunValueChars = 4096;
std::string run_identity_error(const std::map<std::string, std::string>& run);

// The checkpoint folder name `dir/latest` holds (a refusal names what it holds instead), and a
// checkpoint folder's manifest, read and checked.
Result<std::string> read_latest(const std::filesystem::path& dir);
Result<CheckpointManifest> read_manifest(const std::filesystem::path& folder,
                                         std::size_t max_bytes = std::numeric_limits<std::size_t>::max());

// The safetensors dtype of parameters in `t` (an error names a dtype that has none).
Result<modules::SafeDType> safe_dtype(DataType t);

// One rank's file of a checkpoint, as written.
struct ShardFile {
  std::string name;  // inside the checkpoint folder
  std::uint64_t bytes = 0;
  std::uint32_t crc32 = 0;
  async::PinnedBuffer staging;  // the buffer it was written from, back for the next save
};

struct PendingSave {
  std::filesystem::path dir;  // the checkpoints' parent folder
  std::string name;           // "step-00000042"
  std::string manifest;       // rank 0: the manifest, less the file records
  int keep = 0;               // CheckpointOptions::keep
  async::JoinHandle<Result<ShardFile>> write;  // the rank file, written behind training
  int steps_left = 2;         // published at the start of the second step after the save
};

struct CheckpointState {
  std::optional<PendingSave> pending;
  // The pinned buffer a save assembles this rank's file in, kept between saves: pinning memory
  // afresh for every save cost a host-side page registration each time (cudaHostRegister with a
  // GPU) and made the resident set swing with the save cycle.
  async::PinnedBuffer staging;
  // Checkpoint files go through the offload store (io_uring; O_DIRECT where the filesystem allows).
  std::shared_ptr<offload::NvmeStore> store;
  std::filesystem::path store_dir;
  // Rank 0's claim of the folder it saves into (shared with the trainer binary's claim, if any):
  // a second run saving there, or starting over there, is refused while this one lives.
  async::FolderLock folder_lock;
};

}  // namespace coshard::zero::detail
