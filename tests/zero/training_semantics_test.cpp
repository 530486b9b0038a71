// PyTorch's training semantics for a user's own model, checked against the unsharded model
// (ParameterStore, one optimizer group over it) at every stage, world sizes 1-3 with uneven
// splits, gradient accumulation, clipping, and the optimizer and parameters offloaded:
// frozen parameters (bit for bit their initial values), parameter groups (weight decay and a
// learning-rate scale per group), and a branch that does not run in some steps (left untouched).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "coshard/modules/checkpointing.hpp"
#include "coshard/modules/ops.hpp"
#include "coshard/modules/parameter_store.hpp"
#include "coshard/zero/engine.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "../support/on_ranks.hpp"
#include "../support/regression_mlp.hpp"

namespace coshard::zero {
namespace {

using ::coshard::testing::kMlpHidden;
using ::coshard::testing::kMlpRows;
using modules::Init;
using modules::ParameterGroup;

constexpr int kSteps = 6;
constexpr float kLr = 3e-2f;

// Runs its child only in the steps `enabled` says, otherwise passes its input through: a branch
// the model takes in some steps and not in others (its parameters get no gradient then).
class Branch final : public Module {
 public:
  Branch(std::unique_ptr<Module> inner, const bool* enabled) : enabled_(enabled) {
    register_child("inner", std::move(inner));
  }
  std::string_view type_name() const override { return "Branch"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor x) override {
    ran_ = *enabled_;
    if (!ran_) co_return x;
    co_return co_await ctx.forward(*children().front().module, std::move(x));
  }
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor dy) override {
    if (!ran_) co_return dy;
    co_return co_await ctx.backward(*children().front().module, std::move(dy));
  }

 private:
  const bool* enabled_;
  bool ran_ = false;
};

// on_rank_one: a rank-dependent branch (sharded runs only; stage 1 allows it).
// Runs its child twice in a row (backward: twice, in reverse order): one instance used twice in a
// pass, as weight sharing across positions or a block applied twice.
class Twice final : public Module {
 public:
  explicit Twice(std::unique_ptr<Module> inner) { register_child("inner", std::move(inner)); }
  std::string_view type_name() const override { return "Twice"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor x) override {
    COSHARD_CO_TRY_ASSIGN(Tensor once, co_await ctx.forward(*children().front().module, std::move(x)));
    co_return co_await ctx.forward(*children().front().module, std::move(once));
  }
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor dy) override {
    COSHARD_CO_TRY_ASSIGN(Tensor once, co_await ctx.backward(*children().front().module, std::move(dy)));
    co_return co_await ctx.backward(*children().front().module, std::move(once));
  }
};

// What runs twice: a Linear, a block (Linear, Gelu, Linear), the block checkpointed; declared,
// or (undeclared_layer) a Linear that does not say so, coalesced with its neighbours.
enum class Reuse { none, layer, block, checkpointed_block, undeclared_layer };

enum class BranchRuns { always, some_steps, never, on_rank_one };
// The shape of the model: the MLP with a branch, or with a readout of its own that reads fc1's
// weight (declared, or not).
// (undeclared_unguarded: its backward writes grad() without checking it is there, as a careless
// layer does)
enum class Tie { none, declared, undeclared, undeclared_unguarded };

struct Semantics {
  std::vector<std::string> frozen;  // globs
  bool groups = false;              // no decay for vectors; fc2.weight at half the learning rate
  BranchRuns branch = BranchRuns::always;
  Tie tie = Tie::none;
  Reuse reuse = Reuse::none;
};

// y = h W, where W [32, 6] is another module's weight (fc1's): a layer tied to another's table,
// written with the public ops the way a user writes one.
class TiedReadout final : public Module {
 public:
  TiedReadout(const Parameter& table, bool guarded) : table_(&table), guarded_(guarded) {}
  std::string_view type_name() const override { return "TiedReadout"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor h) override {
    COSHARD_CO_TRY_ASSIGN(Tensor y, modules::ops::matmul(ctx, h, table_->value()));
    input_ = std::move(h);
    co_return y;
  }
  // dh = dy W^T; dW += h^T dy.
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor dy) override {
    COSHARD_CO_TRY_ASSIGN(Tensor dh, modules::ops::matmul(ctx, dy, table_->value(), {.trans_b = true}));
    if (table_->grad() || !guarded_)
      COSHARD_CO_TRY(modules::ops::matmul_into(ctx, input_, dy, table_->grad(), {.trans_a = true, .beta = 1.0f}));
    input_ = {};
    co_return dh;
  }
  void clear_saved() override { input_ = {}; }

 private:
  const Parameter* table_;
  bool guarded_;
  Tensor input_;
};

// some_steps: the branch runs in steps 0, 1 and 4 only.
bool branch_runs(int step, BranchRuns runs) {
  return runs == BranchRuns::always || (runs == BranchRuns::some_steps && (step < 2 || step == 4));
}

// The regression MLP with a branch (a Linear, near identity) between its activation and fc2.
struct Model {
  bool enabled = true;
  std::unique_ptr<modules::Sequential> net;
  static Result<std::unique_ptr<Model>> make(const Semantics& sem) {
    auto m = std::make_unique<Model>();
    m->net = std::make_unique<modules::Sequential>();
    if (sem.reuse != Reuse::none) {
      m->net->add("fc1", std::make_unique<modules::Linear>(6, kMlpHidden, true, Init::normal(0.3)));
      m->net->add("act", std::make_unique<modules::Gelu>());
      std::unique_ptr<Module> inner;
      if (sem.reuse == Reuse::layer || sem.reuse == Reuse::undeclared_layer) {
        inner = std::make_unique<modules::Linear>(kMlpHidden, kMlpHidden, true, Init::normal(0.15));
      } else {
        auto block = std::make_unique<modules::Sequential>();
        block->add("a", std::make_unique<modules::Linear>(kMlpHidden, kMlpHidden, true, Init::normal(0.15)));
        block->add("g", std::make_unique<modules::Gelu>());
        block->add("b", std::make_unique<modules::Linear>(kMlpHidden, kMlpHidden, true, Init::normal(0.15)));
        inner = std::move(block);
        if (sem.reuse == Reuse::checkpointed_block) inner = std::make_unique<modules::Checkpointed>(std::move(inner));
      }
      if (sem.reuse != Reuse::undeclared_layer) inner->set_runs_more_than_once_per_pass();
      m->net->add("twice", std::make_unique<Twice>(std::move(inner)));
      m->net->add("fc2", std::make_unique<modules::Linear>(kMlpHidden, 2, true, Init::normal(0.3)));
      for (const auto& pattern : sem.frozen) COSHARD_TRY(m->net->set_trainable_matching(pattern, false));
      return m;
    }
    if (sem.tie != Tie::none) {
      auto& fc1 = m->net->add("fc1", std::make_unique<modules::Linear>(6, kMlpHidden, true, Init::normal(0.3)));
      m->net->add("act", std::make_unique<modules::Gelu>());
      auto& readout = m->net->add("readout", std::make_unique<TiedReadout>(*fc1.parameters()[0],
                                                                           sem.tie != Tie::undeclared_unguarded));
      if (sem.tie == Tie::declared) COSHARD_TRY(readout.use_parameters_of(fc1));
      m->net->add("fc2", std::make_unique<modules::Linear>(6, 2, true, Init::normal(0.3)));
      for (const auto& pattern : sem.frozen) COSHARD_TRY(m->net->set_trainable_matching(pattern, false));
      return m;
    }
    m->net->add("fc1", std::make_unique<modules::Linear>(6, kMlpHidden, true, Init::normal(0.3)));
    m->net->add("act", std::make_unique<modules::Gelu>());
    m->net->add("branch", std::make_unique<Branch>(
                              std::make_unique<modules::Linear>(kMlpHidden, kMlpHidden, true, Init::normal(0.2)),
                              &m->enabled));
    m->net->add("fc2", std::make_unique<modules::Linear>(kMlpHidden, 2, true, Init::normal(0.3)));
    for (const auto& pattern : sem.frozen) COSHARD_TRY(m->net->set_trainable_matching(pattern, false));
    return m;
  }
};

