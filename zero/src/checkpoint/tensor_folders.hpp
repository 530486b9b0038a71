// Tensor parallelism's checkpoint folders (EngineOptions::tensor_parallel): one folder per tensor
// rank under the checkpoints' folder, and, for a load, which tensor size's folders to read.
// Private: not installed.
#pragma once

#include <filesystem>
#include <vector>

#include "coshard/zero/engine.hpp"

namespace coshard::zero::detail {

// Where this rank's checkpoints live under `dir`: dir itself, or dir/tensor-<t>-of-<T>.
std::filesystem::path tensor_checkpoint_dir(const std::filesystem::path& dir, const EngineOptions& o);
// The folders a load from `dir` reads: one tensor size's checkpoints, a folder per tensor rank of
// that size (`dir` itself at size 1). Of the sizes saved there (tensor-*-of-N folders; `latest`
// or a manifest in `dir` itself for size 1), the one whose newest step is the latest, this run's
// own size on a tie: a run resumed at another size and saving at its own goes on from its own.
struct SavedTensorLayout {
  int size = 1;
  std::vector<std::filesystem::path> dirs;  // [t]: tensor rank t's
};
// A `latest` there that names no checkpoint folder is refused, naming it.
Result<SavedTensorLayout> saved_tensor_layout(const std::filesystem::path& dir, int tensor);

}  // namespace coshard::zero::detail
