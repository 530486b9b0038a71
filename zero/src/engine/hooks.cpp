// The module hooks: every module of the model calls them around its forward and backward; a
// unit's first module acquires it, its last gives it back (the residence: fetch and release at
// stage 3), and a backward reduces it (the gradient reduction).
// Misuse of the loop (a forward outside a step, too many micro-batches) is caught here.
#include <algorithm>

#include "engine/state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;

async::Task<Result<void>> Engine::before_forward(Context& ctx, Module& module) {
  State& s = *s_;
  // A recompute (activation checkpointing) runs inside a backward: the unit is gathered again,
  // in the trace's order, but it is not another use (as many backward passes as uses come).
  const bool recompute = ctx.recomputing();
  if (recompute && s.loop.open != State::Open::step)
    co_return fail(ErrorCode::invalid_argument, "Engine: a recompute of ", module.type_name(),
                   " outside a step (activation checkpointing recomputes in backward only)");
  if (s.owns(module) && !recompute) {
    if (s.loop.open == State::Open::none)
      co_return fail(ErrorCode::invalid_argument, "Engine: forward of ", module.type_name(),
                     " outside a step or an inference pass (call begin_step or begin_inference first, or use "
                     "step / evaluate)");
    if (&module == s.model && s.loop.open == State::Open::step && ++s.loop.model_forwards > s.loop.declared_micro_batches)
      co_return fail(ErrorCode::invalid_argument, "Engine: forward of micro-batch ", s.loop.model_forwards,
                     " in a step begun with ", s.loop.declared_micro_batches,
                     " (begin_step(micro_batches) declares the gradient accumulation up front)");
  }
  FetchUnit* u = s.unit_for(module);
  // A coalesced unit open in forward is done once a module of another unit starts (a unit's
  // modules run in one stretch), or the model does.
  if (s.open_forward && s.open_forward != u && (u || &module == s.model)) COSHARD_CO_TRY(s.close_open_forward(ctx));
  if (&module == s.model && !recompute) s.new_coalesced_pass();
  // Units whose parameters this module declared it reads: used as if their owner ran here.
  if (const auto* lent = s.module_units.borrowed_of(module))
    for (const std::size_t i : *lent) {
      FetchUnit& b = *s.units[i];
      if (!recompute) {
        ++b.forward_uses;
        ++b.uses_pending;
      }
      const ResidenceWiring wiring = s.residence_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
      COSHARD_CO_TRY(co_await s.residence->acquire(wiring, b));
    }
  if (!u) co_return Result<void>{};
  // A unit opens at its first module; a coalesced one, whose first module may be skipped, at the
  // first of its modules to run in the pass (a module of it run again after it closed does not
  // open it again: an undeclared second use, as before).
  const bool front = &module == u->modules.front();
  if (u->coalesced() && (front || (!u->forward_open && !u->opened_in_forward))) {
    if (u->forward_open) COSHARD_CO_TRY(s.close_open_forward(ctx));  // (its last use's, its last module skipped)
    u->forward_open = u->opened_in_forward = true;
    u->first_ran = &module;
    s.open_forward = u;
  } else if (!front) {
    co_return Result<void>{};
  }
  if (!recompute) {
    ++u->forward_uses;
    ++u->uses_pending;
  }
  const ResidenceWiring wiring = s.residence_wiring();
  COSHARD_CO_TRY(co_await s.residence->acquire(wiring, *u));
  if (s.timeline.spans_on()) {
    COSHARD_CO_TRY_ASSIGN(u->compute_start, s.ctx->stream().record_timed());
  }
  co_return Result<void>{};
}

Result<void> Engine::after_forward(Context& ctx, Module& module) {
  State& s = *s_;
  if (const auto* lent = s.module_units.borrowed_of(module))
    for (const std::size_t i : *lent)
      COSHARD_TRY(s.residence->after_use(s.residence_wiring(), *s.units[i]));
  if (&module == s.model) COSHARD_TRY(s.close_open_forward(ctx));  // (its last module skipped)
  FetchUnit* u = s.unit_for(module);
  if (!u || &module != u->modules.back()) return {};
  if (u->coalesced() && u->forward_open) return s.close_open_forward(ctx);
  return s.finish_forward(ctx, *u);
}

Result<void> Engine::State::finish_forward(Context& c, FetchUnit& u) {
  if (timeline.spans_on()) {
    COSHARD_TRY_ASSIGN(auto end, ctx->stream().record_timed());
    timeline.span(true, c.recomputing() ? "recompute" : "forward", u.info.name, std::move(u.compute_start),
                  std::move(end), u.fetch_pos);
  }
  return residence->after_use(residence_wiring(), u);
}

