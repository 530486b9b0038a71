// The sparse mixture-of-experts block (moe.hpp): route, agree on the experts to run, dispatch,
// run each expert through the hooks, combine; backward in reverse.
#include "coshard/modules/moe.hpp"

#include "coshard/modules/llama_layers.hpp"
#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace {

// The experts, as children "0", "1", ... of one container the block runs one by one.
class ExpertList final : public Module {
 public:
  Module& add(std::string name, std::unique_ptr<Module> m) { return register_child(std::move(name), std::move(m)); }
  std::string_view type_name() const override { return "ExpertList"; }
  async::Task<Result<Tensor>> forward(Context&, Tensor) override {
    co_return fail(ErrorCode::invalid_argument, "ExpertList: its experts run through their SparseMoe");
  }
  async::Task<Result<Tensor>> backward(Context&, Tensor) override {
    co_return fail(ErrorCode::invalid_argument, "ExpertList: its experts run through their SparseMoe");
  }
};

Result<void> check_options(const SparseMoe::Options& o) {
  if (auto ok = detail::check_moe_routing(1, o.experts, o.top_k); !ok)
    return fail(std::move(ok).error().with_context("SparseMoe"));
  if (o.expert_group && (o.expert_group->size() < 1 || o.experts % o.expert_group->size() != 0))
    return fail(ErrorCode::invalid_argument, "SparseMoe: experts=", o.experts, " over an expert group of ",
                o.expert_group->size(), " ranks: expected a number of experts the group's size divides");
  if (o.dim < 1 || o.intermediate < 1)
    return fail(ErrorCode::invalid_argument, "SparseMoe: dim=", o.dim, " intermediate=", o.intermediate,
                ": expected both >= 1");
  return {};
}


}  // namespace

std::unique_ptr<Sequential> make_swiglu_expert(std::int64_t dim, std::int64_t intermediate, Init init) {
  auto expert = std::make_unique<Sequential>();
  expert->add("gate_up", std::make_unique<Linear>(dim, 2 * intermediate, false, init));
  expert->add("swiglu", std::make_unique<SwiGlu>());
  expert->add("down", std::make_unique<Linear>(intermediate, dim, false, init));
  return expert;
}

SparseMoe::SparseMoe(const Options& options, std::shared_ptr<RouterBalance> balance)
    : o_(options), balance_(std::move(balance)) {}

Result<std::unique_ptr<SparseMoe>> SparseMoe::create(const Options& o, std::shared_ptr<RouterBalance> balance) {
  COSHARD_TRY(check_options(o));
  std::vector<std::unique_ptr<Module>> experts;
  const std::int64_t local = o.experts / (o.expert_group ? o.expert_group->size() : 1);
  for (std::int64_t e = 0; e < local; ++e) experts.push_back(make_swiglu_expert(o.dim, o.intermediate, o.init));
  return create(o, std::move(experts), std::move(balance));
}

Result<std::unique_ptr<SparseMoe>> SparseMoe::create(const Options& o, std::vector<std::unique_ptr<Module>> experts,
                                                     std::shared_ptr<RouterBalance> balance) {
  COSHARD_TRY(check_options(o));
  const int group = o.expert_group ? o.expert_group->size() : 1;
  const std::int64_t local = o.experts / group;
  if (static_cast<std::int64_t>(experts.size()) != local)
    return fail(ErrorCode::invalid_argument, "SparseMoe: ", experts.size(), " expert modules for experts=", o.experts,
                group > 1 ? " over an expert group of " + std::to_string(group) + " ranks (expected " + std::to_string(local) + " here)"
                          : std::string());
  if (balance && (balance->experts() != o.experts || balance->top_k() != o.top_k))
    return fail(ErrorCode::invalid_argument, "SparseMoe: a RouterBalance of ", balance->experts(), " experts, top ",
                balance->top_k(), " for a layer of ", o.experts, ", top ", o.top_k);
  std::unique_ptr<SparseMoe> moe(new SparseMoe(o, std::move(balance)));
  if (moe->balance_) moe->layer_index_ = moe->balance_->add_layer_index();
  moe->router_ = &moe->register_child("router", std::make_unique<Linear>(o.dim, o.experts, false, o.init));
  moe->first_local_ = group > 1 ? o.expert_group->rank() * local : 0;
  moe->local_ = local;
  moe->experts_.assign(static_cast<std::size_t>(o.experts), nullptr);
  auto list = std::make_unique<ExpertList>();
  for (std::int64_t j = 0; j < local; ++j) {
    auto& expert = experts[static_cast<std::size_t>(j)];
    const std::int64_t e = moe->first_local_ + j;
    if (!expert) return fail(ErrorCode::invalid_argument, "SparseMoe: expert ", e, " is null");
    if (group > 1) {
      Result<void> marked;
      expert->for_each_parameter([&](const std::string&, Parameter& p) {
        if (auto r = p.set_expert_parallel(group); !r && marked) marked = std::move(r);
      });
      COSHARD_TRY(marked);
    }
    moe->experts_[static_cast<std::size_t>(e)] = &list->add(std::to_string(e), std::move(expert));
  }
  moe->register_child("experts", std::move(list));
  return moe;
}

