// Where the optimizer's state lives (EngineOptions::offload_optimizer), chosen once when the
// engine is made: one interface, three implementations, instead of branches through the engine.
//
// - on the device (optimizer_on_device.cpp): the fp32 masters and moments beside the shards; the
//   optimizer steps on the compute stream.
// - in pinned host memory (optimizer_on_host.cpp, ZeRO-Offload): the gradient shards go out to
//   pinned memory, the optimizer steps on a CPU stream of its own, the updated shards come back.
// - on NVMe (optimizer_on_nvme.cpp, ZeRO-Infinity): as in host memory, but each unit's master and
//   state is a sub-group file streamed in by the swapper, stepped, and written back behind.
//
// Both host placements share the first half of a step (gradient shards out, the norm and overflow
// flag summed over ranks on the device and brought back): HostOptimizer::exchange_grad_stats.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "coshard/async/task.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "fetch_unit.hpp"
#include "gradient_reduction.hpp"
#include "parameter_settings.hpp"
#include "placement/host_side.hpp"
#include "placement/shard_placement.hpp"
#include "placement/swap_files.hpp"
#include "step_timeline.hpp"
#include "stream_order.hpp"

namespace coshard::zero {

namespace detail {
class SwapPass;
}

// What this step does, decided at its start (Engine::begin_step).
struct StepMode {
  // Optimizer offload at stages 0 and 2-3 with one micro-batch: each gradient shard goes out to
  // pinned memory on the communication stream right after its reduction, overlapped with the rest
  // of backward (with more micro-batches the shards are scaled after the last one first).
  bool grads_out_in_backward = false;
  // step_in_backward this step (one micro-batch): each unit is stepped on the host once its last
  // gradient shard is out, at `lr`.
  bool stepping_in_backward = false;
  float lr = 0.0f;
};

// What an optimizer placement acts through: the units and their io, the optimizer with each
// unit's settings, the step's counters and timeline, the reduction's and residence's answers, the
// host side and swap files of an offload, and the pass beside backward (step_in_backward.hpp).
struct OptimizerWiring {
  detail::UnitIo io;
  const std::vector<std::unique_ptr<detail::FetchUnit>>& units;
  modules::Optimizer& optimizer;
  detail::ParameterSettings settings;
  const EngineOptions& o;
  int rank = 0, world = 1;
  EngineStepStats& stats;
  detail::StepTimeline& timeline;
  const GradientReduction& reduction;
  const ParameterResidence& residence;
  detail::HostSide& host;
  detail::SwapFiles& swap;
  detail::SwapPass& pass;
  StepMode& mode;
  // nvme parameters: this rank's block of a unit for its swap file, made on the host by
  // initialize/load_parameters as masters_from_shards writes the file (there is no shard to copy
  // from), one unit at a time.
  ShardPlacement::BlockSource& shard_values;
  // Engine::State::norm_summed_over_ranks: the device step sums the norm over the ranks.
  bool norm_summed_over_ranks = false;

