// Mixture of experts: a sparse MoE block as transformers' Mixtral and Qwen3-MoE compute it, and
// their load-balancing loss.
//
//   SparseMoe: x [..., dim] -> router (a bias-free Linear to the experts) -> softmax in f32 ->
//   the top k experts of each token (ties to the lower one), their probabilities renormalised
//   when asked (Mixtral always, Qwen3-MoE with norm_topk_prob), cast to the compute dtype -> each
//   chosen expert (a SwiGLU MLP: gate_up, swiglu, down) on its tokens -> the outputs summed with
//   those weights, in expert order.
//
// The experts are ordinary modules ("experts.E.gate_up", "experts.E.down"), run through the
// context's hooks only for the tokens routed to them: an engine fetches an expert only when it
// runs. Which experts run is agreed by the ranks first (ModuleHooks::agree_on_union): an expert
// any rank routed a token to runs on every rank (with no rows where this rank has none), so the
// ranks gather and reduce the same experts in the same order; an expert no rank chose does not
// run, gets no gradient and is left untouched by the optimizer (PyTorch's AdamW on a parameter
// whose gradient is None). The number of tokens each expert gets reaches the host through an
// awaited read of the routing's counts, never a blocking wait.
//
// RouterBalance and RouterAuxLoss: transformers' load_balancing_loss_func over one forward of
// the model (every MoE layer's router probabilities pooled: tokens_per_expert from the top-k
// choices, router_prob_per_expert from the softmax, their products summed times the number of
// experts), added to the loss as coef * it. Each rank computes it over its own tokens of each
// micro-batch, as transformers does inside a PyTorch DDP or FSDP step: over several ranks the
// result is the mean of the ranks' losses, not one loss over the global batch.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/module.hpp"

namespace coshard::modules {

// The pooled router statistics of one forward of a model's MoE layers, shared by those layers
// and the RouterAuxLoss that turns them into the loss. Made by the model's builder.
class RouterBalance {
 public:
  RouterBalance(std::int64_t experts, std::int64_t top_k, double coef) : experts_(experts), top_k_(top_k), coef_(coef) {}
  std::int64_t experts() const noexcept { return experts_; }
  std::int64_t top_k() const noexcept { return top_k_; }
  double coef() const noexcept { return coef_; }  // router_aux_loss_coef (0: statistics only)
  void set_coef(double coef) noexcept { coef_ = coef; }
  // A new layer's index among those sharing this balance (SparseMoe::create).
  std::int64_t add_layer_index() noexcept { return layers_++; }
  std::int64_t layers() const noexcept { return layers_; }

  // A layer's forward: its routing's per-expert choices (host) and probabilities summed over its
  // tokens (f32 [experts] on the device). The first layer of a pass starts the pool afresh.
  Result<void> add_layer(Context& ctx, bool first_layer, std::span<const double> chosen_per_expert,
                         const Tensor& probs, std::int64_t tokens);
  // The pool's load_balancing_loss (f32 [1] on the device), keeping the factors its gradient
  // needs. An error when no layer ran since the pool started.
  Result<Tensor> loss(Context& ctx);
  // The gradient of `coef * loss` on every pooled token's probability of each expert, times the
  // backward's seed (f32 [experts], set by RouterAuxLoss::backward; empty when no aux loss).
  const Tensor& prob_gradient() const noexcept { return prob_gradient_; }
  Result<void> set_seed(Context& ctx, const Tensor& seed);

  // The pool's statistics after a forward, per layer in the order they ran.
  struct LayerLoad {
    std::int64_t experts_used = 0;  // experts this rank routed a token to
    double largest_share = 0;       // the largest expert's share of the layer's choices
    std::vector<double> chosen;     // the choices of each expert
  };
  const std::vector<LayerLoad>& layer_loads() const noexcept { return loads_; }