Result<std::unique_ptr<Optimizer>> make_optimizer(const Semantics& sem, float clip) {
  modules::StepControlOptions control;
  control.max_grad_norm = clip;
  COSHARD_TRY_ASSIGN(auto opt, Optimizer::adamw({.weight_decay = 0.1f}, control));
  if (sem.groups) {
    // fc1.weight with AdamW moments and epsilon of its own.
    ParameterGroup moments = ParameterGroup::by_name("fc1.weight", std::nullopt);
    moments.beta1 = 0.8f;
    moments.beta2 = 0.99f;
    moments.eps = 1e-6f;
    COSHARD_TRY(opt->set_parameter_groups({ParameterGroup::no_decay_for_vectors(),
                                           ParameterGroup::by_name("fc2.weight", std::nullopt, 0.5f), moments}));
  }
  return opt;
}

using Values = std::map<std::string, std::vector<float>>;

struct RunResult {
  std::vector<double> losses;
  std::uint64_t reduced_bytes = 0;  // the last step's reduce_scattered_bytes (sharded runs)
  Values initial, final;
  // Rank 0, sharded runs: the most bytes its device allocator was asked for at once (the order of
  // requests decides it, not timing) and its optimizer's groups (frozen or not, tensors held).
  std::size_t device_peak_bytes = 0;
  std::vector<Optimizer::Group> groups;
};

Values values_of(const std::vector<double>& flat, const modules::ParameterStore& store) {
  Values out;
  for (const auto& e : store.entries())
    out[e.name] = std::vector<float>(flat.begin() + e.offset, flat.begin() + e.offset + e.parameter->numel());
  return out;
}

// The unsharded model on the whole batch. The branch's parameters are restored (values and
// moments) after each step it did not run: "left untouched", written out by hand.
RunResult reference(const Semantics& sem, float clip) {
  async::Runtime rt;
  auto stream = async::Stream::create(async::Device::cpu());
  auto allocator = async::CachingAllocator::create(async::Device::cpu());
  auto ctx = Context::create(*stream, **allocator);
  RunResult run;
  auto done = rt.block_on([&]() -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, Model::make(sem));
    COSHARD_CO_TRY_ASSIGN(auto store, modules::ParameterStore::create(*ctx, *model->net, DataType::f32));
    COSHARD_CO_TRY(co_await store.initialize(*ctx, 7));
    COSHARD_CO_TRY_ASSIGN(auto opt, make_optimizer(sem, clip));
    COSHARD_CO_TRY(opt->add_group(*ctx, store));
    COSHARD_CO_TRY_ASSIGN(auto initial, co_await ctx->read(store.values()));
    run.initial = values_of(initial, store);
    const auto& g = opt->groups().front();
    std::int64_t begin = 0, end = 0;  // the branch's elements
    for (const auto& e : store.entries())
      if (e.name.starts_with("branch.")) {
        if (end == 0) begin = e.offset;
        end = e.offset + e.parameter->numel();
      }
    modules::MeanSquaredErrorLoss loss;
    std::int32_t branch_missed = 0;  // steps the branch was left out of: its own AdamW step count lags
    for (int step = 0; step < kSteps; ++step) {
      model->enabled = branch_runs(step, sem.branch);
      if (branch_missed > 0) {
        std::vector<Optimizer::MissedSteps> missed(1);  // (no braced temporaries in a coroutine: GCC 12)
        missed[0].begin = begin;
        missed[0].end = end;
        missed[0].steps = branch_missed;
        COSHARD_CO_TRY(opt->set_group_steps_missed(0, std::move(missed)));
      }
      COSHARD_CO_TRY_ASSIGN(auto b, ::coshard::testing::regression_rows(*ctx, step, 0, kMlpRows));
      COSHARD_CO_TRY(store.zero_grad(*ctx));
      std::vector<std::vector<double>> kept;
      if (!model->enabled)
        for (const Tensor& t : {g.master, g.state1, g.state2}) {
          COSHARD_CO_TRY_ASSIGN(auto all, co_await ctx->read(t));
          kept.push_back(std::move(all));
        }
      COSHARD_CO_TRY_ASSIGN(Tensor value, co_await modules::forward_backward(*ctx, *model->net, loss, b.inputs,
                                                                            b.targets, opt->loss_scale()));
      // A frozen parameter's gradient is never computed (its part of the flat buffer stays zero),
      // so it adds nothing to the clipping norm either.
      COSHARD_CO_TRY_ASSIGN(auto grads, co_await ctx->read(store.grads()));
      for (const auto& e : store.entries())
        if (!e.parameter->trainable())
          for (std::int64_t i = 0; i < e.parameter->numel(); ++i)
            if (grads[static_cast<std::size_t>(e.offset + i)] != 0.0)
              co_return fail(ErrorCode::internal, "frozen ", e.name, " got a gradient");
      COSHARD_CO_TRY(opt->step(*ctx, kLr));
      if (!model->enabled) {
        ++branch_missed;
        std::size_t i = 0;
        for (const Tensor& t : {g.master, g.state1, g.state2}) {
          std::vector<float> part(kept[i].begin() + begin, kept[i].begin() + end);
          ++i;
          COSHARD_CO_TRY(ctx->copy_from_host(t.slice(begin, Shape{end - begin}), std::as_bytes(std::span(part))));
        }
      }
      COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx->read(value));
      run.losses.push_back(host[0]);
    }
    COSHARD_CO_TRY_ASSIGN(auto final, co_await ctx->read(store.values()));
    run.final = values_of(final, store);
    co_return Result<void>{};
  }());
  EXPECT_TRUE(done) << done.error().message();
  (void)(*stream).synchronize();
  return run;
}