async::Task<Result<Tensor>> SparseMoe::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(detail::check_activation(ctx, input, o_.dim, "SparseMoe"));
  const DataType dt = input.dtype();
  const std::int64_t N = input.shape().rows(), E = o_.experts, k = o_.top_k, D = o_.dim;
  if (auto ok = detail::check_moe_routing(N, E, k); !ok) co_return fail(std::move(ok).error().with_context("SparseMoe"));
  const auto& kern = ctx.kernels();
  auto& s = ctx.stream();
  COSHARD_CO_TRY_ASSIGN(Tensor logits, co_await ctx.forward(*router_, input));
  Saved saved;
  saved.shape = input.shape();
  COSHARD_CO_TRY_ASSIGN(saved.probs, ctx.empty(Shape{N, E}, DataType::f32));
  COSHARD_CO_TRY_ASSIGN(saved.chosen, ctx.empty(Shape{N, k}, DataType::i32));
  COSHARD_CO_TRY_ASSIGN(saved.weights, ctx.empty(Shape{N, k}, DataType::f32));
  COSHARD_CO_TRY(kern.moe_route(s, dt, logits.data(), N, E, k, o_.renormalize, saved.probs.data_as<float>(),
                                saved.chosen.data_as<std::int32_t>(), saved.weights.data_as<float>()));
  COSHARD_CO_TRY_ASSIGN(Tensor counts, ctx.empty(Shape{E}, DataType::i32));
  COSHARD_CO_TRY_ASSIGN(Tensor order, ctx.empty(Shape{N * k}, DataType::i32));
  COSHARD_CO_TRY_ASSIGN(saved.inverse, ctx.empty(Shape{N * k}, DataType::i32));
  COSHARD_CO_TRY(kern.moe_dispatch_plan(s, saved.chosen.data_as<std::int32_t>(), N * k, E, counts.data_as<std::int32_t>(),
                                        order.data_as<std::int32_t>(), saved.inverse.data_as<std::int32_t>()));
  // The counts reach the host (an awaited copy), then the ranks' union of the experts to run.
  COSHARD_CO_TRY_ASSIGN(const std::vector<double> host_counts, co_await ctx.read(counts));
  std::vector<double> runs(host_counts.size());
  for (std::size_t e = 0; e < runs.size(); ++e) runs[e] = host_counts[e] > 0 || o_.every_expert_runs ? 1.0 : 0.0;
  if (ctx.hooks()) {
    const std::string what = "the experts routed to by SparseMoe layer " + std::to_string(layer_index_);
    COSHARD_CO_TRY(co_await ctx.hooks()->agree_on_union(ctx, runs, what));
  }
  if (balance_ && !ctx.recomputing()) {
    // The probabilities summed over the tokens: ones [1, N] x probs [N, E].
    std::vector<float> ones(static_cast<std::size_t>(N), 1.0f);
    COSHARD_CO_TRY_ASSIGN(Tensor ones_row, ctx.upload(std::as_bytes(std::span<const float>(ones)), Shape{N}, DataType::f32));
    COSHARD_CO_TRY_ASSIGN(Tensor prob_sums, ctx.empty(Shape{E}, DataType::f32));
    const detail::GemmArgs g{.m = 1, .n = E, .k = N, .a = ones_row.data(), .lda = N, .b = saved.probs.data(), .ldb = E,
                             .c = prob_sums.data(), .ldc = E};
    COSHARD_CO_TRY(kern.gemm(s, DataType::f32, g));
    COSHARD_CO_TRY(balance_->add_layer(ctx, layer_index_ == 0, host_counts, prob_sums, N));
  }
  for (std::int64_t e = 0; e < E; ++e) {
    saved.counts.push_back(static_cast<std::int64_t>(host_counts[static_cast<std::size_t>(e)]));
    saved.runs.push_back(runs[static_cast<std::size_t>(e)] != 0.0);
  }
  // Dispatch: each token's row once for each of its experts, grouped by expert.
  COSHARD_CO_TRY_ASSIGN(Tensor rows, ctx.empty(Shape{N * k, D}, dt));
  COSHARD_CO_TRY(kern.moe_gather_rows(s, dt, input.data(), order.data_as<std::int32_t>(), N * k, k, D, rows.data()));
  COSHARD_CO_TRY_ASSIGN(saved.expert_out, ctx.empty(Shape{N * k, D}, dt));
  if (expert_parallel() > 1) {
    COSHARD_CO_TRY(co_await exchange_counts(ctx, saved));
    COSHARD_CO_TRY(co_await run_exchanged(ctx, true, rows, saved.expert_out, saved));
  } else {
    COSHARD_CO_TRY(co_await run_local_experts(ctx, true, rows, saved.expert_out, saved.counts, saved.runs));
  }
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(input.shape(), dt));
  COSHARD_CO_TRY(kern.moe_combine_rows(s, dt, saved.expert_out.data(), saved.inverse.data_as<std::int32_t>(),
                                       saved.weights.data_as<float>(), N, k, D, out.data()));
  saved_.push(std::move(saved));
  co_return out;
}

