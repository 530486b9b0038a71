// The shard surface: initial values (the optimizer placement's masters follow them), checkpoint
// visits of every unit's block with its optimizer state (wherever the placement keeps it),
// consolidated export and load by name, and the full copies of stages 1-2 gathered after the
// blocks change.
#include <algorithm>

#include "coshard/modules/lora.hpp"
#include "engine/state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

async::Task<Result<void>> Engine::State::full_copies_from_shards() {
  const ResidenceWiring wiring = residence_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
  co_return co_await residence->follow_shards(wiring);
}

ShardLayout Engine::shard_layout() const noexcept {
  const State& s = *s_;
  return {s.o.dtype != DataType::f32 || s.offloaded(), static_cast<int>(s.optimizer->state_tensors())};
}

async::Task<Result<void>> Engine::visit_shards(ShardVisitor use, bool written) {
  State& s = *s_;
  COSHARD_CO_TRY(s.outside_loop("visit_shards"));
  COSHARD_CO_TRY(co_await s.host.compute_after(s.ctx->stream()));
  {
    const OptimizerWiring wiring = s.optimizer_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
    COSHARD_CO_TRY(co_await s.optimizer_placement->visit(wiring, use, written));
  }
  if (!written) co_return Result<void>{};
  co_return co_await s.full_copies_from_shards();
}

async::Task<Result<std::vector<GatheredParameter>>> Engine::gather_parameters() {
  State& s = *s_;
  COSHARD_CO_TRY(s.outside_loop("gather_parameters"));
  std::function<bool(const Parameter&)> every = [](const Parameter&) { return true; };  // (named: GCC 12)
  co_return co_await s.gather_values(std::move(every));
}

async::Task<Result<std::vector<GatheredParameter>>> Engine::State::gather_values(std::function<bool(const Parameter&)> wanted) {
  State& s = *this;
  Context& ctx = *s.ctx;
  auto& compute = ctx.stream();
  auto& cs = s.comm->stream();
  std::vector<GatheredParameter> out;
  COSHARD_CO_TRY(order(compute, cs));
  for (auto& up : s.units) {
    FetchUnit& u = *up;
    if (std::none_of(u.params.begin(), u.params.end(), [&](const auto& p) { return wanted(*p.parameter); })) continue;
    Tensor whole = u.full;
    if (!s.residence->holds_whole()) {
      // One unit at a time: a consolidated export must not need the whole model on one rank's device.
      COSHARD_CO_TRY_ASSIGN(whole, ctx.empty(Shape{u.info.padded}, s.o.dtype));
      const ShardWiring wiring = s.shard_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
      COSHARD_CO_TRY(co_await s.shard_placement->make_ready(wiring, u));
      auto done = s.gathers->gather_unit(u, whole, GatherScheduler::Exactness::exact);
      if (!done) co_return fail(std::move(done).error().with_context("gathering unit " + u.info.name + " for export"));
      COSHARD_CO_TRY(compute.wait(*done));
    }
    COSHARD_CO_TRY_ASSIGN(auto bytes, co_await ctx.read_bytes(whole));
    for (const auto& p : u.params) {
      if (!wanted(*p.parameter)) continue;
      const auto begin = static_cast<std::size_t>(p.offset) * s.element_size;
      const auto n = static_cast<std::size_t>(p.parameter->numel()) * s.element_size;
      out.push_back({s.names.at(p.parameter), p.parameter->shape(),
                     std::vector<std::byte>(bytes.begin() + static_cast<std::ptrdiff_t>(begin),
                                            bytes.begin() + static_cast<std::ptrdiff_t>(begin + n))});
    }
  }
  co_return out;
}

std::unordered_set<const Parameter*> Engine::State::adapter_parameters() const {
  std::unordered_set<const Parameter*> out;
  model->for_each_module([&out](const std::string&, Module& m) {
    if (dynamic_cast<const LoraAdapter*>(&m) == nullptr) return;
    for (const auto& q : m.parameters()) out.insert(q.get());
  });
  return out;
}

Result<void> Engine::State::check_values(const std::vector<GatheredParameter>& values) const {
  std::unordered_map<std::string_view, const Parameter*> parameter_named;
  for (const auto& [param, name] : names) parameter_named.emplace(name, param);
  std::unordered_map<std::string_view, const GatheredParameter*> by_name;
  for (const auto& v : values) {
    if (!by_name.emplace(v.name, &v).second)
      return fail(ErrorCode::invalid_argument, "load_parameters: '", v.name, "' given twice");
    const auto it = parameter_named.find(v.name);
    if (it == parameter_named.end())
      return fail(ErrorCode::invalid_argument, "load_parameters: '", v.name, "' is not a parameter of the model");
    if (!(it->second->shape() == v.shape) || v.bytes.size() != static_cast<std::size_t>(v.shape.numel()) * element_size)
      return fail(ErrorCode::invalid_argument, "load_parameters: '", v.name, "' has shape ", v.shape.to_string(),
                  " and ", v.bytes.size(), " bytes; the model expects ", it->second->shape().to_string(), " in ",
                  collectives::to_string(o.dtype));
  }
  for (const auto& [param, name] : names)
    if (!by_name.contains(name))
      return fail(ErrorCode::invalid_argument, "load_parameters: no value for parameter '", name, "'");
  return {};
}

