#include "rank_agreement.hpp"

#include <cstdio>
#include <span>

#include "coshard/async/json_limits.hpp"
#include "coshard/trainer/settings.hpp"

namespace coshard::trainer::detail {

namespace {

// Round-trips a float (9 significant digits) and reads as the user wrote it.
std::string text_of(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.9g", v);
  return buf;
}

std::uint64_t fnv1a(std::string_view text) {
  std::uint64_t h = 1469598103934665603ull;
  for (const char ch : text) {
    h ^= static_cast<unsigned char>(ch);
    h *= 1099511628211ull;
  }
  return h;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> agreement_fields(const TrainerConfig& c, modules::Module& model) {
  std::vector<std::pair<std::string, std::string>> f;
  // The parameters: names, shapes, trainable, and the group each falls in (the first match).
  std::vector<modules::ParameterGroup> groups;
  if (c.no_decay_for_vectors) groups.push_back(modules::ParameterGroup::no_decay_for_vectors());
  groups.insert(groups.end(), c.parameter_groups.begin(), c.parameter_groups.end());
  std::string params;
  std::size_t count = 0;
  model.for_each_parameter([&](const std::string& name, modules::Parameter& p) {
    ++count;
    // (an expert another expert-parallel rank holds under another name: its place, not its name)
    params += (p.expert_parallel() > 1 ? "expert/" + std::to_string(p.expert_parallel()) : name) + " " +
              p.shape().to_string() + (p.trainable() ? "" : " frozen");
    for (std::size_t g = 0; g < groups.size(); ++g)
      if (groups[g].matches && groups[g].matches(name, p)) {
        params += " group " + std::to_string(g);
        break;
      }
    params += ";";
  });
  f.emplace_back("the model's parameters (names and shapes)", std::to_string(count) + " parameters, " + params);
  // Every setting of the table but the ones a rank may hold its own of (settings.hpp), by name.
  for (const auto& s : settings())
    if (!s.per_rank) f.emplace_back(std::string(s.name), s.value(c));
  f.emplace_back("reduce_dtype", std::string(collectives::to_string(c.reduce_dtype)));
  f.emplace_back("max_live_follows_model", c.max_live_follows_model ? "yes" : "no");
  f.emplace_back("offload_optimizer", std::string(to_string(c.offload_optimizer.device)));
  f.emplace_back("offload_params", std::string(to_string(c.offload_params.device)));
  std::string group_settings;
  for (const auto& g : groups)
    group_settings += g.name + " " + (g.weight_decay ? text_of(*g.weight_decay) : "-") + " " + text_of(g.lr_scale) +
                      " " + (g.beta1 ? text_of(*g.beta1) : "-") + " " + (g.beta2 ? text_of(*g.beta2) : "-") + " " +
                      (g.eps ? text_of(*g.eps) : "-") + ";";
  f.emplace_back("parameter groups", group_settings);
  std::string frozen;
  for (const auto& pattern : c.freeze) frozen += pattern + ";";
  f.emplace_back("freeze", frozen);
  std::string lora = std::to_string(c.lora_rank) + " " + text_of(c.lora_alpha) + " " + text_of(c.lora_dropout);
  for (const auto& target : c.lora_targets) lora += " " + target;
  f.emplace_back("LoRA", lora);
  for (const auto& [key, value] : c.run_identity) f.emplace_back("the run's " + key, value);
  for (const auto& [key, value] : c.ranks_agree_on) f.emplace_back(key, value);
  return f;
}

async::Task<Result<void>> check_ranks_agree(modules::Context& ctx, collectives::Communicator& comm,
                                            const std::vector<std::pair<std::string, std::string>>& fields) {
  const int world = comm.size(), rank = comm.rank();
  if (world == 1) co_return Result<void>{};
  // Each field's hash as two i32 (the all-gather only copies), then the count of fields.
  const std::size_t n = fields.size();
  std::vector<std::int32_t> mine(2 * n + 1);
  for (std::size_t i = 0; i < n; ++i) {
    const std::uint64_t h = fnv1a(fields[i].first + '\0' + fields[i].second);
    mine[2 * i] = static_cast<std::int32_t>(h & 0xffffffffu);
    mine[2 * i + 1] = static_cast<std::int32_t>(h >> 32);
  }
  mine[2 * n] = static_cast<std::int32_t>(n);
  const std::size_t count = mine.size();
  COSHARD_CO_TRY_ASSIGN(auto send, ctx.upload(std::as_bytes(std::span<const std::int32_t>(mine)),
                                              modules::Shape{static_cast<std::int64_t>(count)}, modules::DataType::i32));
  COSHARD_CO_TRY_ASSIGN(auto recv, ctx.empty(modules::Shape{static_cast<std::int64_t>(count) * world}, modules::DataType::i32));
  COSHARD_CO_TRY_ASSIGN(auto uploaded, ctx.stream().record());
  COSHARD_CO_TRY(comm.stream().wait(uploaded));
  COSHARD_CO_TRY_ASSIGN(auto gathered, comm.all_gather(send.data(), recv.data(), count, modules::DataType::i32));
  COSHARD_CO_TRY(ctx.stream().wait(gathered));
  COSHARD_CO_TRY_ASSIGN(const auto all, co_await ctx.read(recv));
  auto at = [&](int q, std::size_t i) { return all.at(static_cast<std::size_t>(q) * count + i); };
  std::string differences;
  for (std::size_t i = 0; i < n; ++i) {
    std::string ranks;
    for (int q = 1; q < world; ++q)
      if (at(q, 2 * i) != at(0, 2 * i) || at(q, 2 * i + 1) != at(0, 2 * i + 1) || at(q, 2 * n) != at(0, 2 * n))
        ranks += (ranks.empty() ? "" : ", ") + std::to_string(q);
    if (ranks.empty()) continue;
    if (!differences.empty()) differences += "; ";
    differences += fields[i].first + " (rank" + (ranks.find(',') == std::string::npos ? " " : "s ") + ranks +
                   " unlike rank 0; here " + async::bounded_echo(fields[i].second) + ")";
  }
  // Every rank has its verdict before any returns: a rank that fails aborts its communicator, and
  // a peer still waiting for the gathered fingerprints would then report the abort instead of the
  // differences (seen under mpirun). Past the barrier the verdict stands whatever it returns.
  // (no co_await inside a conditional expression: GCC 12 destroyed its temporaries twice, a
  // double free seen under load)
  auto met = comm.barrier();
  Result<void> passed{};
  if (met) {
    passed = co_await *met;
  } else {
    passed = fail(std::move(met).error());
  }
  if (differences.empty()) co_return passed;
  co_return fail(ErrorCode::invalid_argument, "the ranks of this run do not agree (rank ", rank, " of ", world, "): ",
                 differences, "; every rank must run with the same model and settings");
}

}  // namespace coshard::trainer::detail
