// Expert parallelism's whole model (expert_parts.hpp).
#include "expert_parts.hpp"

#include <cstring>
#include <unordered_map>

#include "coshard/modules/moe.hpp"

namespace coshard::zero::detail {

std::unordered_set<std::string> experts_elsewhere(modules::Module& model) {
  std::unordered_set<std::string> out;
  for (const auto& e : modules::expert_places(model))
    for (const auto& name : e.names_by_rank)
      if (name != e.name) out.insert(name);
  return out;
}

async::Task<Result<std::vector<std::vector<std::int64_t>>>> from_every_expert_rank(RankExchange& world, int rank,
                                                                                   int expert_ranks,
                                                                                   std::vector<std::int64_t> mine) {
  const std::size_t per_rank = mine.size();
  COSHARD_CO_TRY_ASSIGN(const auto all, co_await world.all_ranks(std::move(mine)));
  const int run = world.size() / expert_ranks;
  std::vector<std::vector<std::int64_t>> out(static_cast<std::size_t>(expert_ranks));
  for (int q = 0; q < expert_ranks; ++q) {
    if (q == rank / run) continue;
    const auto first = all.begin() + static_cast<std::ptrdiff_t>(static_cast<std::size_t>(q * run) * per_rank);
    out[static_cast<std::size_t>(q)].assign(first, first + static_cast<std::ptrdiff_t>(per_rank));
  }
  co_return out;
}

async::Task<Result<std::vector<GatheredParameter>>> with_every_expert(RankExchange& world, int rank, modules::Module& model,
                                                                      std::vector<GatheredParameter> mine) {
  const auto experts = modules::expert_places(model);
  if (experts.empty()) co_return mine;
  std::unordered_map<std::string_view, const GatheredParameter*> by_name;
  for (const auto& p : mine) by_name.emplace(p.name, &p);
  // This rank's experts' bytes, one after another (the same sizes on every rank: the experts of a
  // layer share their structure), as the exchange's int64 words.
  std::vector<std::pair<Shape, std::size_t>> own;  // (copied: `mine` grows below)
  std::vector<std::byte> bytes;
  for (const auto& e : experts) {
    const auto it = by_name.find(e.name);
    if (it == by_name.end()) co_return fail(ErrorCode::internal, "export: expert parameter ", e.name, " was not gathered");
    own.emplace_back(it->second->shape, it->second->bytes.size());
    bytes.insert(bytes.end(), it->second->bytes.begin(), it->second->bytes.end());
  }
  std::vector<std::int64_t> words((bytes.size() + 7) / 8, 0);
  if (!bytes.empty()) std::memcpy(words.data(), bytes.data(), bytes.size());
  const int groups = static_cast<int>(experts.front().names_by_rank.size());
  COSHARD_CO_TRY_ASSIGN(const auto theirs, co_await from_every_expert_rank(world, rank, groups, std::move(words)));
  for (int q = 0; q < groups; ++q) {
    if (q == rank / (world.size() / groups)) continue;  // (this rank's own)
    const auto* from = reinterpret_cast<const std::byte*>(theirs[static_cast<std::size_t>(q)].data());
    std::size_t at = 0;
    for (std::size_t i = 0; i < experts.size(); ++i) {
      const auto& [shape, n] = own[i];
      mine.push_back({experts[i].names_by_rank[static_cast<std::size_t>(q)], shape,
                      std::vector<std::byte>(from + at, from + at + n)});
      at += n;
    }
  }
  co_return mine;
}

}  // namespace coshard::zero::detail