async::Task<Result<Tensor>> SparseMoe::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(Saved saved, saved_.pop("SparseMoe"));
  const DataType dt = saved.expert_out.dtype();
  COSHARD_CO_TRY(detail::check_grad(grad_output, saved.shape, dt, "SparseMoe"));
  const std::int64_t N = saved.shape.rows(), E = o_.experts, k = o_.top_k, D = o_.dim;
  const auto& kern = ctx.kernels();
  auto& s = ctx.stream();
  COSHARD_CO_TRY_ASSIGN(Tensor d_rows, ctx.empty(Shape{N * k, D}, dt));
  COSHARD_CO_TRY_ASSIGN(Tensor d_weights, ctx.empty(Shape{N, k}, DataType::f32));
  COSHARD_CO_TRY(kern.moe_combine_backward(s, dt, grad_output.data(), saved.expert_out.data(),
                                           saved.inverse.data_as<std::int32_t>(), saved.weights.data_as<float>(), N, k, D,
                                           d_rows.data(), d_weights.data_as<float>()));
  saved.expert_out = {};
  // The experts in reverse order of their forwards, each one's input gradient into its rows.
  COSHARD_CO_TRY_ASSIGN(Tensor d_dispatched, ctx.empty(Shape{N * k, D}, dt));
  if (expert_parallel() > 1) {
    COSHARD_CO_TRY(co_await run_exchanged(ctx, false, d_rows, d_dispatched, saved));
  } else {
    COSHARD_CO_TRY(co_await run_local_experts(ctx, false, d_rows, d_dispatched, saved.counts, saved.runs));
  }
  // Dispatch's backward: each token's rows summed.
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(saved.shape, dt));
  COSHARD_CO_TRY(kern.moe_combine_rows(s, dt, d_dispatched.data(), saved.inverse.data_as<std::int32_t>(), nullptr, N, k, D,
                                       dx.data()));
  // The router: through the top-k's weights (and the load-balancing loss's term), then its Linear.
  const float* extra = balance_ && balance_->prob_gradient() ? balance_->prob_gradient().data_as<float>() : nullptr;
  COSHARD_CO_TRY_ASSIGN(Tensor d_logits, ctx.empty(saved.shape.with_back(E), dt));
  COSHARD_CO_TRY(kern.moe_route_backward(s, saved.probs.data_as<float>(), saved.chosen.data_as<std::int32_t>(),
                                         saved.weights.data_as<float>(), d_weights.data_as<float>(), extra, N, E, k,
                                         o_.renormalize, dt, d_logits.data()));
  COSHARD_CO_TRY_ASSIGN(Tensor dx_router, co_await ctx.backward(*router_, d_logits));
  COSHARD_CO_TRY(kern.add(s, dt, dx.data(), dx_router.data(), dx.data(), dx.numel()));
  co_return dx;
}

std::shared_ptr<RouterBalance> find_router_balance(Module& model) {
  std::shared_ptr<RouterBalance> found;
  model.for_each_module([&](const std::string&, Module& m) {
    if (auto* moe = dynamic_cast<SparseMoe*>(&m); moe && !found) found = moe->balance();
  });
  return found;
}

}  // namespace coshard::modules
