// Building an engine: options checked, fetch units planned and sharded, the memory estimate
// checked, the optimizer offload's stream, pinned pool and swap files made, each unit's storage
// (shard, full copy, gradients) placed, and the engine installed as the context's hooks.
#include <unordered_set>
#include <limits>
#include <mutex>
#include <new>

#include "coshard/modules/cpu_blas_kernels.hpp"
#include "coshard/modules/cpu_half_products.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "engine/state.hpp"
#include "plan/fetch_units.hpp"
#include "coshard/modules/moe.hpp"
#include "plan/quantized_gathers.hpp"
#include "plan/secondary_partition.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

Engine::Engine(std::unique_ptr<State> state) : s_(std::move(state)) {}

Engine::~Engine() {
  if (!s_) return;
  if (s_->host.stream) {
    // Teardown: the host stream goes quiet, then the optimizer lets go of the groups made on the
    // engine's host context (their memory belongs to it) before that context goes.
    (void)s_->host.stream->synchronize();
    s_->optimizer->drop_groups_from(s_->first_group);
  }
  if (s_->ctx->hooks() == this) s_->ctx->set_hooks(nullptr);
  for (auto& u : s_->units) {
    if (u->gather != Gather::released) {
      // The block goes back behind the gather and the compute stream's point (reset records
      // it); the budget goes with the engine.
      u->gathered_block.reset();
      if (u->permit) u->permit->forget();
    }
    if (auto ev = s_->comm->stream().record()) {
      // (a destructor: without memory to keep the event, as under an address-space limit, the
      // host waits for it here, counted, instead of std::terminate; the blocks' reuse is ordered)
      try {
        u->shard_block.record_use(*ev);
        u->full_block.record_use(*ev);
        u->grad_shard_block.record_use(*ev);
        u->grad_full_block.record_use(*ev);
      } catch (const std::bad_alloc&) {
        (void)ev->synchronize();
      }
    }
    for (auto& p : u->params) p.parameter->unbind();
    u->read_slot.forget();  // nvme parameters: the read slots go with the engine too
  }
}

const EngineOptions& Engine::options() const noexcept { return s_->o; }

int Engine::rank() const noexcept { return s_->rank; }

int Engine::world_size() const noexcept { return s_->world; }

std::vector<FetchUnitInfo> Engine::units() const {
  std::vector<FetchUnitInfo> out;
  for (const auto& u : s_->units) out.push_back(u->info);
  return out;
}

Result<void> check_offload_placement(const EngineOptions& o) {
  if (o.zero_stage == 0 && o.offload_optimizer != OffloadTarget::none)  // (a configuration layer's check too)
    return fail(ErrorCode::invalid_argument, "offload_optimizer=", to_string(o.offload_optimizer),
                " with zero_stage=0: offload moves the optimizer's shards, and stage 0 has none (expected zero_stage 1, 2 "
                "or 3, as in DeepSpeed)");
  if (o.offload_params == OffloadTarget::none) return {};
  const auto where = to_string(o.offload_params);
  if (o.zero_stage != 3)
    return fail(ErrorCode::invalid_argument, "offload_params=", where, " with zero_stage=", o.zero_stage,
                ": parameters are sharded, and so offloaded, at stage 3 only");
  if (o.offload_optimizer == OffloadTarget::none)
    return fail(ErrorCode::invalid_argument, "offload_params=", where,
                " with offload_optimizer=none: the optimizer steps the shards where they live (offload it too)");
  if (o.offload_params == OffloadTarget::nvme && o.offload_optimizer != OffloadTarget::nvme)
    return fail(ErrorCode::invalid_argument, "offload_params=nvme with offload_optimizer=", to_string(o.offload_optimizer),
                ": the shards on NVMe are the masters in the optimizer's swap files (expected offload_optimizer=nvme; "
                "with cpu, the masters hold the parameters in host memory already: use offload_params=cpu)");
  if (o.offload_params.buffer_count < 1)
    return fail(ErrorCode::invalid_argument, "offload_params.buffer_count=", o.offload_params.buffer_count, ": expected >= 1");
  if (o.offload_params == OffloadTarget::nvme && !o.offload_params.nvme_path.empty() &&
      o.offload_params.nvme_path != o.offload_optimizer.nvme_path)
    return fail(ErrorCode::invalid_argument, "offload_params.nvme_path=", o.offload_params.nvme_path.string(),
                ": the parameter shards live in the optimizer's swap files, in offload_optimizer.nvme_path=",
                o.offload_optimizer.nvme_path.string(), " (give the same folder, or none)");
  return {};
}