struct Case {
  int world = 1;
  int stage = 3;
  int micro_batches = 1;
  OffloadTarget optimizer = OffloadTarget::none;
  OffloadTarget params = OffloadTarget::none;
  bool step_in_backward = false;
  std::size_t coalesce = 0;  // module_granularity_bytes
  std::string name() const {
    return "world " + std::to_string(world) + ", stage " + std::to_string(stage) + ", " +
           std::to_string(micro_batches) + " micro-batches, optimizer " + std::string(to_string(optimizer)) +
           ", parameters " + std::string(to_string(params)) + (step_in_backward ? ", step in backward" : "") +
           (coalesce ? ", module_granularity_bytes " + std::to_string(coalesce) : "");
  }
};

// The same model through the engine, in a loop of the test's own; rank 0's losses and the
// gathered parameters. resume_at >= 0: after that many steps every rank saves a checkpoint, drops
// its model, optimizer and engine, builds them anew and loads it (the rest of the run resumed).
// `resumed_as`: the model of the resumed part, when not `sem`.
// `across` (a checkpoint moving between layouts): save_to saves after `at` steps and ends the run
// there; load_from starts the run at step `at` from the checkpoint there.
struct Across {
  int at = -1;
  std::filesystem::path save_to, load_from;
};
Result<RunResult> sharded(const Semantics& sem, const Case& k, float clip, int resume_at = -1,
                          const Semantics* resumed_as = nullptr, const Across& across = {}) {
  // One folder per test: ctest runs the tests of this file side by side.
  const auto swap = std::filesystem::current_path() / "training_semantics_scratch" /
                    ::testing::UnitTest::GetInstance()->current_test_info()->name();
  std::filesystem::remove_all(swap);
  RunResult run;
  const auto errors = ::coshard::testing::on_ranks(k.world, [&](int r, collectives::Communicator& comm)
                                                                -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    auto checkpoints = swap / "checkpoints";
    COSHARD_CO_TRY_ASSIGN(auto model, Model::make(sem));
    COSHARD_CO_TRY_ASSIGN(auto opt, make_optimizer(sem, clip));
    EngineOptions o;
    o.zero_stage = k.stage;
    o.max_live_bytes = 8 << 10;  // stage 3: fewer units at once than the model has
    o.offload_optimizer = k.optimizer;
    o.offload_params = k.params;
    o.step_in_backward = k.step_in_backward;
    o.offload_optimizer.nvme_path = swap / ("rank" + std::to_string(r));
    // The undeclared case: units [fc1, twice.inner] and [fc2], so the reused Linear's unit closes
    // after its first use (fc1 896 bytes, twice.inner 4,224, fc2 264).
    if (sem.reuse == Reuse::undeclared_layer) o.module_granularity_bytes = 5000;
    if (k.coalesce) o.module_granularity_bytes = k.coalesce;
    COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(ctx, comm, *model->net, *opt, o));
    COSHARD_CO_TRY(co_await engine->initialize(7));
    modules::MeanSquaredErrorLoss loss;
    const std::int64_t rows = kMlpRows / k.world / k.micro_batches;
    if (!across.load_from.empty()) COSHARD_CO_TRY(co_await engine->load_checkpoint(across.load_from));
    for (int step = across.load_from.empty() ? 0 : across.at; step < kSteps; ++step) {
      if (step == across.at && !across.save_to.empty()) {
        COSHARD_CO_TRY(co_await engine->save_checkpoint(across.save_to));
        COSHARD_CO_TRY(co_await engine->finish_checkpoint());
        break;
      }
      if (step == resume_at) {
        COSHARD_CO_TRY(co_await engine->save_checkpoint(checkpoints));
        COSHARD_CO_TRY(co_await engine->finish_checkpoint());
        engine.reset();
        COSHARD_CO_TRY_ASSIGN(model, Model::make(resumed_as ? *resumed_as : sem));
        COSHARD_CO_TRY_ASSIGN(opt, make_optimizer(resumed_as ? *resumed_as : sem, clip));
        COSHARD_CO_TRY_ASSIGN(engine, Engine::create(ctx, comm, *model->net, *opt, o));
        COSHARD_CO_TRY(co_await engine->load_checkpoint(checkpoints));
      }
      model->enabled = sem.branch == BranchRuns::on_rank_one ? r == 1 : branch_runs(step, sem.branch);
      COSHARD_CO_TRY(co_await engine->begin_step(k.micro_batches, kLr));
      for (int m = 0; m < k.micro_batches; ++m) {
        COSHARD_CO_TRY_ASSIGN(auto mb, ::coshard::testing::regression_rows(ctx, step, (r * k.micro_batches + m) * rows, rows));
        COSHARD_CO_TRY_ASSIGN(Tensor out, co_await ctx.forward(*model->net, mb.inputs));
        loss.set_targets(mb.targets);
        COSHARD_CO_TRY_ASSIGN(Tensor value, co_await ctx.forward(loss, out));
        COSHARD_CO_TRY_ASSIGN(Tensor dout, co_await ctx.backward(loss, engine->backward_seed()));
        COSHARD_CO_TRY(co_await ctx.backward(*model->net, dout));
        COSHARD_CO_TRY(engine->add_loss(value));
      }
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await engine->finish_step());
      if (r == 0) run.losses.push_back(stats.loss);
      if (r == 0) run.reduced_bytes = stats.reduce_scattered_bytes;
    }
    COSHARD_CO_TRY_ASSIGN(auto gathered, co_await engine->gather_parameters());
    if (r == 0)
      for (const auto& p : gathered) {
        std::vector<float> v(p.bytes.size() / sizeof(float));
        std::memcpy(v.data(), p.bytes.data(), p.bytes.size());
        run.final[p.name] = std::move(v);
      }
    COSHARD_CO_TRY(stream.synchronize());
    if (r == 0) {
      run.device_peak_bytes = allocator->stats().peak_requested_bytes;
      run.groups = opt->groups();
    }
    engine.reset();
    COSHARD_CO_TRY(stream.synchronize());
    co_return Result<void>{};
  });
  std::filesystem::remove_all(swap);
  if (!errors.empty()) return fail(ErrorCode::internal, errors.front());
  return run;
}

std::vector<Case> all_cases() {
  std::vector<Case> cases;
  for (int stage = 0; stage <= 3; ++stage)
    for (int world = 1; world <= 3; ++world) cases.push_back({world, stage, world == 2 ? 2 : 1});
  cases.push_back({3, 2, 1, OffloadTarget::cpu});
  cases.push_back({2, 3, 2, OffloadTarget::cpu, OffloadTarget::cpu});
  cases.push_back({3, 3, 1, OffloadTarget::nvme, OffloadTarget::nvme});
  cases.push_back({2, 2, 1, OffloadTarget::cpu, OffloadTarget::none, true});
  cases.push_back({3, 3, 1, OffloadTarget::nvme, OffloadTarget::none, true});
  return cases;
}