namespace {

// A unit's values are made in host memory, which may run out: an error naming the unit, never an
// exception through the swapper's pass (its writes in flight would outlive their buffers).
template <class Make>
ShardPlacement::BlockSource without_throwing(Make make) {
  return [make = std::move(make)](const FetchUnit& u) -> Result<std::vector<std::byte>> {
    try {
      return make(u);
    } catch (const std::bad_alloc&) {
      try {
        return fail(ErrorCode::out_of_memory, "out of host memory for the values of unit ", u.info.name, " (",
                    u.info.padded, " elements)");
      } catch (const std::bad_alloc&) {
        return fail(Error(ErrorCode::out_of_memory, "out of memory"));  // (a short text needs no allocation)
      }
    }
  };
}

}  // namespace

async::Task<Result<void>> Engine::load_parameters(const std::vector<GatheredParameter>& values) {
  State& s = *s_;
  COSHARD_CO_TRY(s.outside_loop("load_parameters"));
  COSHARD_CO_TRY(s.check_values(values));
  std::unordered_map<std::string_view, const GatheredParameter*> by_name;
  for (const auto& v : values) by_name.emplace(v.name, &v);
  // Everything checked: now each rank writes its block of every unit.
  COSHARD_CO_TRY(co_await s.host.compute_after(s.ctx->stream()));
  COSHARD_CO_TRY(s.shard_placement->write_all(s.shard_wiring(), without_throwing([&s, &by_name](const FetchUnit& u) -> Result<std::vector<std::byte>> {
    // This rank's block only: each parameter's part inside it (the padding stays zero).
    const auto es = static_cast<std::int64_t>(s.element_size);
    const std::int64_t first = u.block_offset, last = first + u.info.shard;
    std::vector<std::byte> block(static_cast<std::size_t>(u.info.shard * es), std::byte{0});
    for (const auto& p : u.params) {
      const std::int64_t lo = std::max(p.offset, first), hi = std::min(p.offset + p.parameter->numel(), last);
      if (lo >= hi) continue;
      const auto& v = *by_name.at(s.names.at(p.parameter));
      std::copy(v.bytes.begin() + (lo - p.offset) * es, v.bytes.begin() + (hi - p.offset) * es,
                block.begin() + (lo - first) * es);
    }
    return block;
  })));
  const OptimizerWiring wiring = s.optimizer_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
  auto masters = co_await s.optimizer_placement->masters_from_shards(wiring);
  s.shard_values = nullptr;  // (it may refer to this frame's values)
  COSHARD_CO_TRY(masters);
  s.has_values = true;
  co_return co_await s.full_copies_from_shards();
}

async::Task<Result<void>> Engine::initialize(std::uint64_t seed) {
  State& s = *s_;
  COSHARD_CO_TRY(s.outside_loop("initialize"));
  COSHARD_CO_TRY(co_await s.host.compute_after(s.ctx->stream()));
  // The whole unit where every rank holds it; else only this rank's block, through the shard
  // placement (on NVMe: made unit by unit as the swap files are written).
  const bool whole = s.residence->holds_whole();
  auto block_of = without_throwing([&s, seed, whole](const FetchUnit& u) -> Result<std::vector<std::byte>> {
    std::vector<double> values(static_cast<std::size_t>(u.info.padded), 0.0);
    for (const auto& p : u.params) {
      auto part = std::span<double>(values).subspan(static_cast<std::size_t>(p.offset),
                                                   static_cast<std::size_t>(p.parameter->numel()));
      initial_values(*p.parameter, s.names.at(p.parameter), seed, part);
    }
    const auto first = whole ? 0 : static_cast<std::size_t>(u.block_offset);
    const auto count = static_cast<std::size_t>(whole ? u.info.padded : u.info.shard);
    return encode_values(std::span<const double>(values).subspan(first, count), s.o.dtype);
  });
  if (whole) {
    for (auto& u : s.units) {
      COSHARD_CO_TRY_ASSIGN(const auto bytes, block_of(*u));
      COSHARD_CO_TRY(s.ctx->copy_from_host(u->full, bytes));
    }
  } else {
    COSHARD_CO_TRY(s.shard_placement->write_all(s.shard_wiring(), block_of));
  }
  // The optimizer's fp32 masters (bf16/f16, or offloaded) follow the new parameters.
  const OptimizerWiring wiring = s.optimizer_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
  auto masters = co_await s.optimizer_placement->masters_from_shards(wiring);
  s.shard_values = nullptr;  // (it may refer to this frame's values)
  COSHARD_CO_TRY(masters);
  s.has_values = true;
  co_return Result<void>{};
}

}  // namespace coshard::zero
