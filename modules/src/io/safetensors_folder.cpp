#include "coshard/modules/safetensors_folder.hpp"

#include <cstdio>
#include <memory>
#include <set>

#include <nlohmann/json.hpp>

#include "coshard/async/json_limits.hpp"
#include "coshard/async/files.hpp"

namespace coshard::modules {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

std::string shard_name(std::size_t i, std::size_t n) {
  char name[64];
  std::snprintf(name, sizeof name, "model-%05zu-of-%05zu.safetensors", i + 1, n);
  return name;
}

// "model.safetensors", "model-00002-of-00007.safetensors": the weight files an export writes.
bool is_weight_file_name(const std::string& name) {
  if (name == kSafetensorsSingleName || name == kSafetensorsIndexName) return true;
  unsigned a = 0, b = 0;
  char tail[32] = {};
  return name.size() == std::string_view("model-00001-of-00001.safetensors").size() &&
         std::sscanf(name.c_str(), "model-%5u-of-%5u.%31s", &a, &b, tail) == 3 && std::string_view(tail) == "safetensors";
}

// What a folder's index says, checked: each weight file and the tensors it maps to that file
// (one model.safetensors and no names when there is no index). Reads no shard.
struct FolderLayout {
  fs::path index;                                       // empty: no index
  std::map<std::string, std::set<std::string>> files;  // file name -> the tensor names mapped to it
};

Result<FolderLayout> read_layout(const fs::path& folder) {
  std::error_code ec;
  if (!fs::is_directory(folder, ec)) return fail(ErrorCode::invalid_argument, folder.string(), ": not a folder");
  FolderLayout layout;
  const fs::path path = folder / kSafetensorsIndexName;
  // transformers reads model.safetensors when the folder has one, its index otherwise: the same
  // weights here.
  if (!fs::exists(path, ec) || fs::exists(folder / kSafetensorsSingleName, ec)) {
    if (!fs::exists(folder / kSafetensorsSingleName, ec))
      return fail(ErrorCode::invalid_argument, folder.string(), ": holds neither ", kSafetensorsSingleName, " nor ",
                  kSafetensorsIndexName);
    layout.files[std::string(kSafetensorsSingleName)];
    return layout;
  }
  layout.index = path;
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, std::size_t{256} << 20, "safetensors index"));
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  COSHARD_TRY(async::check_json_nesting(text, path.string()));
  const json doc = json::parse(text, nullptr, false);
  if (doc.is_discarded() || !doc.is_object())
    return fail(ErrorCode::invalid_argument, path.string(), ": not a JSON object");
  if (!doc.contains("weight_map") || !doc["weight_map"].is_object() || doc["weight_map"].empty())
    return fail(ErrorCode::invalid_argument, path.string(), ": expected a non-empty \"weight_map\" object of tensor name -> file");
  for (const auto& [name, file] : doc["weight_map"].items()) {
    if (!file.is_string())
      return fail(ErrorCode::invalid_argument, path.string(), ": weight_map[\"", async::bounded_echo(name), "\"]=", async::bounded_echo(file.dump()), " (expected a file name)");
    const fs::path f(file.get<std::string>());
    if (f.empty() || f.has_parent_path() || f.filename() != f || f == "." || f == "..")
      return fail(ErrorCode::invalid_argument, path.string(), ": weight_map[\"", async::bounded_echo(name), "\"]=\"", f.string(),
                  "\" (expected a file name in the index's own folder)");
    layout.files[f.string()].insert(name);
  }
  return layout;
}

}  // namespace

Result<std::vector<fs::path>> SafetensorsFolder::files_of(const fs::path& folder) {
  COSHARD_TRY_ASSIGN(const FolderLayout layout, read_layout(folder));
  std::vector<fs::path> out;
  for (const auto& [name, tensors] : layout.files) out.push_back(folder / name);
  return out;
}

