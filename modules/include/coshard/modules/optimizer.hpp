// Optimizers over flat parameter spans: AdamW and SGD with momentum, fp32 master weights,
// global-norm gradient clipping and loss scaling (static, or dynamic for fp16: an overflow skips
// the step and halves the scale; 2000 good steps double it).
//
// Everything that decides a step — the gradient norm, whether a gradient overflowed, the loss
// scale, Adam's step count — lives in a small state block on the device and is read and written
// only by kernels in stream order, so a step never waits for the device. The host reads the
// figures afterwards, when it wants them (read_stats awaits an event).
//
// Groups: add one flat span per shard (stage 0: the whole ParameterStore; ZeRO: the local
// shards). Parameters in f32 are their own master weights; bf16/f16 parameters get an fp32
// master copy, and every step writes the updated weights back in the parameter dtype.
//
// Parameter groups (PyTorch's param_groups): rules chosen by a parameter's name or by a predicate
// give it its own weight decay and learning-rate scale; frozen parameters (Parameter::trainable)
// are never changed. A group of elements that holds several parameters carries segments, one run
// of elements per setting; a group whose elements all take the optimizer's own settings has none
// and steps exactly as before (one launch, the same bits). The clipping norm stays global.
//
// A step is `step(ctx, lr)`, or in two halves for sharded training: `compute_grad_stats(ctx)`,
// then sum `grad_stats()` (two f32: sum of squares, overflow flag) across ranks, then
// `apply(ctx, lr)`.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/modules/module.hpp"

namespace coshard::modules {

struct AdamWOptions {
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 0.01f;  // decoupled (AdamW)
};

struct SgdOptions {
  float momentum = 0.0f;
  float weight_decay = 0.0f;  // L2, added to the gradient
  bool nesterov = false;
};

enum class LossScaling : std::uint8_t { none, fixed, dynamic };

struct StepControlOptions {
  float max_grad_norm = 0.0f;  // 0: no clipping
  LossScaling loss_scaling = LossScaling::none;
  float initial_loss_scale = 65536.0f;  // fixed/dynamic
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  std::int32_t growth_interval = 2000;
};

struct OptimizerStats {
  std::int32_t steps = 0;          // steps applied
  std::int32_t skipped_steps = 0;  // steps skipped for inf/NaN gradients
  float loss_scale = 1.0f;         // the scale for the next backward
  float grad_norm = 0.0f;          // unscaled global norm of the last step, before clipping
  bool last_skipped = false;
};

// Settings for the parameters `matches` accepts (the first rule that matches a parameter wins;
// parameters no rule matches take the optimizer's own).
struct ParameterGroup {
  std::string name;  // in messages
  std::function<bool(std::string_view full_name, const Parameter& parameter)> matches;
  std::optional<float> weight_decay;  // unset: the optimizer's
  float lr_scale = 1.0f;              // the step's learning rate times this
  // AdamW's moments and epsilon for this group (unset: the optimizer's; refused for SGD).
  std::optional<float> beta1, beta2, eps;
  // Parameters whose full name matches the glob `pattern` (glob_matches).
  static ParameterGroup by_name(std::string pattern, std::optional<float> weight_decay, float lr_scale = 1.0f);
  // The GPT-2 and Llama recipes' rule: no weight decay on parameters of one dimension (biases,
  // norms' gains).
  static ParameterGroup no_decay_for_vectors();
};

class ParameterStore;

class Optimizer {
 public:
  // How elements [begin, end) of a group step (group-relative; resolved settings).
  struct Segment {
    std::int64_t begin = 0;
    std::int64_t end = 0;
    float weight_decay = 0;
    float lr_scale = 1.0f;
    float beta1 = 0, beta2 = 0, eps = 0;  // AdamW's (0 for SGD)
    bool frozen = false;  // never changed
    bool same_settings(const Segment& o) const noexcept {
      return weight_decay == o.weight_decay && lr_scale == o.lr_scale && beta1 == o.beta1 && beta2 == o.beta2 &&
             eps == o.eps && frozen == o.frozen;
    }
  };

  static Result<std::unique_ptr<Optimizer>> adamw(AdamWOptions options, StepControlOptions control = {});
  static Result<std::unique_ptr<Optimizer>> sgd(SgdOptions options, StepControlOptions control = {});
  virtual ~Optimizer();
  // An optimizer of the same kind, settings and parameter-group rules, with no groups and a fresh
  // step state: a part of one model's optimizer that lives on another device (the ZeRO engine
  // steps the units a device budget keeps on the device with one, the rest on the host).
  Result<std::unique_ptr<Optimizer>> empty_like() const;
  // "adamw" or "sgd": what a checkpoint records, and a load compares.
  std::string_view name() const noexcept;