  modules::Context& ctx() const noexcept { return io.ctx; }
  collectives::Communicator& comm() const noexcept { return io.world; }
  std::size_t element_size() const noexcept { return io.element_size(); }
  bool narrow() const noexcept { return o.dtype != modules::DataType::f32; }
  bool offloaded() const noexcept { return o.offload_optimizer != OptimizerOffload::none; }
  bool swapped() const noexcept { return o.offload_optimizer == OptimizerOffload::nvme; }
  bool params_on_nvme() const noexcept { return o.offload_params == OffloadTarget::nvme; }
  // nvme with step_in_backward: no gradient shard in pinned memory. A unit's shard stays on the
  // device until the swapper's pass steps it: each sub-group's buffer has a gradient piece after
  // its master and state (never read from nor written to the file), copied from the device shard
  // just before the piece is stepped, its statistics added there; the shard goes after its last piece.
  bool grads_through_pass() const noexcept { return swapped() && o.step_in_backward; }
  // nvme with swap_gradients (and no step_in_backward): no gradient shard in pinned memory either.
  // A pass of the swapper beside backward writes each unit's shard into its swap file's gradient
  // region as soon as the unit is handed over, adding its statistics; the shard leaves the device
  // after its last piece. The step's pass then reads each sub-group's gradient piece (a read-only
  // extent) with its master and state.
  bool grads_to_nvme() const noexcept { return swapped() && o.swap_gradients && !o.step_in_backward; }
  // Either way the device shard waits for a pass of the swapper (and backward for it, when the
  // shards pending would pass SwapPass's limit).
  bool grads_wait_for_a_pass() const noexcept { return grads_through_pass() || grads_to_nvme(); }
  // The compute stream waits for the communication stream, timed with the timeline.
  Result<void> compute_waits_for_comm(const std::string& what) const {
    return timeline.wait_for(ctx().stream(), comm().stream(), what);
  }
  // The step's gradient statistics (f32[2] on the compute device: the sum of squares, the
  // overflow flag) summed over the ranks that hold other elements: the data ranks when
  // `over_data` (norm_summed_over_ranks), then the tensor ranks (EngineOptions::tensor_parallel),
  // all in the communication stream's order; then the compute stream waits for the sums.
  Result<void> sum_grad_stats(void* stats, bool over_data) const {
    COSHARD_TRY(detail::order(ctx().stream(), comm().stream()));
    if (over_data)
      COSHARD_TRY(comm().all_reduce(stats, stats, 2, modules::DataType::f32, collectives::ReduceOp::sum,
                                    "the gradients' norm"));
    if (collectives::Communicator* tensor = o.tensor_parallel; tensor && tensor->size() > 1) {
      COSHARD_TRY(detail::order(comm().stream(), tensor->stream()));
      COSHARD_TRY_ASSIGN(const auto summed, tensor->all_reduce(stats, stats, 2, modules::DataType::f32,
                                                               collectives::ReduceOp::sum,
                                                               "the gradients' norm over the tensor ranks"));
      COSHARD_TRY(comm().stream().wait(summed));
    }
    return compute_waits_for_comm(detail::kGradStats);
  }
};

// The trained units' sizes the optimizer's memory follows (memory_estimate.cpp).
struct OptimizerSizes {
  std::size_t trained_f32 = 0;  // this rank's shards of the trained units, in fp32
  std::size_t frozen_f32 = 0;   // of the frozen ones (NVMe keeps their masters in the swap files)
  // Of the trained units whose optimizer state a device budget keeps on the device (offload cpu).
  std::size_t kept_f32 = 0;
};

class OptimizerPlacement {
 public:
  virtual ~OptimizerPlacement() = default;
  // Its lines of the memory estimate: the masters and state where they live, and the pinned pool
  // the host placements reserve (the same plan as setup's).
  virtual void estimate(MemoryEstimate& m, const OptimizerSizes& z, std::span<const FetchUnitInfo> units,
                        const EngineOptions& o, std::size_t states) const = 0;
  // What the placement needs before any unit gets storage (the host placements: a CPU stream
  // and context, and the pinned pool reserved for the plan, checked against the budget; NVMe:
  // the rank's claimed swap folder, its store and swapper), and after every unit has (the device
  // copies of the loss scale and statistics the host placements exchange).
  virtual Result<void> setup(const OptimizerWiring&, std::span<const FetchUnitInfo>) { return {}; }
  virtual Result<void> after_units(const OptimizerWiring&) { return {}; }
  // u's optimizer group when the engine is made (after its shard and gradients have storage):
  // on the device over the shard; in host memory over a pinned master (f32) or a pinned copy in
  // the compute dtype (bf16/f16), which is also the shard when the parameters are offloaded; on
  // NVMe a swapped group. The host placements give u a pinned gradient shard to step from.
  virtual Result<void> add_unit(const OptimizerWiring& w, detail::FetchUnit& u) = 0;
  // A step begins, its units ready for it (StepMode decided): what the placement needs first (the
  // host placements: the host's step state to the device, the statistics begun, the pass beside
  // backward started).
  virtual async::Task<Result<void>> begin_step(const OptimizerWiring&) { co_return Result<void>{}; }
  // One optimizer step on this rank's shards, once their gradients are complete and scaled;
  // the updated parameters are on the device, in the compute stream's order, when it returns.
  virtual async::Task<Result<void>> step(const OptimizerWiring& w, float lr) = 0;
  // The fp32 masters (and a fresh state where it is kept apart) follow the shards, after the
  // shards were written outside a step (initialisation, a load).
  virtual async::Task<Result<void>> masters_from_shards(const OptimizerWiring& w) = 0;
  // Awaits `use` on every unit's block with its master and state (Engine::visit_shards).
  virtual async::Task<Result<void>> visit(const OptimizerWiring& w, const Engine::ShardVisitor& use, bool written) = 0;
  // step_in_backward: unit u's last gradient shard of the step is on its way to pinned memory
  // and the host stream is ordered after it: step it (or hand it to the pass that steps it).
  virtual Result<void> step_in_backward(const OptimizerWiring& w, detail::FetchUnit& u) = 0;
};

// The first half of an offloaded step, shared by the two host placements.
class HostOptimizer : public OptimizerPlacement {
 public:
  Result<void> setup(const OptimizerWiring& w, std::span<const FetchUnitInfo> units) override;
  Result<void> after_units(const OptimizerWiring& w) override;
  async::Task<Result<void>> begin_step(const OptimizerWiring& w) override;

