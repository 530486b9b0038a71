// Tensor parallelism in the engine's files (EngineOptions::tensor_parallel): a rank's parameters
// are its parts of the split ones (modules::Parameter::split). Exports and loads deal in whole
// parameters: these put the parts together over the tensor group, and cut whole values back into
// this rank's parts. (Checkpoints keep one folder per tensor rank: checkpoint/tensor_folders.hpp.)
// Private: not installed.
#pragma once

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

}  // namespace coshard::zero::detail