Result<void> Engine::State::close_open_forward(Context& c) {
  if (!open_forward) return {};
  FetchUnit& u = *open_forward;
  open_forward = nullptr;
  u.forward_open = false;
  return finish_forward(c, u);
}

async::Task<Result<void>> Engine::before_backward(Context& ctx, Module& module) {
  State& s = *s_;
  if (s.owns(module)) {
    if (s.loop.open != State::Open::step)
      co_return fail(ErrorCode::invalid_argument, "Engine: backward of ", module.type_name(), " outside a step",
                     s.loop.open == State::Open::inference ? " (in an inference pass: forward only)" : " (call begin_step first)");
    if (&module == s.model) ++s.loop.model_backwards;
  }
  COSHARD_CO_TRY(s.close_open_forward(ctx));  // (a recompute's, activation checkpointing: backward follows it)
  if (&module == s.model) s.new_coalesced_pass();
  if (const auto* lent = s.module_units.borrowed_of(module))
    for (const std::size_t i : *lent) {
      FetchUnit& b = *s.units[i];
      const ResidenceWiring wiring = s.residence_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
      COSHARD_CO_TRY(co_await s.residence->acquire(wiring, b));
      COSHARD_CO_TRY(s.reduction->begin_backward(s.gradient_wiring(), b));
    }
  FetchUnit* u = s.unit_for(module);
  if (!u) co_return Result<void>{};
  // Backward mirrors forward: a unit opens at its last module, a coalesced one whose last module
  // was skipped at the first of its modules to run backward.
  const bool back = &module == u->modules.back();
  if (u->coalesced() && (back || (!u->backward_open && !u->opened_in_backward))) {
    u->backward_open = u->opened_in_backward = true;
  } else if (!back) {
    co_return Result<void>{};
  }
  {
    const OptimizerWiring wiring = s.optimizer_wiring();  // (named: an aggregate temporary in co_await, GCC 12)
    COSHARD_CO_TRY(co_await s.pass.wait_before_backward(wiring, *u));
  }  // (gradient shards waiting for the swapper's pass)
  const ResidenceWiring wiring = s.residence_wiring();
  COSHARD_CO_TRY(co_await s.residence->acquire(wiring, *u));
  COSHARD_CO_TRY(s.reduction->begin_backward(s.gradient_wiring(), *u));
  if (s.timeline.spans_on()) {
    COSHARD_CO_TRY_ASSIGN(u->compute_start, s.ctx->stream().record_timed());
  }
  co_return Result<void>{};
}

Result<void> Engine::after_backward(Context&, Module& module) {
  State& s = *s_;
  if (const auto* lent = s.module_units.borrowed_of(module))
    for (const std::size_t i : *lent) {
      FetchUnit& b = *s.units[i];
      COSHARD_TRY(s.reduction->after_backward(s.gradient_wiring(), b));
      COSHARD_TRY(s.residence->after_use(s.residence_wiring(), b));
    }
  FetchUnit* u = s.unit_for(module);
  if (!u) return {};
  // A unit closes at its first module; a coalesced one whose first module was skipped at the
  // module that opened its forward.
  if (u->coalesced()) {
    u->module_runs[s.module_units.position_in_unit.at(&module)].used = true;
    if (&module != u->modules.front() && !(u->backward_open && &module == u->first_ran)) return {};
    u->backward_open = false;
  } else if (&module != u->modules.front()) {
    return {};
  }
  if (s.timeline.spans_on()) {
    COSHARD_TRY_ASSIGN(auto end, s.ctx->stream().record_timed());
    s.timeline.span(true, "backward", u->info.name, std::move(u->compute_start), std::move(end), u->fetch_pos);
  }
  COSHARD_TRY(s.reduction->after_backward(s.gradient_wiring(), *u));
  return s.residence->after_use(s.residence_wiring(), *u);
}

Result<void> Engine::wait_for_collective(Context& ctx, const async::Event& done, const std::string& what) {
  return s_->timeline.wait(ctx.stream(), done, what);
}