  // The rules of parameter groups, before any group is added (checked: a rule needs a predicate,
  // weight_decay >= 0, a finite lr_scale >= 0, betas in [0, 1) and eps > 0, and betas or eps only
  // for AdamW).
  Result<void> set_parameter_groups(std::vector<ParameterGroup> rules);
  const std::vector<ParameterGroup>& parameter_groups() const noexcept { return rules_; }
  // The settings of one parameter's elements (begin and end left 0): frozen when it does not
  // train, else its rule's, else the optimizer's.
  Segment settings_for(std::string_view full_name, const Parameter& parameter) const;
  // The optimizer's own settings (a segment of them is no segment).
  Segment default_settings() const noexcept;

  // Adds a flat span of parameters and their gradients (same shape, on ctx's device). The master
  // copy and state are allocated here; the tensors must stay valid while the optimizer is used.
  // `segments` (sorted, within the span, not overlapping; gaps take the optimizer's settings)
  // give runs of elements settings of their own.
  // `all_frozen`: what a span whose elements are all frozen gets (below): nothing (a frozen group),
  // or a master and state like any other (hold_state: the ZeRO engine's block of a unit that trains
  // on other ranks, so that every block of a unit has one layout in checkpoints and visits).
  enum class AllFrozen : std::uint8_t { hold_nothing, hold_state };
  Result<void> add_group(Context& ctx, Tensor params, Tensor grads, std::vector<Segment> segments = {},
                         AllFrozen all_frozen = AllFrozen::hold_nothing);
  // A ParameterStore's whole span, each parameter with its settings (parameter groups, frozen
  // parameters): the unsharded form of what the ZeRO engine does per shard.
  Result<void> add_group(Context& ctx, const ParameterStore& store);
  // A group of `numel` elements that are all frozen: it holds nothing (no master, no state, no
  // gradient) and every step passes it by, so a frozen unit costs the optimizer no memory. It
  // keeps its place in the numbering of groups. add_group makes one too when every element of the
  // span it is given is frozen.
  Result<void> add_frozen_group(Context& ctx, std::int64_t numel);
  // Whether group i is left untouched by the coming steps (its parameters got no gradient this
  // step: PyTorch leaves a parameter whose gradient is None as it is). Until changed.
  Result<void> set_group_skipped(std::size_t group, bool skipped);
  // Runs of group i's elements, [begin, end) each, sorted and apart, left untouched by the coming
  // steps as frozen ones are (parameters of a group that got no gradient this step while the rest
  // did: PyTorch's rule, per parameter). Empty: none. Until changed.
  Result<void> set_group_skipped_runs(std::size_t group, std::vector<std::pair<std::int64_t, std::int64_t>> runs);
  // Runs of group i's elements, each with the steps its parameters were left out of so far (no
  // gradient): PyTorch counts each parameter's own steps, so their AdamW bias correction counts
  // that many fewer. Sorted and apart; elements in none missed no step. Until changed.
  struct MissedSteps {
    std::int64_t begin = 0, end = 0;
    std::int32_t steps = 0;
  };
  Result<void> set_group_steps_missed(std::size_t group, std::vector<MissedSteps> runs);
  // Whether group i's gradient counts in the norm and overflow flag this optimizer computes
  // (true until changed). A copy of a block another rank counts (hybrid sharding's replicas) is
  // left out, so the sum across ranks counts each element once; it is still stepped.
  Result<void> set_group_in_norm(std::size_t group, bool counted);

  // A group whose fp32 master and state live elsewhere (swapped in from NVMe for each step): only
  // its gradients are bound here (f32); apply_group supplies the rest. Such groups are stepped
  // with apply_group + finish_step, not apply.
  Result<void> add_swapped_group(Context& ctx, Tensor grads, std::vector<Segment> segments = {});
  // A swapped group of `numel` elements whose gradients are not bound either: they come with each
  // piece (apply_group_range's and add_grad_stats's `grads`), from wherever the caller keeps them.
  Result<void> add_swapped_group(Context& ctx, std::int64_t numel, std::vector<Segment> segments = {});
  // The fp32 state tensors a group needs beside its master: 2 for AdamW, 1 for SGD with
  // momentum, 0 without.
  std::size_t state_tensors() const noexcept;
  // One group's update with its master and state given (f32, the group's length; state2/state1
  // may be empty when state_tensors() says so). After compute_grad_stats and the cross-rank sum.
  // `params_out` (optional, the group's length, on ctx's device): the updated master cast into it
  // (bf16/f16 parameters of an fp32 master), in the same pass.
  Result<void> apply_group(Context& ctx, std::size_t group, float lr, Tensor master, Tensor state1, Tensor state2,
                           Tensor params_out = {});
  // apply_group over elements [begin, begin + n) of the group only, n being master's length (and
  // the state's and params_out's): a piece of a swapped group, streamed in pieces (the ZeRO
  // engine's sub_group_size). The kernels are element-wise: pieces give the whole's bits.
  // `grads` (f32, n elements): the piece's gradients, for a group added without them.
  Result<void> apply_group_range(Context& ctx, std::size_t group, std::int64_t begin, float lr, Tensor master,
                                 Tensor state1, Tensor state2, Tensor params_out = {}, Tensor grads = {});
  // Ends a step made of apply_group calls: the step count, the overflow skip, the loss scale.
  Result<void> finish_step(Context& ctx);

