#include "tensor_parts.hpp"

#include <cstring>

#include "coshard/modules/module.hpp"

namespace coshard::zero::detail {

async::Task<Result<std::vector<GatheredParameter>>> whole_parameters(
    RankExchange& tensor, const std::unordered_map<std::string, const Parameter*>& parameters,
    std::vector<GatheredParameter> parts, DataType dtype) {
  // Every split part's bytes, in order, as int64 words (the exchange's unit; the parts are the
  // same sizes on every tensor rank: the splits are even).
  std::vector<std::byte> mine;
  std::vector<std::pair<std::size_t, std::size_t>> at(parts.size(), {0, 0});  // (offset, bytes) of each split part
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const Parameter* p = parameters.at(parts[i].name);
    if (!p->split()) continue;
    at[i] = {mine.size(), parts[i].bytes.size()};
    mine.insert(mine.end(), parts[i].bytes.begin(), parts[i].bytes.end());
  }
  std::vector<std::int64_t> words((mine.size() + 7) / 8, 0);
  std::memcpy(words.data(), mine.data(), mine.size());
  COSHARD_CO_TRY_ASSIGN(const auto all, co_await tensor.all_ranks(std::move(words)));
  const std::size_t per_rank = all.size() / static_cast<std::size_t>(tensor.size());
  for (std::size_t i = 0; i < parts.size(); ++i) {
    const Parameter* p = parameters.at(parts[i].name);
    const modules::TensorSplit* split = p->split();
    if (!split) continue;
    std::vector<double> whole(static_cast<std::size_t>(split->whole.numel()));
    modules::TensorSplit each = *split;
    for (int r = 0; r < tensor.size(); ++r) {
      const auto* block = reinterpret_cast<const std::byte*>(all.data() + static_cast<std::size_t>(r) * per_rank);
      each.index = r;
      const auto values = modules::decode_values(std::span(block + at[i].first, at[i].second), dtype);
      each.place_part(values, whole);
    }
    parts[i].shape = split->whole;
    parts[i].bytes = modules::encode_values(whole, dtype);
  }
  co_return parts;
}

Result<std::vector<GatheredParameter>> parts_of_whole(const std::unordered_map<std::string, const Parameter*>& parameters,
                                                      std::vector<GatheredParameter> whole, DataType dtype,
                                                      std::string_view what) {
  for (auto& g : whole) {
    const auto it = parameters.find(g.name);
    if (it == parameters.end() || !it->second->split()) continue;  // (a name the load itself names, or replicated)
    const modules::TensorSplit& split = *it->second->split();
    if (!(g.shape == split.whole))
      return fail(ErrorCode::invalid_argument, what, ": ", g.name, " is ", g.shape.to_string(), ", expected the whole ",
                  split.whole.to_string(), " (this rank holds part ", split.index, " of ", split.parts, ": ",
                  it->second->shape().to_string(), ")");
    const auto values = modules::decode_values(g.bytes, dtype);
    std::vector<double> part(static_cast<std::size_t>(it->second->numel()));
    split.take_part(values, part);
    g.shape = it->second->shape();
    g.bytes = modules::encode_values(part, dtype);
  }
  return whole;
}

}  // namespace coshard::zero::detail
