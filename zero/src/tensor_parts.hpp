// Tensor parallelism in the engine's files (EngineOptions::tensor_parallel): a rank's parameters
// are its parts of the split ones (modules::Parameter::split). Exports and loads deal in whole
// parameters: these put the parts together over the tensor group, and cut whole values back into
// this rank's parts; checkpoints keep one folder per tensor rank. Private: not installed.
#pragma once

#include <filesystem>
#include <string>
#include <unordered_map>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/zero/engine.hpp"
#include "rank_exchange.hpp"

namespace coshard::zero::detail {

// The group's size when the engine has tensor parallelism, else 1.
inline int tensor_size(const EngineOptions& o) noexcept { return o.tensor_parallel ? o.tensor_parallel->size() : 1; }

// Every parameter whole on every tensor rank: the split ones put together from each rank's part
// (one exchange over the group), the replicated ones as they are. `parameters` names each part's
// Parameter (its split), by name.
async::Task<Result<std::vector<GatheredParameter>>> whole_parameters(
    RankExchange& tensor, const std::unordered_map<std::string, const Parameter*>& parameters,
    std::vector<GatheredParameter> parts, DataType dtype);

// This rank's parts of whole values (the split ones cut, the others as they are); a whole value
// of another shape than its parameter's whole one is refused by name.
Result<std::vector<GatheredParameter>> parts_of_whole(const std::unordered_map<std::string, const Parameter*>& parameters,
                                                      std::vector<GatheredParameter> whole, DataType dtype,
                                                      std::string_view what);

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