// Every case against the reference: losses and final parameters within 1e-6 relative (the same
// bits on one rank with one micro-batch), and `untouched` parameters bit for bit their values
// at the start.
void expect_matches(const Semantics& sem, float clip, const std::vector<std::string>& untouched,
                    const std::vector<Case>& cases) {
  const RunResult ref = reference(sem, clip);
  ASSERT_EQ(ref.losses.size(), static_cast<std::size_t>(kSteps));
  EXPECT_LT(ref.losses.back(), 0.8 * ref.losses.front()) << "the reference learns";
  for (const auto& name : untouched) {
    ASSERT_TRUE(ref.final.contains(name)) << name;
    EXPECT_EQ(ref.final.at(name), ref.initial.at(name)) << name << " moved in the reference";
  }
  for (const Case& k : cases) {
    if (k.step_in_backward && clip != 0.0f) continue;  // (refused: clipping needs the whole backward)
    SCOPED_TRACE(k.name());
    auto run = sharded(sem, k, clip);
    ASSERT_TRUE(run) << run.error().message();
    // (clipping's norm is summed in another order per unit: its factor may differ in the last bit)
    const bool exact = k.world == 1 && k.micro_batches == 1 && clip == 0.0f;
    ASSERT_EQ(run->losses.size(), ref.losses.size());
    for (std::size_t i = 0; i < ref.losses.size(); ++i) {
      if (exact) EXPECT_EQ(run->losses[i], ref.losses[i]) << "step " << i;
      else EXPECT_NEAR(run->losses[i], ref.losses[i], 1e-6 * std::abs(ref.losses[i])) << "step " << i;
    }
    ASSERT_EQ(run->final.size(), ref.final.size());
    for (const auto& [name, want] : ref.final) {
      const auto& got = run->final.at(name);
      ASSERT_EQ(got.size(), want.size()) << name;
      const bool bitwise = exact || std::find(untouched.begin(), untouched.end(), name) != untouched.end();
      for (std::size_t i = 0; i < want.size(); ++i) {
        if (bitwise) {
          ASSERT_EQ(got[i], want[i]) << name << "[" << i << "]";
        } else {
          ASSERT_NEAR(got[i], want[i], 1e-6 * std::max(1.0f, std::abs(want[i]))) << name << "[" << i << "]";
        }
      }
    }
  }
}

// Each case saved after step 3 and resumed from it (model, optimizer and engine built anew) gives
// the bits of the run that never stopped.
void expect_resumes_exactly(const Semantics& sem, const std::vector<Case>& cases) {
  for (const Case& k : cases) {
    SCOPED_TRACE(k.name());
    auto straight = sharded(sem, k, 0.0f);
    auto resumed = sharded(sem, k, 0.0f, 3);
    ASSERT_TRUE(straight) << straight.error().message();
    ASSERT_TRUE(resumed) << resumed.error().message();
    EXPECT_EQ(resumed->losses, straight->losses);
    EXPECT_EQ(resumed->final, straight->final);
  }
}

TEST(FrozenParameters, KeepTheirInitialBitsAndTheRestTrainsAsUnsharded) {
  // fc1 whole (a unit of frozen parameters only) and fc2.bias (frozen beside a weight that trains).
  Semantics sem{.frozen = {"fc1.*", "fc2.bias"}};
  expect_matches(sem, 0.0f, {"fc1.weight", "fc1.bias", "fc2.bias"}, all_cases());
}

TEST(FrozenParameters, WithClippingTheNormCountsOnlyWhatTrains) {
  Semantics sem{.frozen = {"fc1.weight", "branch.inner.bias"}};
  expect_matches(sem, 0.05f, {"fc1.weight", "branch.inner.bias"},
                 {{1, 3}, {3, 2}, {2, 3, 2}, {3, 3, 1, OffloadTarget::cpu, OffloadTarget::cpu}});
}

TEST(ParameterGroups, DecayAndLearningRatePerGroupMatchTheUnshardedModel) {
  Semantics sem{.groups = true};
  expect_matches(sem, 0.0f, {}, all_cases());
}

TEST(UnusedParameters, ABranchThatNeverRunsIsLeftUntouched) {
  Semantics sem{.groups = true, .branch = BranchRuns::never};
  expect_matches(sem, 0.0f, {"branch.inner.weight", "branch.inner.bias"}, all_cases());
}

TEST(UnusedParameters, ABranchSkippedInSomeStepsIsLeftAsItWasThere) {
  Semantics sem{.frozen = {"fc2.bias"}, .branch = BranchRuns::some_steps};
  expect_matches(sem, 0.05f, {"fc2.bias"}, all_cases());
}

// #48 item 1: the branch's Linear coalesced with its neighbours (module_granularity_bytes, a
// performance setting): units [fc1, branch.inner] + [fc2] (the skipped module is its unit's last)
// and [fc1, branch.inner, fc2] (in its middle). Untouched when unused holds per parameter, not per
// unit: the skipped Linear keeps its values and moments while the rest of its unit steps, at every
// stage, world size and offload, with accumulation and stepping in backward.
std::vector<Case> coalesced_cases() {
  std::vector<Case> cases;
  for (const std::size_t bytes : {5000u, 8000u})
    for (Case k : all_cases()) {
      k.coalesce = bytes;
      cases.push_back(k);
    }
  return cases;
}

TEST(UnusedParameters, AModuleSkippedInsideACoalescedUnitIsLeftAsItWasThere) {
  expect_matches({.frozen = {"fc2.bias"}, .branch = BranchRuns::some_steps}, 0.0f, {"fc2.bias"}, coalesced_cases());
  expect_matches({.groups = true, .branch = BranchRuns::never}, 0.0f, {"branch.inner.weight", "branch.inner.bias"},
                 coalesced_cases());
}

TEST(UnusedParameters, AModuleSkippedInsideACoalescedUnitWithClippingCountsOnlyWhatRan) {
  expect_matches({.branch = BranchRuns::some_steps}, 0.05f, {},
                 {{1, 3, 1, {}, {}, false, 5000}, {3, 2, 1, {}, {}, false, 8000}, {2, 3, 2, {}, {}, false, 5000},
                  {2, 1, 1, OffloadTarget::cpu, {}, false, 8000}});
}