 private:
  std::int64_t experts_, top_k_;
  double coef_;
  std::int64_t layers_ = 0;
  std::vector<double> chosen_;  // per expert, over the pooled layers
  Tensor prob_sums_;            // f32 [experts]
  std::int64_t rows_ = 0;       // tokens over the pooled layers
  std::vector<double> gradient_factors_;  // d(coef * loss) / d(prob of e), per routed token
  Tensor prob_gradient_;
  std::vector<LayerLoad> loads_;
};

// One expert: SwiGLU (gate_up [2I, dim], swiglu, down [dim, I]), as the dense MLP of make_llama.
std::unique_ptr<Sequential> make_swiglu_expert(std::int64_t dim, std::int64_t intermediate, Init init);

class SparseMoe final : public Module {
 public:
  struct Options {
    std::int64_t dim = 0;
    std::int64_t experts = 0;
    std::int64_t top_k = 2;
    std::int64_t intermediate = 0;  // each expert's width
    bool renormalize = true;        // norm_topk_prob
    Init init = Init::normal(0.02);
    // Every expert runs in every pass, those no rank routed a token to on no rows: every expert
    // gathered and reduced each time, as FSDP2 and DeepSpeed's MoE leaf do (a fixed fetch order;
    // an expert nobody chose then gets a zero gradient, so AdamW decays it and moves its moments).
    bool every_expert_runs = false;
    // How transformers names the experts' projections (LoRA's targets, PEFT folders): Mixtral's
    // w1, w3, w2 under block_sparse_moe, else Qwen3-MoE's gate_proj, up_proj, down_proj under mlp.
    bool mixtral_names = false;
    // Expert parallelism (null or a group of one: none): the experts partitioned over this
    // group's ranks, rank q holding experts [q E / P, (q + 1) E / P) under their own indices
    // ("experts.5" on rank 1 of 2 for 8 experts; each Parameter::expert_parallel says P). Each
    // rank's routed rows go to their experts' ranks and back through all_to_allv on this group,
    // after one exchange of the counts: the same sums as every expert on every rank. The group's
    // ranks must build the same layer; it must outlive the module. E must divide by P.
    collectives::Communicator* expert_group = nullptr;
  };
  // Refused by name: sizes below 1, top_k above the experts.
  static Result<std::unique_ptr<SparseMoe>> create(const Options& options, std::shared_ptr<RouterBalance> balance = nullptr);
  // Your own experts: any modules mapping [rows, dim] to [rows, dim] (one per expert; with an
  // expert_group, this rank's E / P experts).
  static Result<std::unique_ptr<SparseMoe>> create(const Options& options, std::vector<std::unique_ptr<Module>> experts,
                                                   std::shared_ptr<RouterBalance> balance = nullptr);