// One all-reduce of the flags over the engine's ranks, awaited (with one rank: nothing).
async::Task<Result<void>> Engine::agree_on_union(Context&, std::span<double> chosen, const std::string& what) {
  State& s = *s_;
  if (s.ranks_agree.size() <= 1 || chosen.empty()) co_return Result<void>{};
  COSHARD_CO_TRY_ASSIGN(const auto agreed, co_await s.ranks_agree.all_reduce_values(chosen, collectives::ReduceOp::max, what));
  for (std::size_t i = 0; i < chosen.size(); ++i) chosen[i] = agreed[i] != 0.0 ? 1.0 : 0.0;
  co_return Result<void>{};
}

// The routed units of `modules` (and their submodules), in order, gathered ahead at stage 3.
void Engine::announce_next(Context&, std::span<Module* const> modules) {
  State& s = *s_;
  if (!s.gathers || !s.residence->sharded() || s.o.zero_stage != 3) return;
  std::vector<FetchUnit*> next;
  for (Module* m : modules)
    m->for_each_module([&](const std::string&, Module& x) {
      FetchUnit* u = s.unit_for(x);
      if (u && u->info.routed && std::find(next.begin(), next.end(), u) == next.end()) next.push_back(u);
    });
  s.gathers->announce(std::move(next));
}

Error Engine::explain_failure(Module& module, Error error) {
  State& s = *s_;
  // Parameters asked for while not gathered: the module's own, another's; another's gradient
  // asked for while none was bound (an undeclared read whose backward wrote into grad()).
  std::string own, read, written;
  for (const auto& u : s.units)
    for (const auto& p : u->params) {
      const bool mine = std::any_of(module.parameters().begin(), module.parameters().end(),
                                    [&](const auto& q) { return q.get() == p.parameter; });
      const std::string& name = s.names.at(p.parameter);
      if (!mine && p.parameter->gradient_missed() && !p.parameter->value_missed()) {
        const auto dot = name.rfind('.');
        written += (written.empty() ? "" : ", ") + name + " (unit " + u->info.name + ", owned by module '" +
                   (dot == std::string::npos ? std::string() : name.substr(0, dot)) + "')";
        p.parameter->clear_gradient_missed();
        continue;
      }
      // (a layer checks its own parameters are bound before it reads them)
      if (!p.parameter->value_missed() && !(mine && !p.parameter->bound())) continue;
      if (mine) {
        if (own.empty()) own = u->info.name;
      } else {
        const auto dot = name.rfind('.');
        read += (read.empty() ? "" : ", ") + name + " (unit " + u->info.name + ", owned by module '" +
                (dot == std::string::npos ? std::string() : name.substr(0, dot)) + "')";
      }
      p.parameter->clear_gradient_missed();  // explained once, by the innermost failing module
    }
  if (own.empty() && read.empty() && written.empty()) return error;
  std::string path = "?";
  s.model->for_each_module([&](const std::string& at, Module& m) {
    if (&m == &module) path = at.empty() ? "(the model)" : at;
  });
  const std::string who = "Engine: module '" + path + "' (" + std::string(module.type_name()) + ")";
  if (!own.empty())  // it ran again after its unit was released: a second use in the pass
    return Error(ErrorCode::invalid_argument,
                 ::coshard::detail::concat(who, " ran while its unit ", own, " was not gathered: a module that runs "
                                           "more than once in a pass must say so before the engine is built "
                                           "(set_runs_more_than_once_per_pass()); it failed with: ", error.message()));
  if (read.empty())
    return Error(ErrorCode::invalid_argument,
                 ::coshard::detail::concat(who, " asked for the gradient of ", written, " while none was bound: a module "
                                           "that reads another module's parameter must declare it "
                                           "(reader.use_parameters_of(owner)), so that its gradient is bound and reduced "
                                           "with the owner's; it failed with: ", error.message()));
  return Error(ErrorCode::invalid_argument,
               ::coshard::detail::concat(who, " read ", read, " while it was not gathered: a module that reads another "
                                         "module's parameter must declare it (reader.use_parameters_of(owner)); it "
                                         "failed with: ", error.message()));
}

void Engine::State::reset_coalesced(bool new_step) {
  open_forward = nullptr;
  for (auto& u : units) {
    if (!u->coalesced()) continue;
    u->forward_open = u->backward_open = u->opened_in_forward = u->opened_in_backward = false;
    if (new_step)
      for (auto& run : u->module_runs) run.used = false;
  }
}

void Engine::State::new_coalesced_pass() {
  if (!module_units.any_coalesced()) return;  // (no coalesced unit)
  for (auto& u : units) u->opened_in_forward = u->opened_in_backward = false;
}

}  // namespace coshard::zero