Result<void> check_swap_gradients(const EngineOptions& o) {
  if (!o.swap_gradients || o.offload_optimizer == OffloadTarget::nvme) return {};
  return fail(ErrorCode::invalid_argument, "swap_gradients with offload_optimizer=", to_string(o.offload_optimizer),
              ": the gradients are swapped into the optimizer's swap files (expected offload_optimizer=nvme)");
}

Result<void> check_step_in_backward(const EngineOptions& o, const StepControlOptions& control) {
  if (!o.step_in_backward) return {};
  if (o.offload_optimizer == OffloadTarget::none)
    return fail(ErrorCode::invalid_argument, "step_in_backward with offload_optimizer=", to_string(o.offload_optimizer),
                ": steps the shards on the CPU as their gradients come (expected offload_optimizer=cpu or nvme)");
  if (o.zero_stage < 2)
    return fail(ErrorCode::invalid_argument, "step_in_backward with zero_stage=", o.zero_stage,
                ": the gradients are reduced after backward there (expected zero_stage 2 or 3)");
  if (control.max_grad_norm != 0.0f)
    return fail(ErrorCode::invalid_argument, "step_in_backward with max_grad_norm=", control.max_grad_norm,
                ": clipping needs the global norm, known only after backward (expected 0: no clipping)");
  if (control.loss_scaling != LossScaling::none)
    return fail(ErrorCode::invalid_argument, "step_in_backward with loss scaling: an overflow must be able to ",
                "skip the whole step (expected none)");
  return {};
}

std::string_view to_string(OffloadTarget t) noexcept {
  switch (t) {
    case OffloadTarget::none: return "none";
    case OffloadTarget::cpu: return "cpu";
    case OffloadTarget::nvme: return "nvme";
  }
  return "?";
}

