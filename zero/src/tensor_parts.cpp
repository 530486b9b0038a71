#include "tensor_parts.hpp"

#include <cstring>
#include <map>

#include "coshard/modules/module.hpp"
#include "checkpoint_files.hpp"

namespace coshard::zero::detail {

namespace fs = std::filesystem;

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

namespace {

std::filesystem::path tensor_rank_dir(const fs::path& dir, int rank, int size) {
  return size <= 1 ? dir : dir / tensor_folder_name(rank, size);
}

// The step `dir/latest` names; -1 when there is none (a folder whose first save never published).
// A `latest` that names no checkpoint folder is refused: choosing another size's older step over
// it would resume from older weights without a word.
Result<std::int64_t> latest_step(const fs::path& dir) {
  std::error_code ec;
  if (!fs::exists(dir / "latest", ec)) return std::int64_t{-1};
  COSHARD_TRY_ASSIGN(const std::string name, read_latest(dir));
  return checkpoint_folder_step(name);
}

}  // namespace

fs::path tensor_checkpoint_dir(const fs::path& dir, const EngineOptions& o) {
  return tensor_rank_dir(dir, tensor_size(o) > 1 ? o.tensor_parallel->rank() : 0, tensor_size(o));
}

Result<SavedTensorLayout> saved_tensor_layout(const fs::path& dir, int tensor) {
  auto layout_of = [&](int size) {
    SavedTensorLayout out{size, {}};
    for (int t = 0; t < size; ++t) out.dirs.push_back(tensor_rank_dir(dir, t, size));
    return out;
  };
  std::error_code ec;
  if (fs::exists(dir / "manifest.json", ec)) return layout_of(1);  // one checkpoint named itself
  std::map<int, std::int64_t> newest;  // tensor size saved -> its newest step
  if (fs::exists(dir / "latest", ec)) {
    COSHARD_TRY_ASSIGN(const std::int64_t latest, latest_step(dir));
    newest[1] = latest;
  }
  if (fs::is_directory(dir, ec))
    for (const auto& entry : fs::directory_iterator(dir, ec)) {
      const int n = tensor_folder_size(entry.path().filename().string());
      if (n == 0) continue;
      COSHARD_TRY_ASSIGN(const std::int64_t latest, latest_step(entry.path()));
      auto& step = newest.try_emplace(n, -1).first->second;
      step = std::max(step, latest);
    }
  int chosen = tensor;  // (nothing saved: this run's own folders, which the load names as missing)
  if (!newest.empty() && !newest.contains(tensor)) chosen = newest.begin()->first;
  for (const auto& [size, step] : newest)
    if (step > newest.at(chosen) || (step == newest.at(chosen) && size == tensor)) chosen = size;
  return layout_of(chosen);
}

}  // namespace coshard::zero::detail
