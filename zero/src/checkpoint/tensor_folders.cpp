// Tensor ranks' checkpoint folders (tensor_folders.hpp).
#include "checkpoint/tensor_folders.hpp"

#include <map>

#include "checkpoint/files.hpp"
#include "coshard/zero/checkpoint.hpp"
#include "tensor_parts.hpp"

namespace coshard::zero::detail {

namespace fs = std::filesystem;

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
