#include "tensor_parts.hpp"

#include <charconv>
#include <cstring>
#include <set>

#include "coshard/modules/module.hpp"

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

fs::path tensor_checkpoint_dir(const fs::path& dir, const EngineOptions& o) {
  const int size = tensor_size(o);
  if (size <= 1) return dir;
  return dir / ("tensor-" + std::to_string(o.tensor_parallel->rank()) + "-of-" + std::to_string(size));
}

Result<void> check_tensor_checkpoint(const fs::path& dir, int tensor) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return {};  // (the load names a missing folder itself)
  std::set<int> sizes;  // N of each tensor-<t>-of-<N> folder there
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    const auto of = name.find("-of-");
    if (name.rfind("tensor-", 0) != 0 || of == std::string::npos) continue;
    int n = 0;
    const char* end = name.data() + name.size();
    if (const auto [at, error] = std::from_chars(name.data() + of + 4, end, n); error == std::errc{} && at == end)
      sizes.insert(n);
  }
  const bool plain = fs::exists(dir / "latest", ec) || fs::exists(dir / "manifest.json", ec);
  if (!plain && sizes.empty()) return {};  // (nothing saved here: the load says so)
  if (tensor > 1 ? sizes.contains(tensor) : plain) return {};
  const std::string saved = !sizes.empty() ? "tensor parallelism " + std::to_string(*sizes.rbegin()) +
                                                 " (its folders tensor-*-of-" + std::to_string(*sizes.rbegin()) + ")"
                                           : std::string("no tensor parallelism (tensor size 1)");
  return fail(ErrorCode::invalid_argument, "checkpoint ", dir.string(), " was saved with ", saved, ", and this run has ",
              tensor > 1 ? "tensor parallelism " + std::to_string(tensor) : std::string("none (tensor size 1)"),
              ": a checkpoint loads at another data size, not yet at another tensor size (resume with the tensor size it "
              "was saved at; to go on from its weights alone, without the optimizer's state, export them whole at that "
              "size and start the new run from the file with --init)");
}

}  // namespace coshard::zero::detail