// #48 item 2: each parameter's own step count (the branch missed step 2 before the checkpoint at
// step 3) is saved and resumed: the same bits as the run that never stopped, and across layouts
// the unsharded model's numbers; the branch coalesced with its neighbours too.
TEST(UnusedParameters, AResumeKeepsEachParametersOwnStepCount) {
  const Semantics sem{.branch = BranchRuns::some_steps};
  expect_resumes_exactly(sem, {Case{2, 3}, Case{3, 2, 1, OffloadTarget::cpu},
                               Case{2, 3, 1, OffloadTarget::nvme, OffloadTarget::nvme}, Case{2, 1, 2, {}, {}, false, 8000}});
  const RunResult ref = reference(sem, 0.0f);
  const auto dir = std::filesystem::current_path() / "training_semantics_scratch" / "steps_missed_checkpoint";
  std::filesystem::remove_all(dir);
  auto saved = sharded(sem, {2, 3, 1, {}, {}, false, 5000}, 0.0f, -1, nullptr, {.at = 3, .save_to = dir});
  ASSERT_TRUE(saved) << saved.error().message();
  auto resumed = sharded(sem, {3, 1, 1, {}, {}, false, 5000}, 0.0f, -1, nullptr, {.at = 3, .load_from = dir});
  ASSERT_TRUE(resumed) << resumed.error().message();
  ASSERT_EQ(resumed->losses.size(), 3u);
  for (int i = 0; i < 3; ++i) EXPECT_NEAR(resumed->losses[i], ref.losses[3 + i], 1e-6 * ref.losses[3 + i]) << 3 + i;
  for (const auto& [name, want] : ref.final)
    for (std::size_t i = 0; i < want.size(); ++i)
      ASSERT_NEAR(resumed->final.at(name)[i], want[i], 1e-6 * std::max(1.0f, std::abs(want[i]))) << name << "[" << i << "]";
  std::filesystem::remove_all(dir);
}

// Inside a coalesced unit a rank-dependent branch is allowed at every stage (the unit is reduced
// on every rank either way): a module one rank used trains, one no rank used does not (the ranks
// agree through one all-reduce of a flag per module).
TEST(UnusedParameters, InsideACoalescedUnitABranchRunOnOneRankTrainsAndOneRunOnNoneDoesNot) {
  const RunResult ref = reference({.branch = BranchRuns::never}, 0.0f);
  for (const int stage : {0, 1, 2, 3})
    for (const std::size_t bytes : {5000u, 8000u}) {
      SCOPED_TRACE("stage " + std::to_string(stage) + ", module_granularity_bytes " + std::to_string(bytes));
      auto one = sharded({.branch = BranchRuns::on_rank_one}, {2, stage, 1, {}, {}, false, bytes}, 0.0f);
      ASSERT_TRUE(one) << one.error().message();
      EXPECT_NE(one->final.at("branch.inner.weight"), ref.initial.at("branch.inner.weight"));
      auto none = sharded({.branch = BranchRuns::never}, {3, stage, 1, {}, {}, false, bytes}, 0.0f);
      ASSERT_TRUE(none) << none.error().message();
      EXPECT_EQ(none->final.at("branch.inner.weight"), ref.initial.at("branch.inner.weight"));
      EXPECT_EQ(none->final.at("branch.inner.bias"), ref.initial.at("branch.inner.bias"));
    }
}

// Stage 1 allows a rank-dependent branch (it reduces every unit after backward): a unit that one
// rank used is stepped with the reduced gradient on every rank; one that no rank used is not (the
// ranks agree on which through one all-reduce of a flag per unit).
TEST(UnusedParameters, AtStageOneABranchRunOnOneRankTrainsAndOneRunOnNoneDoesNot) {
  const RunResult ref = reference({.branch = BranchRuns::never}, 0.0f);
  for (const int world : {2, 3}) {
    SCOPED_TRACE("world " + std::to_string(world));
    auto one = sharded({.branch = BranchRuns::on_rank_one}, {world, 1}, 0.0f);
    ASSERT_TRUE(one) << one.error().message();
    EXPECT_NE(one->final.at("branch.inner.weight"), ref.initial.at("branch.inner.weight"));
    auto none = sharded({.branch = BranchRuns::never}, {world, 1}, 0.0f);
    ASSERT_TRUE(none) << none.error().message();
    EXPECT_EQ(none->final.at("branch.inner.weight"), ref.initial.at("branch.inner.weight"));
    EXPECT_EQ(none->final.at("branch.inner.bias"), ref.initial.at("branch.inner.bias"));
  }
}

