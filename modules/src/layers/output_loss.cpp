// The output layer fused with its cross-entropy, a chunk of vocabulary columns at a time
// (output_loss.hpp), and the FusedCrossEntropyLoss that arms it (fused_cross_entropy.hpp).
#include "layers/output_loss.hpp"

#include <algorithm>

#include "coshard/modules/fused_cross_entropy.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/llama_layers.hpp"
#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"

namespace coshard::modules {
namespace detail {
namespace {

// Rows [first, first + rows) of a [.., in] parameter tensor (a weight, its gradient; in 1 for a bias).
Tensor rows_of(const Tensor& t, std::int64_t first, std::int64_t rows, std::int64_t in) {
  return t.slice(first * in, in == 1 ? Shape{rows} : Shape{rows, in});
}

// One chunk's logits: out [N, V] = hidden W[first, first + V)^T (+ bias[first, first + V)).
Result<void> chunk_logits(Context& ctx, const Tensor& hidden, const Parameter& w, const Parameter* bias,
                          std::int64_t in, std::int64_t first, std::int64_t V, const Tensor& out) {
  const DataType dt = hidden.dtype();
  const std::int64_t N = hidden.shape().rows();
  GemmArgs g{.trans_b = true, .m = N, .n = V, .k = in, .a = hidden.data(), .lda = in,
             .b = rows_of(w.value(), first, V, in).data(), .ldb = in, .c = out.data(), .ldc = V};
  if (bias) return ctx.kernels().gemm_bias(ctx.stream(), dt, g, rows_of(bias->value(), first, V, 1).data());
  return ctx.kernels().gemm(ctx.stream(), dt, g);
}

}  // namespace

std::int64_t OutputLoss::chunk_columns(std::int64_t rows, DataType dt, std::int64_t vocab) const noexcept {
  const std::int64_t row_bytes = std::max<std::int64_t>(rows, 1) * static_cast<std::int64_t>(size_of(dt));
  std::int64_t columns = std::max<std::int64_t>(chunk_bytes_ / row_bytes, 1);
  if (columns > 64) columns -= columns % 64;  // whole tiles for the products
  return std::min(columns, vocab);
}

Result<Tensor> OutputLoss::forward(Context& ctx, Tensor hidden, const Parameter& w, const Parameter* bias,
                                   std::int64_t in, std::int64_t vocab, std::string_view who) {
  const DataType dt = hidden.dtype(), stat = stat_dtype(dt);
  const std::int64_t N = hidden.shape().rows();
  Tensor targets = std::move(targets_);
  targets_ = {};
  saved_ = {};
  taken_ = dropped_ = false;
  if (targets.dtype() != DataType::i32 || targets.numel() != N || !(targets.device() == ctx.device()))
    return fail(ErrorCode::invalid_argument, who, " (fused with FusedCrossEntropyLoss): targets ", targets.describe(),
                ", expected i32 with ", N, " elements (one per row of the input ", hidden.describe(), ") on ",
                ctx.device().to_string());
  const auto& k = ctx.kernels();
  auto& s = ctx.stream();
  const std::int64_t step = chunk_columns(N, dt, vocab);
  COSHARD_TRY_ASSIGN(Tensor max, ctx.empty(Shape{N}, stat));
  COSHARD_TRY_ASSIGN(Tensor sums, ctx.empty(Shape{2 * N}, stat));
  COSHARD_TRY_ASSIGN(Tensor loss, ctx.empty(Shape{1}, stat));
  if (N > 0) {
    COSHARD_TRY_ASSIGN(Tensor logits, ctx.empty(Shape{N, step}, dt));  // one chunk, reused in stream order
    std::int64_t chunks = 0;
    for (std::int64_t first = 0; first < vocab; first += step, ++chunks) {
      const std::int64_t V = std::min(step, vocab - first);
      COSHARD_TRY(chunk_logits(ctx, hidden, w, bias, in, first, V, logits));
      COSHARD_TRY(k.chunk_ce_sums(s, dt, logits.data(), targets.data_as<std::int32_t>(), max.data(), sums.data(), N, V,
                                  first, vocab));
    }
    last_chunks_ = chunks;
  }
  COSHARD_TRY(k.vocab_ce_loss(s, dt, max.data(), sums.data(), loss.data(), N));
  saved_ = Saved{std::move(hidden), std::move(targets), std::move(max), std::move(sums), loss};
  return loss;
}

Result<Tensor> OutputLoss::backward(Context& ctx, const Tensor& seed, const Parameter& w, const Parameter* bias,
                                    std::int64_t in, std::int64_t vocab, std::string_view who) {
  if (!saved_.hidden) return fail(ErrorCode::invalid_argument, who, ": backward without a forward");
  const Saved saved = std::move(saved_);
  saved_ = {};
  const Tensor& hidden = saved.hidden;
  const DataType dt = hidden.dtype(), stat = stat_dtype(dt);
  COSHARD_TRY(check_seed(ctx, seed, dt, std::string(who) + " (fused with FusedCrossEntropyLoss)"));
  const std::int64_t N = hidden.shape().rows();
  const auto& k = ctx.kernels();
  auto& s = ctx.stream();
  // The input's gradient sums over the chunks in the stat dtype (f32 for bf16/f16: rounded once).
  const bool widened = stat != dt;
  COSHARD_TRY_ASSIGN(Tensor dx_sum, ctx.empty(hidden.shape(), stat));
  if (N == 0) return dx_sum;
  const std::int64_t step = chunk_columns(N, dt, vocab);
  COSHARD_TRY_ASSIGN(Tensor chunk, ctx.empty(Shape{N, step}, dt));
  const bool weight_trains = trains(w), bias_trains = bias && trains(*bias);
  for (std::int64_t first = 0; first < vocab; first += step) {
    const std::int64_t V = std::min(step, vocab - first);
    COSHARD_TRY(chunk_logits(ctx, hidden, w, bias, in, first, V, chunk));
    COSHARD_TRY(k.vocab_ce_backward(s, dt, chunk.data(), saved.targets.data_as<std::int32_t>(), saved.max.data(),
                                    saved.sums.data(), seed.data(), chunk.data(), N, V, first));
    if (weight_trains) {
      GemmArgs gw{.trans_a = true, .m = V, .n = in, .k = N, .a = chunk.data(), .lda = V, .b = hidden.data(),
                  .ldb = in, .c = rows_of(w.grad(), first, V, in).data(), .ldc = in, .beta = 1.0f};
      COSHARD_TRY(k.gemm(s, dt, gw));
    }
    if (bias_trains) COSHARD_TRY(k.bias_grad(s, dt, chunk.data(), rows_of(bias->grad(), first, V, 1).data(), N, V));
    GemmArgs gx{.m = N, .n = in, .k = V, .a = chunk.data(), .lda = V, .b = rows_of(w.value(), first, V, in).data(),
                .ldb = in, .c = dx_sum.data(),
                .ldc = in, .beta = first == 0 ? 0.0f : 1.0f, .c_in_stat_dtype = true};
    COSHARD_TRY(k.gemm(s, dt, gx));
  }
  if (!widened) return dx_sum;
  COSHARD_TRY_ASSIGN(Tensor dx, ctx.empty(hidden.shape(), dt));
  COSHARD_TRY(k.cast(s, stat, dx_sum.data(), dt, dx.data(), dx.numel()));
  return dx;
}

}  // namespace detail

// ---- FusedCrossEntropyLoss ----

FusedCrossEntropyLoss::FusedCrossEntropyLoss(FusedCrossEntropyOptions options)
    : state_(std::make_shared<detail::OutputLoss>(options.chunk_bytes)) {}

FusedCrossEntropyLoss::~FusedCrossEntropyLoss() {
  state_->set_attached(false);
  state_->clear();
}

Result<void> FusedCrossEntropyLoss::attach(Module& model) {
  constexpr std::string_view who = "FusedCrossEntropyLoss::attach";
  if (state_->chunk_bytes() < 1)
    return fail(ErrorCode::invalid_argument, who, ": chunk_bytes=", state_->chunk_bytes(), ": expected >= 1");
  if (state_->attached()) return fail(ErrorCode::invalid_argument, who, ": already attached to an output layer");
  Module* layer = &model;
  if (!dynamic_cast<Linear*>(layer) && !dynamic_cast<TiedHead*>(layer) && !dynamic_cast<TokenEmbedding*>(layer)) {
    layer = nullptr;
    for (const auto& c : model.children())
      if (c.name == "head") layer = c.module.get();
    if (!layer)
      return fail(ErrorCode::invalid_argument, who, ": a ", model.type_name(),
                  " with no child named \"head\": expected a model whose output layer is its child \"head\", or the "
                  "output layer itself (a Linear, a TiedHead or a TokenEmbedding)");
  }
  if (auto* tied = dynamic_cast<TiedHead*>(layer)) layer = &tied->table();
  if (auto* linear = dynamic_cast<Linear*>(layer)) {
    if (!linear->lora_adapters().empty())
      return fail(ErrorCode::unsupported, who, ": the output layer has ", linear->lora_adapters().size(),
                  " LoRA adapter(s): the fused loss computes the layer's product itself (use CrossEntropyLoss)");
    if (linear->weight().split())
      return fail(ErrorCode::unsupported, who,
                  ": the output layer's weight is split over tensor ranks (use VocabParallelCrossEntropyLoss)");
    if (linear->output_loss_ && linear->output_loss_->attached())
      return fail(ErrorCode::invalid_argument, who, ": the output layer already has a FusedCrossEntropyLoss attached");
    linear->output_loss_ = state_;
  } else if (auto* table = dynamic_cast<TokenEmbedding*>(layer)) {
    if (table->first_row() != 0 || table->vocab() != table->whole_vocab() || table->weight().split())
      return fail(ErrorCode::unsupported, who, ": the tied output layer holds rows [", table->first_row(), ", ",
                  table->first_row() + table->vocab(), ") of a vocabulary of ", table->whole_vocab(),
                  " (tensor-parallel: use VocabParallelCrossEntropyLoss)");
    if (table->output_loss_ && table->output_loss_->attached())
      return fail(ErrorCode::invalid_argument, who, ": the output layer already has a FusedCrossEntropyLoss attached");
    table->output_loss_ = state_;
  } else {
    return fail(ErrorCode::invalid_argument, who, ": the model's \"head\" is a ", layer->type_name(),
                ", expected a Linear, a TiedHead or a TokenEmbedding");
  }
  state_->set_attached(true);
  return {};
}

bool FusedCrossEntropyLoss::attached() const noexcept { return state_->attached(); }

void FusedCrossEntropyLoss::set_targets(Tensor targets) {
  plain_.set_targets(targets);
  state_->set_targets(std::move(targets));
}

std::int64_t FusedCrossEntropyLoss::chunk_columns(std::int64_t rows, DataType dtype, std::int64_t vocab) const noexcept {
  return state_->chunk_columns(rows, dtype, vocab);
}

std::int64_t FusedCrossEntropyLoss::last_chunks() const noexcept { return state_->last_chunks(); }

async::Task<Result<Tensor>> FusedCrossEntropyLoss::forward(Context& ctx, Tensor input) {
  state_->set_targets({});  // (consumed by the output layer, or not wanted there any more)
  if (state_->dropped()) {
    state_->forget();
    plain_.set_targets({});
    co_return fail(ErrorCode::invalid_argument,
                   "FusedCrossEntropyLoss: the output layer's loss was dropped before this forward (its saved state "
                   "cleared: the layer inside an activation-checkpointed block, whose recompute has no targets, or "
                   "clear_saved between the model's forward and the loss's); keep the output layer outside "
                   "checkpointed blocks, or use CrossEntropyLoss");
  }
  if (state_->produced(input)) {
    state_->take();
    fused_pass_ = last_fused_ = true;
    plain_.set_targets({});
    co_return input;
  }
  // Logits: the output layer ran without targets (set after the model's forward, or not attached).
  fused_pass_ = last_fused_ = false;
  co_return co_await plain_.forward(ctx, std::move(input));
}

async::Task<Result<Tensor>> FusedCrossEntropyLoss::backward(Context& ctx, Tensor seed) {
  if (!fused_pass_) co_return co_await plain_.backward(ctx, std::move(seed));
  fused_pass_ = false;
  co_return seed;  // the output layer's backward takes the seed itself
}

void FusedCrossEntropyLoss::clear_saved() {
  fused_pass_ = false;
  plain_.clear_saved();
  state_->clear();
}

}  // namespace coshard::modules