  // Copies the parameters into their fp32 masters again (after the parameters were overwritten:
  // initialisation, a checkpoint load). Nothing to do for f32 parameters.
  Result<void> reset_masters(Context& ctx);

  // The loss scale as a one-element f32 tensor on the device, to seed backward with.
  Tensor loss_scale() const noexcept;

  Result<void> compute_grad_stats(Context& ctx);
  // compute_grad_stats in pieces, for a step that updates groups as their gradients come (the
  // ZeRO engine's step_in_backward): begin, then each group's share, in any order.
  Result<void> begin_grad_stats(Context& ctx);
  Result<void> add_grad_stats(Context& ctx, std::size_t group);
  // A piece of group i's gradients (f32, on ctx's device), for a group added without them.
  Result<void> add_grad_stats(Context& ctx, std::size_t group, const Tensor& grads);
  // One bound group's update (apply() is every group's, then finish_step).
  Result<void> apply_one(Context& ctx, std::size_t group, float lr);
  const StepControlOptions& control() const noexcept;
  // f32[2]: sum of squared gradients, overflow flag. Sum it across ranks before apply().
  Tensor grad_stats() const noexcept;
  Result<void> apply(Context& ctx, float lr);
  Result<void> step(Context& ctx, float lr);

  // The step figures after everything enqueued so far (awaits an event; never blocks).
  async::Task<Result<OptimizerStats>> read_stats(Context& ctx);

  struct Group {
    Tensor params;
    Tensor grads;
    Tensor master;  // fp32; aliases params when they are f32
    Tensor state1;  // Adam m / SGD momentum
    Tensor state2;  // Adam v
    std::vector<Segment> segments;  // empty: the optimizer's settings throughout; else covering it
    bool skipped = false;           // set_group_skipped
    std::vector<std::pair<std::int64_t, std::int64_t>> skipped_runs = {};  // set_group_skipped_runs
    std::vector<MissedSteps> steps_missed = {};                            // set_group_steps_missed
    bool frozen = false;            // add_frozen_group: every element frozen, no tensors but params
    bool in_norm = true;            // set_group_in_norm
  };
  const std::vector<Group>& groups() const noexcept { return groups_; }
  // Forgets groups [first, end) (their owner is going away; the ZeRO engine's destructor calls
  // it for groups it made on its own offload context). With none left, the step state goes too.
  void drop_groups_from(std::size_t first) noexcept;
  // The device step state (f32[8]: norm scratch, loss scale, step counts, growth tracker), for
  // checkpoints: every rank holds the same bytes. Empty before the first add_group.
  Tensor step_state() const noexcept { return state_; }

 protected:
  struct Impl;
  explicit Optimizer(std::unique_ptr<Impl> impl);

 private:
  Result<void> ensure_state(Context& ctx);
  Result<std::vector<Segment>> normalized(std::vector<Segment> segments, std::int64_t n) const;
  // Calls step(begin, end, settings, steps missed) for each run of group g's elements that steps:
  // its segments (the optimizer's settings throughout when it has none), less frozen ones and
  // skipped runs, cut where the steps its parameters missed change.
  template <class Step>
  Result<void> for_each_stepped_run(const Group& g, Step step) const;
  // One group's update from its master and state (every segment's run).
  // Elements [begin, begin + count) of g; master, state and params_out point at element begin.
  // `grads` (optional): the piece's own gradients, element begin first (else the group's).
  Result<void> update(Context& ctx, const Group& g, std::int64_t begin, std::int64_t count, float lr, float* master,
                      float* state1, float* state2, DataType pdt, void* params_out, const float* grads = nullptr) const;
  std::unique_ptr<Impl> impl_;
  std::vector<ParameterGroup> rules_;
  std::vector<Group> groups_;
  Tensor state_;  // the device step state (32 bytes)
};

}  // namespace coshard::modules