  std::string_view type_name() const override { return "SparseMoe"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { saved_.clear(); }

  const Options& options() const noexcept { return o_; }
  Linear& router() const noexcept { return *router_; }
  // Expert e (of all E), or null where another rank of the expert group holds it.
  Module* expert(std::int64_t e) const noexcept { return experts_[static_cast<std::size_t>(e)]; }
  // The experts this rank holds: [first_local_expert(), + local_experts()) (all of them without
  // expert parallelism).
  std::int64_t first_local_expert() const noexcept { return first_local_; }
  std::int64_t local_experts() const noexcept { return local_; }
  // The expert group's size (1: none).
  int expert_parallel() const noexcept { return o_.expert_group ? o_.expert_group->size() : 1; }
  const std::shared_ptr<RouterBalance>& balance() const noexcept { return balance_; }
  // This layer's place among the layers sharing its balance, in the order they were made (the
  // first one's forward starts the balance's pool: make them in the order they run).
  std::int64_t layer_index() const noexcept { return layer_index_; }

 private:
  SparseMoe(const Options& options, std::shared_ptr<RouterBalance> balance);
  struct Saved {
    Shape shape;
    Tensor probs, chosen, weights, inverse, expert_out;
    std::vector<std::int64_t> counts;  // tokens per expert, this rank
    std::vector<bool> runs;            // experts run (the ranks' union)
    // Expert parallelism: the rows each rank of the group sends here for each local expert
    // ([rank][local expert]), and the rows this rank sends to each rank.
    std::vector<std::int64_t> received{}, sent{};
  };
  // The local experts on their rows, forward or backward (in reverse), `rows` grouped by expert
  // as `counts` says; the outputs into `out` at the same rows.
  async::Task<Result<void>> run_local_experts(Context& ctx, bool forward, const Tensor& rows, const Tensor& out,
                                              const std::vector<std::int64_t>& counts, const std::vector<bool>& runs);
  // Expert parallelism: the dispatched rows (grouped by expert, all E) to their experts' ranks,
  // run there (forward or backward), and back, into `out` at the same rows.
  async::Task<Result<void>> run_exchanged(Context& ctx, bool forward, const Tensor& rows, const Tensor& out, Saved& saved);
  // The counts of rows each rank of the group sends this one for each local expert (saved.received).
  async::Task<Result<void>> exchange_counts(Context& ctx, Saved& saved);
  Options o_;
  std::shared_ptr<RouterBalance> balance_;
  std::int64_t layer_index_ = 0;
  Linear* router_ = nullptr;
  std::vector<Module*> experts_;  // all E; null where another rank holds it
  std::int64_t first_local_ = 0, local_ = 0;
  SavedPerCall<Saved> saved_;
};

// The model's loss plus the load-balancing term: forward gives inner's loss + coef *
// load_balancing_loss of the forward just run; backward seeds the MoE layers' routers with its
// gradient. Targets go to `inner`. Both must outlive it.
class RouterAuxLoss final : public Loss {
 public:
  RouterAuxLoss(Loss& inner, std::shared_ptr<RouterBalance> balance) : inner_(&inner), balance_(std::move(balance)) {}
  std::string_view type_name() const override { return "RouterAuxLoss"; }
  void set_targets(Tensor targets) override { inner_->set_targets(std::move(targets)); }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor seed) override;
  void clear_saved() override;
  // The last forward's load-balancing loss alone (f32 [1] on the device; empty before one).
  const Tensor& last_aux_loss() const noexcept { return last_aux_; }
  RouterBalance& balance() const noexcept { return *balance_; }

  // What the forwards since the last reset_totals routed (a step's micro-batches, say): the sum of
  // their load-balancing losses (f32 [1] on the device; empty before one), how many, and each
  // MoE layer's choices of each expert, summed.
  struct Totals {
    Tensor aux_sum;
    std::int64_t forwards = 0;
    std::vector<std::vector<double>> chosen;  // [layer][expert]
  };
  const Totals& totals() const noexcept { return totals_; }
  void reset_totals() noexcept { totals_ = {}; }

 private:
  Result<void> add_to_totals(Context& ctx);
  Loss* inner_;
  std::shared_ptr<RouterBalance> balance_;
  Tensor last_aux_;
  Totals totals_;
};

// The balance the MoE layers of `model` share (null when it has none).
std::shared_ptr<RouterBalance> find_router_balance(Module& model);

// Expert parallelism: each parameter of this rank's experts (an expert_group's SparseMoe layers,
// in model order, adapters on them included) with the name the same place holds on each expert
// rank q ("h0.mlp.moe.experts.5.down.weight" on rank 1 of 2 for 8 experts is "experts.1..." on
// rank 0): the whole model's expert names. Empty without expert parallelism.
struct ExpertPlace {
  std::string name;  // this rank's
  std::int64_t numel = 0;
  std::vector<std::string> names_by_rank{};  // [expert rank q]
};
std::vector<ExpertPlace> expert_places(Module& model);
// Whether `pattern` (glob_matches) selects the same places on every expert rank: every name of a
// place or none of them. An error names the first place it splits; fine without expert parallelism.
Result<void> check_same_on_every_expert_rank(Module& model, std::string_view pattern, std::string_view what);

}  // namespace coshard::modules