// #32 item 6: a rank-dependent branch where it is not allowed (stages 0, 2, 3: the branch's unit
// is gathered or reduced on one rank only) fails on every rank, naming what each rank's
// collective was for, so the module and the ranks are named, not only the sizes; no hang.
TEST(UnusedParameters, ARankDependentBranchIsNamedByItsUnitAndTheRanks) {
  for (const int stage : {0, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto run = sharded({.branch = BranchRuns::on_rank_one}, {2, stage}, 0.0f);
    ASSERT_FALSE(run);
    const std::string& m = run.error().message();
    EXPECT_NE(m.find("collective sequence mismatch: rank 0 launched group #"), std::string::npos) << m;
    EXPECT_NE(m.find("but rank 1 launched group #"), std::string::npos) << m;
    EXPECT_NE(m.find("of unit branch.inner"), std::string::npos) << m;
  }
}

// #32 item 4: one instance run twice in a pass (a layer, a block, a checkpointed block) gives the
// unsharded model's numbers at every stage, world size, offload and with accumulation: each use's
// backward has its own forward's activations, and the gradient is the sum over the uses.
TEST(ModulesRunTwice, ALayerUsedTwiceTrainsAsUnsharded) {
  expect_matches({.reuse = Reuse::layer}, 0.0f, {}, all_cases());
}

TEST(ModulesRunTwice, ABlockAppliedTwiceTrainsAsUnshardedCheckpointedOrNot) {
  expect_matches({.reuse = Reuse::block}, 0.0f, {}, all_cases());
  expect_matches({.reuse = Reuse::checkpointed_block}, 0.0f, {},
                 {{1, 3}, {2, 0}, {3, 2}, {2, 3, 2}, {3, 3, 1, OffloadTarget::cpu, OffloadTarget::cpu}});
}

// Undeclared, and sharing a unit with its neighbours: at stages 0-2 the parameters stay bound,
// and the second use's gradient is added into the same buffer before the unit is reduced (the
// unsharded numbers); at stage 3 the unit is released after the first use, and the second is
// named (never a wrong number).
TEST(ModulesRunTwice, AnUndeclaredSecondUseTrainsWhereItCanAndIsNamedWhereItCannot) {
  std::vector<Case> cases;
  for (const Case& k : all_cases())
    if (k.stage < 3) cases.push_back(k);
  expect_matches({.reuse = Reuse::undeclared_layer}, 0.0f, {}, cases);
  for (const int world : {1, 2}) {
    SCOPED_TRACE("stage 3, world " + std::to_string(world));
    auto run = sharded({.reuse = Reuse::undeclared_layer}, {world, 3}, 0.0f);
    ASSERT_FALSE(run);
    const std::string& m = run.error().message();
    EXPECT_NE(m.find("module 'twice.inner' (Linear) ran while its unit fc1 was not gathered"), std::string::npos) << m;
    EXPECT_NE(m.find("set_runs_more_than_once_per_pass()"), std::string::npos) << m;
  }
}

// A unit of frozen parameters only has no gradient to reduce: its collective is not issued.
TEST(FrozenParameters, AWhollyFrozenUnitIsNotReduced) {
  for (const int stage : {0, 1, 2, 3}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto all = sharded({}, {2, stage}, 0.0f);
    auto frozen = sharded({.frozen = {"fc1.*"}}, {2, stage}, 0.0f);
    ASSERT_TRUE(all && frozen);
    const std::uint64_t fc1_bytes = (6 * kMlpHidden + kMlpHidden) * sizeof(float);  // even: no padding at 2 ranks
    EXPECT_EQ(all->reduced_bytes - frozen->reduced_bytes, fc1_bytes);
  }
}

// A unit of frozen parameters only holds its parameters: no gradient (shard or whole), no fp32
// master, no optimizer state, on the device or offloaded; the device's peak falls by at least
// what those would take, the estimate by exactly that, and the optimizer's group holds nothing.
TEST(FrozenParameters, AWhollyFrozenUnitHoldsNoGradientMasterOrOptimizerState) {
  const std::size_t fc1_elements = 6 * kMlpHidden + kMlpHidden;  // 224: 112 a rank at 2 ranks
  for (const Case& k : {Case{2, 0}, Case{2, 1}, Case{2, 2}, Case{2, 3}, Case{2, 3, 1, OffloadTarget::cpu},
                        Case{2, 3, 1, OffloadTarget::cpu, OffloadTarget::cpu},
                        Case{2, 3, 1, OffloadTarget::nvme, OffloadTarget::nvme}}) {
    SCOPED_TRACE(k.name());
    auto all = sharded({}, k, 0.0f);
    auto frozen = sharded({.frozen = {"fc1.*"}}, k, 0.0f);
    ASSERT_TRUE(all) << all.error().message();
    ASSERT_TRUE(frozen) << frozen.error().message();
    // fc1 is the first unit: its group is frozen and holds no tensor; the others are as before.
    ASSERT_EQ(frozen->groups.size(), all->groups.size());
    const auto& g = frozen->groups.front();
    EXPECT_TRUE(g.frozen);
    EXPECT_FALSE(g.grads || g.master || g.state1 || g.state2);
    for (std::size_t i = 1; i < frozen->groups.size(); ++i) EXPECT_FALSE(frozen->groups[i].frozen);
    const std::size_t shard = (k.stage == 0 ? fc1_elements : fc1_elements / 2) * sizeof(float);
    // On the device: its gradient shard (f32) and its two moments, with the optimizer there.
    // (Offloaded, a gradient shard is on the device only from its reduction until it is out, a
    // few at a time: freezing a unit lowers the peak by none of them for certain.)
    const std::size_t saved = k.optimizer == OffloadTarget::none ? shard * 3 : 0;
    // (at stage 3 the frozen unit may stay gathered for the rest of the step, whole, within
    // max_live_bytes: EngineOptions::keep_frozen_gathered; the host allocator's 256-byte blocks)
    const std::size_t kept = k.stage == 3 ? (fc1_elements * sizeof(float) + 255) / 256 * 256 : 0;
    EXPECT_GE(all->device_peak_bytes + kept, frozen->device_peak_bytes + saved)
        << all->device_peak_bytes << " bytes at the peak trained, " << frozen->device_peak_bytes << " frozen";

    // The estimate: the same saving, line by line (and a note that says so).
    for (const DataType dtype : {DataType::f32, DataType::bf16}) {
      EngineOptions o;
      o.zero_stage = k.stage;
      o.dtype = dtype;
      o.max_live_bytes = 8 << 10;
      o.offload_optimizer = k.optimizer;
      o.offload_params = k.params;
      auto trained = Model::make({});
      auto half = Model::make({.frozen = {"fc1.*"}});
      ASSERT_TRUE(trained && half);
      auto e_all = estimate_engine_memory(*(*trained)->net, 2, o, 2);
      auto e_frozen = estimate_engine_memory(*(*half)->net, 2, o, 2);
      ASSERT_TRUE(e_all && e_frozen);
      const std::size_t total_all = e_all->bytes(MemoryPlace::device) + e_all->bytes(MemoryPlace::pageable_host) +
                                    e_all->bytes(MemoryPlace::pinned_host) + e_all->bytes(MemoryPlace::nvme);
      const std::size_t total_frozen = e_frozen->bytes(MemoryPlace::device) + e_frozen->bytes(MemoryPlace::pageable_host) +
                                       e_frozen->bytes(MemoryPlace::pinned_host) + e_frozen->bytes(MemoryPlace::nvme);
      // gradient shard + moments (+ the master apart from bf16 parameters) leave; nvme keeps the
      // frozen unit's master in its file, and its largest swap group may be another unit's.
      EXPECT_GT(total_all, total_frozen) << e_all->describe() << e_frozen->describe();
      if (k.optimizer == OffloadTarget::none) {
        const std::size_t per = shard * (2 + (dtype == DataType::bf16 ? 1 : 0));  // moments (+ master)
        const std::size_t grads = k.stage == 1 ? fc1_elements * size_of(dtype) : shard;  // (stage 1: whole)
        EXPECT_GE(e_all->bytes(MemoryPlace::device) - e_frozen->bytes(MemoryPlace::device), per + grads)
            << e_all->describe() << e_frozen->describe();
      }
      EXPECT_NE(e_frozen->describe().find("frozen:"), std::string::npos) << e_frozen->describe();
      EXPECT_EQ(e_all->describe().find("frozen:"), std::string::npos);
    }
  }
}

// A checkpoint keeps a frozen unit's parameters only, and a run resumed from it continues as
// the run that never stopped, on the device and offloaded to cpu and nvme (bf16 too).
TEST(FrozenParameters, ACheckpointKeepsTheFrozenUnitsParametersAndResumesExactly) {
  expect_resumes_exactly({.frozen = {"fc1.*", "fc2.bias"}},
                         {Case{2, 2}, Case{3, 3}, Case{2, 3, 1, OffloadTarget::cpu, OffloadTarget::cpu},
                          Case{2, 3, 1, OffloadTarget::nvme, OffloadTarget::nvme}, Case{2, 1, 2, OffloadTarget::nvme}});
}

// #48 item 7: a unit frozen in part (fc1.weight frozen, fc1.bias trained) has a block that is
// frozen throughout on some ranks (rank 0's of 2: elements [0, 112) of fc1.weight). Every block of
// the unit still has its master and state, so a checkpoint saves (it crashed on the missing ones)
// and moves to another layout: saved at one world size, stage and offload, resumed at another, the
// run goes on as the unsharded model does, and the frozen weight keeps its initial bits.
TEST(FrozenParameters, ACheckpointOfAUnitFrozenInPartSavesAndMovesBetweenLayouts) {
  const Semantics sem{.frozen = {"fc1.weight"}};
  const RunResult ref = reference(sem, 0.0f);
  const auto dir = std::filesystem::current_path() / "training_semantics_scratch" / "partly_frozen_checkpoint";
  const std::vector<std::pair<Case, Case>> moves{
      {{2, 1}, {3, 3}},
      {{2, 2, 2}, {1, 3}},
      {{3, 3}, {2, 1, 1, OffloadTarget::cpu}},
      {{2, 3, 1, OffloadTarget::cpu, OffloadTarget::cpu}, {3, 2}},
      {{2, 3, 1, OffloadTarget::nvme, OffloadTarget::nvme}, {2, 3, 1, OffloadTarget::cpu}},
      {{1, 3, 1, OffloadTarget::nvme}, {2, 2}},
  };
  for (const auto& [from, to] : moves) {
    SCOPED_TRACE(from.name() + " -> " + to.name());
    std::filesystem::remove_all(dir);
    auto saved = sharded(sem, from, 0.0f, -1, nullptr, {.at = 3, .save_to = dir});
    ASSERT_TRUE(saved) << saved.error().message();
    ASSERT_EQ(saved->losses.size(), 3u);
    auto resumed = sharded(sem, to, 0.0f, -1, nullptr, {.at = 3, .load_from = dir});
    ASSERT_TRUE(resumed) << resumed.error().message();
    ASSERT_EQ(resumed->losses.size(), static_cast<std::size_t>(kSteps - 3));
    for (int i = 0; i < 3; ++i) {
      EXPECT_NEAR(saved->losses[i], ref.losses[i], 1e-6 * ref.losses[i]) << "step " << i;
      EXPECT_NEAR(resumed->losses[i], ref.losses[3 + i], 1e-6 * ref.losses[3 + i]) << "step " << 3 + i;
    }
    EXPECT_EQ(resumed->final.at("fc1.weight"), ref.initial.at("fc1.weight"));
    for (std::size_t i = 0; i < ref.final.at("fc1.bias").size(); ++i)
      EXPECT_NEAR(resumed->final.at("fc1.bias")[i], ref.final.at("fc1.bias")[i], 1e-6) << i;
  }
  std::filesystem::remove_all(dir);
}

// A unit saved frozen has no optimizer state to resume a run that trains it: refused by name. The
// other way (a unit saved trained, resumed frozen) loads its parameters and leaves them be.
TEST(FrozenParameters, ResumingAUnitSavedFrozenAsTrainedIsRefusedByName) {
  const Semantics frozen{.frozen = {"fc1.*"}}, trained{};
  const Case k{2, 3};
  auto refused = sharded(frozen, k, 0.0f, 3, &trained);
  ASSERT_FALSE(refused);
  EXPECT_NE(refused.error().message().find("unit fc1 was frozen when saved"), std::string::npos)
      << refused.error().message();
  auto later = sharded(trained, k, 0.0f, 3, &frozen);
  ASSERT_TRUE(later) << later.error().message();
  auto straight = sharded(trained, k, 0.0f);
  ASSERT_TRUE(straight);
  // The same first three steps; then fc1 stays where the trained run had it (not 6 steps' worth).
  ASSERT_EQ(later->losses.size(), straight->losses.size());
  for (std::size_t i = 0; i < 3; ++i) EXPECT_EQ(later->losses[i], straight->losses[i]) << "step " << i;
  EXPECT_NE(later->final.at("fc1.weight"), straight->final.at("fc1.weight"));
}

// A layer of one's own that reads another module's weight, declared with use_parameters_of:
// the unsharded numbers at every stage (world size 3: an uneven split of fc1's 224 elements).
TEST(SharedParameters, ADeclaredReadOfAnotherModulesWeightTrainsAsUnsharded) {
  expect_matches({.tie = Tie::declared}, 0.0f, {}, all_cases());
}

// Undeclared, the reader's gradient would be lost at stages 0 and 2 (stage 1 keeps every
// gradient bound; stage 3 cannot read the weight at all): the step is refused, naming it.
TEST(SharedParameters, AnUndeclaredReadIsRefusedNamingTheParameter) {
  for (const int stage : {0, 2}) {
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto run = sharded({.tie = Tie::undeclared}, {2, stage}, 0.0f);
    ASSERT_FALSE(run);
    EXPECT_NE(run.error().message().find("the gradient of fc1.weight (unit fc1) was asked for while none was bound"),
              std::string::npos)
        << run.error().message();
  }
  // Stage 3: fc1's unit is released when the readout runs (its values are empty): the failure
  // names the reader, the parameter, its unit and its owner, before the op's own message.
  for (const int world : {1, 2}) {
    SCOPED_TRACE("stage 3, world " + std::to_string(world));
    auto run = sharded({.tie = Tie::undeclared}, {world, 3}, 0.0f);
    ASSERT_FALSE(run);
    EXPECT_NE(run.error().message().find("module 'readout' (TiedReadout) read fc1.weight (unit fc1, owned by module "
                                         "'fc1') while it was not gathered"),
              std::string::npos)
        << run.error().message();
    EXPECT_NE(run.error().message().find("use_parameters_of"), std::string::npos) << run.error().message();
    const auto first = run.error().message().find("module 'readout' (TiedReadout) read");
    EXPECT_EQ(run.error().message().find("module 'readout' (TiedReadout) read", first + 1), std::string::npos)
        << "named once, by the module that failed: " << run.error().message();
  }
  const RunResult ref = reference({.tie = Tie::undeclared}, 0.0f);
  auto stage1 = sharded({.tie = Tie::undeclared}, {2, 1}, 0.0f);
  ASSERT_TRUE(stage1) << stage1.error().message();
  for (std::size_t i = 0; i < ref.losses.size(); ++i)
    EXPECT_NEAR(stage1->losses[i], ref.losses[i], 1e-6 * std::abs(ref.losses[i]));
}

// #48 item 14: the same read with a backward that writes grad() unguarded failed with the op's
// own "out is empty", naming nothing: the engine names the module, the parameter and the fix.
TEST(SharedParameters, AnUndeclaredReadWritingItsGradientUnguardedIsNamed) {
  for (const int stage : {0, 2}) {  // (stage 1 keeps every gradient bound through the step: it trains)
    SCOPED_TRACE("stage " + std::to_string(stage));
    auto run = sharded({.tie = Tie::undeclared_unguarded}, {2, stage}, 0.0f);
    ASSERT_FALSE(run);
    EXPECT_NE(run.error().message().find("module 'readout' (TiedReadout) asked for the gradient of fc1.weight (unit "
                                         "fc1, owned by module 'fc1') while none was bound"),
              std::string::npos)
        << run.error().message();
    EXPECT_NE(run.error().message().find("use_parameters_of"), std::string::npos) << run.error().message();
  }
}

TEST(SharedParameters, MisdeclaredUsesAreRefusedByName) {
  modules::Linear a(2, 2), b(2, 2);
  modules::Gelu g;
  EXPECT_FALSE(a.use_parameters_of(a));
  auto none = a.use_parameters_of(g);
  ASSERT_FALSE(none);
  EXPECT_NE(none.error().message().find("has no parameters of its own"), std::string::npos);
  EXPECT_TRUE(a.use_parameters_of(b));
  EXPECT_FALSE(a.use_parameters_of(b));
  // An owner outside the model.
  const auto errors = ::coshard::testing::on_ranks(1, [&](int, collectives::Communicator& comm)
                                                         -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    modules::Sequential model;
    auto& inner = model.add("inner", std::make_unique<modules::Linear>(2, 2));
    modules::Linear outside(2, 2);
    COSHARD_CO_TRY(inner.use_parameters_of(outside));
    COSHARD_CO_TRY_ASSIGN(auto opt, Optimizer::adamw({}));
    auto engine = Engine::create(ctx, comm, model, *opt, {.zero_stage = 3});
    if (engine) co_return fail(ErrorCode::internal, "an owner outside the model was accepted");
    if (engine.error().message().find("module inner (Linear) uses the parameters of a Linear that is not part of the model") ==
        std::string::npos)
      co_return fail(ErrorCode::internal, "unexpected: ", engine.error().message());
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

TEST(FrozenParameters, AGlobThatMatchesNothingIsRefusedByName) {
  auto model = Model::make({});
  ASSERT_TRUE(model);
  auto r = (*model)->net->set_trainable_matching("encoder.*", false);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("'encoder.*' matches no parameter"), std::string::npos) << r.error().message();
  // (and shows this model's own names, not another model's)
  EXPECT_NE(r.error().message().find("fc1.weight, fc1.bias, branch.inner.weight, ..."), std::string::npos)
      << r.error().message();
}

TEST(FrozenParameters, FreezingABoundParameterIsRefused) {
  async::Runtime rt;
  auto stream = async::Stream::create(async::Device::cpu());
  auto allocator = async::CachingAllocator::create(async::Device::cpu());
  auto ctx = Context::create(*stream, **allocator);
  auto model = Model::make({});
  ASSERT_TRUE(model);
  auto store = modules::ParameterStore::create(*ctx, *(*model)->net, DataType::f32);
  ASSERT_TRUE(store);
  auto r = (*model)->net->set_trainable(false);
  ASSERT_FALSE(r);
  EXPECT_NE(r.error().message().find("while bound"), std::string::npos) << r.error().message();
  // #48 item 14: named by its full name in the model, not its own ("weight").
  EXPECT_NE(r.error().message().find("parameter fc1.weight: set_trainable(false)"), std::string::npos) << r.error().message();
  auto matched = (*model)->net->set_trainable_matching("fc2.*", false);
  ASSERT_FALSE(matched);
  EXPECT_NE(matched.error().message().find("parameter fc2.weight: set_trainable(false)"), std::string::npos)
      << matched.error().message();
}

TEST(FrozenParameters, FreezingAfterTheEngineWasBuiltIsRefusedAtTheNextStep) {
  const auto errors = ::coshard::testing::on_ranks(1, [&](int, collectives::Communicator& comm)
                                                         -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto allocator, async::CachingAllocator::create(async::Device::cpu()));
    COSHARD_CO_TRY_ASSIGN(auto ctx, Context::create(stream, *allocator));
    COSHARD_CO_TRY_ASSIGN(auto model, Model::make({}));
    COSHARD_CO_TRY_ASSIGN(auto opt, make_optimizer({}, 0.0f));
    COSHARD_CO_TRY_ASSIGN(auto engine, Engine::create(ctx, comm, *model->net, *opt, {.zero_stage = 3}));
    COSHARD_CO_TRY(co_await engine->initialize(7));
    // At stage 3 parameters are unbound between uses: the flag can change, and the step refuses.
    COSHARD_CO_TRY(model->net->set_trainable_matching("fc1.weight", false));
    auto begun = co_await engine->begin_step(1, kLr);
    if (begun) co_return fail(ErrorCode::internal, "begin_step accepted a parameter frozen after the engine was built");
    if (begun.error().message().find("fc1.weight was frozen after the engine was built") == std::string::npos)
      co_return fail(ErrorCode::internal, "unexpected message: ", begun.error().message());
    engine.reset();
    COSHARD_CO_TRY(stream.synchronize());
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

TEST(ParameterGroups, BadRulesAreRefusedByName) {
  auto opt = Optimizer::adamw({});
  ASSERT_TRUE(opt);
  auto negative = (*opt)->set_parameter_groups({ParameterGroup::by_name("*.bias", -1.0f)});
  ASSERT_FALSE(negative);
  EXPECT_NE(negative.error().message().find("parameter group '*.bias': weight_decay=-1"), std::string::npos)
      << negative.error().message();
  auto nan_scale = (*opt)->set_parameter_groups({ParameterGroup::by_name("x", std::nullopt, std::nanf(""))});
  ASSERT_FALSE(nan_scale);
  EXPECT_NE(nan_scale.error().message().find("lr_scale=nan"), std::string::npos) << nan_scale.error().message();
  ParameterGroup none;
  none.name = "empty";
  auto no_predicate = (*opt)->set_parameter_groups({none});
  ASSERT_FALSE(no_predicate);
  EXPECT_NE(no_predicate.error().message().find("'empty': no predicate"), std::string::npos);
  ParameterGroup beta = ParameterGroup::by_name("h.*", std::nullopt);
  beta.beta2 = 1.0f;
  auto bad_beta = (*opt)->set_parameter_groups({beta});
  ASSERT_FALSE(bad_beta);
  EXPECT_NE(bad_beta.error().message().find("parameter group 'h.*': beta2=1, expected 0 <= beta < 1"), std::string::npos)
      << bad_beta.error().message();
  ParameterGroup eps = ParameterGroup::by_name("h.*", std::nullopt);
  eps.eps = 0.0f;
  auto bad_eps = (*opt)->set_parameter_groups({eps});
  ASSERT_FALSE(bad_eps);
  EXPECT_NE(bad_eps.error().message().find("eps=0, expected a finite value > 0"), std::string::npos);
  auto sgd = Optimizer::sgd({});
  ASSERT_TRUE(sgd);
  ParameterGroup moments = ParameterGroup::by_name("h.*", std::nullopt);
  moments.beta1 = 0.5f;
  auto sgd_betas = (*sgd)->set_parameter_groups({moments});
  ASSERT_FALSE(sgd_betas);
  EXPECT_NE(sgd_betas.error().message().find("beta1, beta2 and eps are AdamW's settings (this optimizer is SGD)"),
            std::string::npos);
}

TEST(GlobMatches, StarsCrossDotsAndQuestionMarksTakeOneCharacter) {
  EXPECT_TRUE(modules::glob_matches("model.embed_tokens.*", "model.embed_tokens.weight"));
  EXPECT_TRUE(modules::glob_matches("*.bias", "blocks.0.attn.qkv.bias"));
  EXPECT_TRUE(modules::glob_matches("blocks.?.mlp.*", "blocks.3.mlp.fc.weight"));
  EXPECT_FALSE(modules::glob_matches("blocks.?.mlp.*", "blocks.12.mlp.fc.weight"));
  EXPECT_FALSE(modules::glob_matches("*.bias", "blocks.0.attn.qkv.weight"));
  EXPECT_TRUE(modules::glob_matches("*", ""));
  EXPECT_FALSE(modules::glob_matches("a", ""));
  EXPECT_TRUE(modules::glob_matches("a*b*c", "a.x.b.y.c"));
}

}  // namespace
}  // namespace coshard::zero