Result<SafetensorsFolder> SafetensorsFolder::load(const fs::path& folder) {
  COSHARD_TRY_ASSIGN(const FolderLayout layout, read_layout(folder));
  SafetensorsFolder out;
  for (const auto& [file_name, names] : layout.files) {
    const fs::path path = folder / file_name;
    auto file = SafetensorsFile::load(path);
    if (!file) {
      if (layout.index.empty()) return fail(std::move(file).error());
      return fail(std::move(file).error().with_context(layout.index.string() + " names " + file_name));
    }
    if (!layout.index.empty()) {  // the shard holds exactly what the index maps to it
      std::set<std::string> held;
      for (const auto& t : file->tensors()) {
        if (!names.count(t.name)) {
          bool elsewhere = false;
          for (const auto& [other, its] : layout.files) elsewhere = elsewhere || its.count(t.name) > 0;
          return fail(ErrorCode::invalid_argument, path.string(), " holds tensor ", t.name, ", which ",
                      layout.index.string(), " maps ", elsewhere ? "to another file" : "nowhere");
        }
        held.insert(t.name);
      }
      for (const auto& name : names)
        if (!held.count(name))
          return fail(ErrorCode::invalid_argument, layout.index.string(), " maps tensor ", name, " to ", file_name,
                      ", which does not hold it");
    }
    out.files_.push_back(std::make_unique<SafetensorsFile>(std::move(*file)));
    out.paths_.push_back(path);
  }
  for (const auto& f : out.files_)
    for (const auto& t : f->tensors()) out.entries_.push_back({f.get(), &t});
  return out;
}

Result<std::vector<fs::path>> save_safetensors_folder(const fs::path& folder, std::span<const SafeTensorView> tensors,
                                                      const SafetensorsFolderOptions& options) {
  if (tensors.empty()) return fail(ErrorCode::invalid_argument, "save_safetensors_folder ", folder.string(), ": no tensors");
  if (options.max_shard_bytes == 0)
    return fail(ErrorCode::invalid_argument, "save_safetensors_folder: max_shard_bytes=0 (expected > 0)");
  // Shards: tensors in order, a new shard when the next would go past the limit.
  std::vector<std::vector<SafeTensorView>> shards(1);
  std::size_t shard_bytes = 0, total = 0;
  for (const auto& t : tensors) {
    const std::size_t bytes = t.data.size();
    if (!shards.back().empty() && shard_bytes + bytes > options.max_shard_bytes) {
      shards.emplace_back();
      shard_bytes = 0;
    }
    shards.back().push_back(t);
    shard_bytes += bytes;
    total += bytes;
  }
  std::vector<fs::path> written;
  if (shards.size() == 1) {
    const fs::path path = folder / kSafetensorsSingleName;
    COSHARD_TRY(save_safetensors(path, shards[0], options.metadata));
    written.push_back(path);
  } else {
    json index;
    index["metadata"]["total_size"] = total;
    index["weight_map"] = json::object();
    for (std::size_t i = 0; i < shards.size(); ++i) {
      const std::string name = shard_name(i, shards.size());
      COSHARD_TRY(save_safetensors(folder / name, shards[i], options.metadata));
      for (const auto& t : shards[i]) index["weight_map"][t.name] = name;
      written.push_back(folder / name);
    }
    const fs::path path = folder / kSafetensorsIndexName;
    COSHARD_TRY(async::write_file_atomic(path, index.dump(2) + "\n"));
    written.push_back(path);
  }
  // Weight files of an earlier export that this one does not include.
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(folder, ec)) {
    const std::string name = entry.path().filename().string();
    if (!is_weight_file_name(name)) continue;
    bool ours = false;
    for (const auto& w : written) ours = ours || w.filename() == entry.path().filename();
    if (!ours && !fs::remove(entry.path(), ec))
      return fail(ErrorCode::io, "save_safetensors_folder: removing the earlier ", entry.path().string(), ": ",
                  ec ? ec.message() : "not removed");
  }
  return written;
}

}  // namespace coshard::modules
