// A model's weights as Hugging Face keeps them in a folder: one `model.safetensors`, or shards
// `model-00001-of-00003.safetensors`, ... with `model.safetensors.index.json` mapping each tensor
// name to its file ({"metadata": {"total_size": bytes}, "weight_map": {name: file}}).
//
// Reading checks the index against the shards: every file it names exists and holds exactly the
// tensors mapped to it (no tensor missing, none extra, none in two files), and no file name leaves
// the folder. Writing puts tensors in order into shards of at most `max_shard_bytes` (a tensor
// larger than that gets a shard of its own), each file atomically, the index last; then it removes
// weight files of an earlier export that the new set does not include, so a loader never mixes
// the two.
#pragma once

#include <cstddef>
#include <filesystem>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coshard/modules/safetensors.hpp"

namespace coshard::modules {

inline constexpr std::string_view kSafetensorsIndexName = "model.safetensors.index.json";
inline constexpr std::string_view kSafetensorsSingleName = "model.safetensors";

class SafetensorsFolder {
 public:
  // The folder's weights: model.safetensors when there is one (as transformers reads a folder),
  // else the index and its shards.
  static Result<SafetensorsFolder> load(const std::filesystem::path& folder);
  // The weight files `load` would read (the shards the index names, or model.safetensors), the
  // index checked, without reading any of them.
  static Result<std::vector<std::filesystem::path>> files_of(const std::filesystem::path& folder);

  struct Entry {
    const SafetensorsFile* file;
    const SafeTensorInfo* info;
  };
  // Every tensor, in the order of the files and within each file.
  const std::vector<Entry>& tensors() const noexcept { return entries_; }
  std::span<const std::byte> data(const Entry& e) const noexcept { return e.file->data(*e.info); }
  const std::vector<std::filesystem::path>& files() const noexcept { return paths_; }

 private:
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::vector<std::filesystem::path> paths_;
  std::vector<Entry> entries_;
};

struct SafetensorsFolderOptions {
  std::size_t max_shard_bytes = std::size_t{5} << 30;  // transformers' default max_shard_size ("5GB")
  std::map<std::string, std::string> metadata = {{"format", "pt"}};
};

// Writes `tensors` into `folder` (which must exist): model.safetensors when they fit in one
// shard, else shards and the index. Returns the files written, the index last.
Result<std::vector<std::filesystem::path>> save_safetensors_folder(const std::filesystem::path& folder,
                                                                   std::span<const SafeTensorView> tensors,
                                                                   const SafetensorsFolderOptions& options = {});

}  // namespace coshard::modules