namespace {

// A model split for tensor parallelism trains right only with its tensor group: each tensor rank
// would clip with its own norm and its replicated weights drift apart (8e-4 in a report), and a
// checkpoint of it publishes half a model. So a split parameter needs EngineOptions::tensor_parallel
// (Engine::create over a Mesh sets it) of as many ranks as it has parts.
Result<void> check_tensor_parts(Module& model, const EngineOptions& o) {
  Result<void> out{};
  model.for_each_parameter([&](const std::string& name, Parameter& p) {
    if (!out || !p.split() || p.split()->parts <= 1) return;
    const auto& split = *p.split();
    if (!o.tensor_parallel)
      out = fail(ErrorCode::invalid_argument, "Engine: parameter ", name, " is part ", split.index, " of ", split.parts,
                 " of a tensor-parallel split, and the engine has no tensor group (create it over the collectives::Mesh the "
                 "model was split over, or set EngineOptions::tensor_parallel to that mesh's tensor())");
    else if (o.tensor_parallel->size() != split.parts)
      out = fail(ErrorCode::invalid_argument, "Engine: parameter ", name, " is split in ", split.parts,
                 " parts, and the engine's tensor group has ", o.tensor_parallel->size(), " ranks");
  });
  return out;
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::create(Context& ctx, const collectives::Mesh& mesh, Module& model,
                                               Optimizer& optimizer, EngineOptions o) {
  if (o.shard_group_size != 0 && o.shard_group_size != mesh.shape().shard)
    return fail(ErrorCode::invalid_argument, "shard_group_size=", o.shard_group_size, " with a mesh of ", mesh.describe(),
                ": the mesh says how data ranks shard (leave it 0, or give the mesh's ", mesh.shape().shard, ")");
  if (o.tensor_parallel && o.tensor_parallel != &mesh.tensor())
    return fail(ErrorCode::invalid_argument, "EngineOptions::tensor_parallel is another communicator than the mesh's "
                "tensor group (leave it null)");
  Result<void> experts_agree;
  model.for_each_parameter([&](const std::string& name, modules::Parameter& p) {
    if (experts_agree && p.expert_parallel() != 1 && p.expert_parallel() != mesh.expert_size())
      experts_agree = fail(ErrorCode::invalid_argument, "Engine: parameter ", name, " is an expert partitioned over ",
                           p.expert_parallel(), " ranks, but the mesh's expert groups (", mesh.describe(), ") have ",
                           mesh.expert_size(), " (build the model over mesh.expert())");
  });
  COSHARD_TRY(experts_agree);
  o.shard_group_size = mesh.shard_group_size();
  o.tensor_parallel = &mesh.tensor();
  return create(ctx, mesh.data(), model, optimizer, std::move(o));
}

void Engine::State::adopt_units(detail::FetchPlan plan) {
  names = std::move(plan.names);
  largest_unit_bytes = plan.largest_unit_bytes;
  for (auto& planned : plan.units) {
    auto u = std::make_unique<FetchUnit>();
    u->info = std::move(planned.info);
    u->gather_purpose = "the parameters of unit " + u->info.name;
    u->reduce_purpose = "the gradients of unit " + u->info.name;
    u->modules = std::move(planned.modules);
    for (const auto& p : planned.parameters) u->params.push_back({p.parameter, p.offset});
    // (a coalesced unit's modules hold consecutive runs of its parameters)
    for (std::size_t k = 0, i = 0; k < u->modules.size(); ++k)
      for (std::size_t n = u->modules[k]->parameters().size(); n > 0 && i < u->params.size(); --n) u->params[i++].module = k;
    u->index = units.size();
    for (const auto& p : u->params) planned_trainable.emplace_back(p.parameter, p.parameter->trainable());
    for (Module* m : u->modules) module_units.unit_of.emplace(m, u->index);
    if (u->coalesced()) {
      // Each module's elements, from its parameters' places (Param::module, above).
      u->module_runs.assign(u->modules.size(), FetchUnit::ModuleRun{std::numeric_limits<std::int64_t>::max(), 0});
      for (const auto& p : u->params) {
        auto& run = u->module_runs[p.module];
        run.begin = std::min(run.begin, p.offset);
        run.end = std::max(run.end, p.offset + p.parameter->numel());
      }
      for (std::size_t k = 0; k < u->modules.size(); ++k) module_units.position_in_unit.emplace(u->modules[k], k);
    }
    units.push_back(std::move(u));
  }
  mark_routed_units();
}

// Units made of mixture-of-experts layers' experts alone (FetchUnitInfo::routed): which of them
// run follows the routing, so they are never recorded in the trace nor gathered along it.
void Engine::State::mark_routed_units() {
  std::unordered_set<const Module*> experts;
  model->for_each_module([&](const std::string&, Module& m) {
    if (auto* moe = dynamic_cast<modules::SparseMoe*>(&m))
      for (std::int64_t e = 0; e < moe->options().experts; ++e)
        if (Module* expert = moe->expert(e))
          expert->for_each_module([&](const std::string&, Module& x) { experts.insert(&x); });
  });
  for (auto& u : units)
    u->info.routed = !u->modules.empty() && std::all_of(u->modules.begin(), u->modules.end(),
                                                   [&](const Module* m) { return experts.contains(m); });
}

Result<void> Engine::State::note_borrowed_units() {
  // Declared uses of other modules' parameters: the owner's unit, which must be the model's.
  Result<void> declared;
  model->for_each_module([&](const std::string& path, Module& m) {
    for (const Module* owner : m.borrowed()) {
      const auto it = module_units.unit_of.find(owner);
      if (it == module_units.unit_of.end()) {
        if (declared)
          declared = fail(ErrorCode::invalid_argument, "Engine: module ", path.empty() ? "(the model)" : path, " (",
                          m.type_name(), ") uses the parameters of a ", owner->type_name(),
                          " that is not part of the model");
        continue;
      }
      module_units.borrowed[&m].push_back(it->second);
    }
  });
  return declared;
}

Result<void> Engine::State::choose_strategies(std::span<const FetchUnitInfo> infos) {
  // With shard groups asked for: every rank planned the same units and groups, or none goes on
  // (a setup collective: a rank asking for none skips it, as it makes no groups); then the shard
  // groups' communicators, before anything is allocated.
  if (o.shard_group_size != 0 || o.shard_group_size_of) COSHARD_TRY(detail::check_ranks_agree(*comm, infos));
  COSHARD_TRY_ASSIGN(shard_groups,
                     detail::ShardGroups::create(*comm, infos, o.zero_stage != 0, o.secondary_partition_ranks));
  for (auto& u : units) {
    u->group = &shard_groups->of(u->info);
    if (detail::secondary_ranks_for(o, u->info) > 0) u->secondary = shard_groups->secondary();
  }
  optimizer_placement = make_optimizer_placement(o.offload_optimizer);  // chosen here once: the engine asks it
  switch (o.offload_params) {
    case OffloadTarget::none:
    case OffloadTarget::cpu: shard_placement = make_shards_in_memory(); break;
    case OffloadTarget::nvme: shard_placement = make_shards_on_nvme(); break;
  }
  reduction = make_gradient_reduction(o.zero_stage);
  residence = make_parameter_residence(o.zero_stage);
  for (auto& u : units)
    u->block_offset = residence->sharded() ? static_cast<std::int64_t>(u->group->rank) * u->info.shard : 0;
  if (!optimizer_placement || !shard_placement)
    return fail(ErrorCode::invalid_argument, "offload_optimizer=", static_cast<int>(o.offload_optimizer.device),
                ", offload_params=", static_cast<int>(o.offload_params.device), ": expected none, cpu or nvme for each");

  {
    State* engine = this;
    gathers = std::make_unique<GatherScheduler>(GatherScheduler::Wiring{
        io(), units, o, timeline, stats, *shard_placement,
        [engine] { return engine->shard_wiring(); }, largest_unit_bytes});
  }
  return {};
}

Result<void> Engine::State::give_units_storage() {
  norm_summed_over_ranks = residence->sharded() || std::any_of(units.begin(), units.end(), [](const auto& u) {
                             return u->info.expert_parallel > 1;
                           });
  // Storage: each placement makes its own, in this order (the host optimizer's pinned buffer may
  // become the shard).
  for (auto& up : units) {
    FetchUnit& u = *up;
    if (const std::int64_t block = int8_block_for(o, u.info); block > 0) {
      COSHARD_TRY_ASSIGN(u.weight_blocks, u.plan_blocks(io(), block, modules::detail::BlockBits::int8));
    }
    if (const std::int64_t block = int8_gradient_block_for(o, u.info); block > 0) {
      COSHARD_TRY_ASSIGN(u.grad_blocks, u.plan_blocks(io(), block, gradient_block_bits(o)));
    }
    COSHARD_TRY(shard_placement->allocate(shard_wiring(), u));
    COSHARD_TRY(reduction->allocate(gradient_wiring(), u));
    COSHARD_TRY(residence->bind_at_creation(residence_wiring(), u));
    COSHARD_TRY(optimizer_placement->add_unit(optimizer_wiring(), u));
    // A copy of a block another rank holds too (hybrid sharding) is stepped, but the norm's sum
    // across ranks counts it once: on its copy 0.
    // A parameter every tensor rank holds whole (replicated beside tensor parallelism) counts on
    // tensor rank 0 only.
    // With expert parallelism the norm is summed over the ranks at stage 0 too: there each unit
    // counts on its copy 0 as well (rank 0 for the rest, each run's first rank for its experts).
    const bool tensor_copy = o.tensor_parallel && o.tensor_parallel->rank() != 0 && !u.info.tensor_split;
    if ((norm_summed_over_ranks && u.group->replica != 0) || tensor_copy) {
      const auto group = settings().group_of(u);
      COSHARD_TRY(group.optimizer.set_group_in_norm(group.index, false));
    }
  }
  return {};
}

Result<std::unique_ptr<Engine>> Engine::create(Context& ctx, collectives::Communicator& comm, Module& model,
                                               Optimizer& optimizer, EngineOptions o) {
  if (o.zero_stage < 0 || o.zero_stage > 3)
    return fail(ErrorCode::invalid_argument, "zero_stage=", o.zero_stage, ": expected 0, 1, 2 or 3");
  COSHARD_TRY(check_offload_placement(o));  // (before anything is planned)
  if (o.dtype != DataType::f32 && o.dtype != DataType::bf16 && o.dtype != DataType::f16)
    return fail(ErrorCode::invalid_argument, "Engine dtype ", collectives::to_string(o.dtype),
                ": expected f32, bf16 or f16");
  COSHARD_TRY(modules::detail::check_supported(ctx.kernels(), o.dtype, ctx.device(), "Engine"));
  if (!(comm.stream().device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, "Engine: the communicator's stream runs on ",
                comm.stream().device().to_string(), ", the compute stream on ", ctx.device().to_string());

  COSHARD_TRY(check_tensor_parts(model, o));

  // A loop of the user's own may not have named its thread's rank: the log lines of this rank's
  // reactor name it from here on.
  if (log::thread_rank() < 0) log::set_thread_rank(comm.rank());
  auto s = std::make_unique<State>();
  s->ctx = &ctx;
  s->comm = &comm;
  s->ranks_agree = detail::RankExchange(ctx, comm);
  if (o.tensor_parallel && o.tensor_parallel->size() > 1) s->tensor_agree = detail::RankExchange(ctx, *o.tensor_parallel);
  s->model = &model;
  s->optimizer = &optimizer;
  s->o = o;
  s->timeline = detail::StepTimeline(o.timing, o.record_timeline, o.adaptive_prefetch);
  s->rank = comm.rank();
  s->world = comm.size();
  s->element_size = size_of(o.dtype);
  s->first_group = optimizer.groups().size();
  // Units: modules with direct parameters, in execution (pre-order) order; small leaves merge.
  COSHARD_TRY_ASSIGN(auto plan, detail::plan_fetch_units(model, s->world, o, optimizer.state_tensors()));
  s->adopt_units(std::move(plan));
  COSHARD_TRY(s->note_borrowed_units());
  std::vector<FetchUnitInfo> infos;  // (the memory check and the offload's pinned plan count from them)
  for (const auto& u : s->units) infos.push_back(u->info);
  COSHARD_TRY(s->choose_strategies(infos));
  COSHARD_TRY(check_step_in_backward(o, optimizer.control()));
  COSHARD_TRY(check_swap_gradients(o));
  COSHARD_TRY(check_quantized_gathers(o));
  // A plan this machine cannot hold is refused with the numbers before anything is allocated
  // (activations come on top: a trainer checks those with the rest).
  if (o.check_memory) {
    const MemoryEstimate estimate = detail::estimate_for_units(infos, o, optimizer.state_tensors());
    COSHARD_TRY_ASSIGN(auto machine, machine_memory(ctx.device(), o.offload_optimizer == OffloadTarget::nvme ? o.offload_optimizer.nvme_path
                                                                                                            : std::filesystem::path()));
    COSHARD_TRY(check_fits(estimate, 1, machine));
  }

  // The placements' own setup (the offloaded optimizer's stream, context, pinned memory and swap
  // files; the parameters' read slots), before any unit gets storage.
  COSHARD_TRY(s->optimizer_placement->setup(s->optimizer_wiring(), infos));
  COSHARD_TRY(s->shard_placement->setup(s->shard_wiring()));
  if (s->swap.store && o.record_timeline) s->swap.store->record_spans(true);  // the timeline's "nvme read" and "nvme write" tracks

  COSHARD_TRY(s->give_units_storage());
  COSHARD_TRY(s->optimizer_placement->after_units(s->optimizer_wiring()));
  auto& stream = ctx.stream();
  COSHARD_TRY(s->timeline.start(stream, s->comm->stream()));
  s->timeline.gather_ms.assign(s->units.size(), -1.0);
  COSHARD_LOG_INFO(zero, "engine: stage {}, {} of {} ranks on {} ({}), {} fetch units, max_live_bytes {}, optimizer on {}, "
                   "parameters on {}", o.zero_stage, s->rank, s->world, ctx.device().to_string(), comm.backend(),
                   s->units.size(), o.max_live_bytes, to_string(o.offload_optimizer), to_string(o.offload_params));
  // The CPU's matrix products on weaker OpenBLAS kernels than the CPU runs: said once a process.
  // A COSHARD_CPU_ISA that names no instructions is an error on every CPU run (it is read once).
  if (ctx.device().is_cpu()) {
    COSHARD_TRY(modules::cpu_half_products());
    static std::once_flag said;
    std::call_once(said, [] {
      if (const std::string warning = modules::cpu_blas_kernels().warning(); !warning.empty())
        COSHARD_LOG_WARN(modules, "{}", warning);
    });
  }
  auto engine = std::unique_ptr<Engine>(new Engine(std::move(s)));
  ctx.set_hooks(engine.get());
  return engine;
}

}  // namespace coshard::zero