 protected:
  // The pinned pool's line of the estimate (offload_pinned_sizes, page-rounded).
  static void estimate_pinned(MemoryEstimate& m, std::span<const FetchUnitInfo> units, const EngineOptions& o,
                              std::size_t states);
  // u's gradient shard in pinned memory (f32), where the host steps it from.
  static Result<void> add_host_grad(const OptimizerWiring& w, detail::FetchUnit& u);
  // Gradient shards not out yet go to pinned memory; the host computes the norm and overflow
  // flag (with step_in_backward, the units not stepped during backward add their share and go to
  // `hand_over_late`); the sums over ranks come back to the host stream through pinned memory.
  async::Task<Result<void>> exchange_grad_stats(const OptimizerWiring& w);
  // Its two halves: this rank's statistics (with grads_through_pass: the late units handed over,
  // the pass adding the statistics as it steps), then their sum over the ranks, back on the host.
  async::Task<Result<void>> local_grad_stats(const OptimizerWiring& w);
  async::Task<Result<void>> sum_grad_stats(const OptimizerWiring& w);
  // step_in_backward: a unit not stepped during backward, its statistics added after it.
  virtual Result<void> hand_over_late(const OptimizerWiring&, detail::FetchUnit&) { return {}; }
};

// Placements whose state is the optimizer's own groups (device, pinned host memory): each unit's
// shard with its group's master and state.
async::Task<Result<void>> visit_optimizer_groups(const OptimizerWiring& w, const Engine::ShardVisitor& use);

// "fp32 masters and 2 state tensors" (bf16/f16) or "optimizer state (2 tensors)" (f32: the shard
// is its own master): what a placement's estimate line holds.
std::string optimizer_state_label(DataType dtype, std::size_t states);
// "fp32 masters and 2 state tensors": the masters apart from the parameters, with their state.
std::string fp32_masters_label(std::size_t states);

// The placement for `where` (EngineOptions::offload_optimizer); null for a value out of range.
std::unique_ptr<OptimizerPlacement> make_optimizer_placement(OffloadTarget where);
std::unique_ptr<OptimizerPlacement> make_optimizer_on_device();
std::unique_ptr<OptimizerPlacement> make_optimizer_on_host();
std::unique_ptr<OptimizerPlacement> make_optimizer_on_nvme();

}  // namespace coshard::zero
