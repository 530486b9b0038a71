// Low-rank adapters (lora.hpp): the adapter's products through strided GEMMs on its rows of the
// Linear's output (no copy of the rows), and apply_lora's choice of layers.
#include "coshard/modules/lora.hpp"

#include <algorithm>
#include <cmath>
#include <map>
#include <optional>
#include <unordered_set>

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/llama_layers.hpp"
#include "coshard/modules/tensor_parallel.hpp"
#include "kernels/kernels.hpp"
#include "layers/layer_checks.hpp"
#include "random.hpp"

namespace coshard::modules {
namespace {

using detail::GemmArgs;

// (named in the collectives of split adapters: each outlives the step)
const std::string kLoraProduct = "a LoRA adapter's product A x (tensor-parallel)";
const std::string kLoraProductGradient = "the gradient of a LoRA adapter's product A x (tensor-parallel)";

Result<void> check_options(const LoraOptions& o) {
  if (o.targets.empty())
    return fail(ErrorCode::invalid_argument, "apply_lora: no targets (which linear layers to adapt: globs over their paths)");
  if (o.rank < 1) return fail(ErrorCode::invalid_argument, "LoRA rank=", o.rank, ": expected >= 1");
  if (!std::isfinite(o.alpha) || !(o.alpha > 0))
    return fail(ErrorCode::invalid_argument, "LoRA alpha=", o.alpha, ": expected a finite value > 0");
  if (!std::isfinite(o.dropout) || o.dropout < 0 || o.dropout >= 1)
    return fail(ErrorCode::invalid_argument, "LoRA dropout=", o.dropout, ": expected a value in [0, 1)");
  return {};
}

// One adapter to make: on rows [begin, end) of the Linear at `linear`.
struct Planned {
  std::string linear;
  Linear* layer = nullptr;
  std::string name;  // the child's
  std::string hf_projection;
  std::int64_t layer_index = -1;
  std::int64_t begin = 0, end = 0;
};

// Where a planned adapter sits: on a whole layer, or split as its tensor-parallel layer is (rows
// of a column-parallel layer: whole segments of its split; a row-parallel layer's input columns).
Result<LoraPlacement> placement_of(const Planned& p, const LoraOptions& o) {
  const Linear& l = *p.layer;
  LoraPlacement w{.in = l.in_features(), .row_begin = p.begin, .row_end = p.end, .out = l.out_features(),
                  .whole_in = l.in_features(), .whole_row_begin = p.begin, .whole_row_end = p.end, .row_segments = {}};
  const TensorSplit* split = l.weight().split();
  if (!split || split->parts <= 1) return w;
  if (!o.tensor_group)
    return fail(ErrorCode::invalid_argument, "LoRA on ", p.linear, ": the layer is part ", split->index, " of ", split->parts,
                " of a tensor-parallel split; give LoraOptions::tensor_group (the tensor group it was split over)");
  if (o.tensor_group->size() != split->parts || o.tensor_group->rank() != split->index)
    return fail(ErrorCode::invalid_argument, "LoRA on ", p.linear, ": the layer is part ", split->index, " of ", split->parts,
                ", and LoraOptions::tensor_group is rank ", o.tensor_group->rank(), " of ", o.tensor_group->size());
  w.group = o.tensor_group;
  if (split->dim == 1) {  // row-parallel: its input columns
    w.split = LoraSplit::input_columns;
    w.whole_in = split->whole[1];
    return w;
  }
  // Column-parallel: the local rows [begin, end) are this rank's parts of whole segments.
  w.split = LoraSplit::output_rows;
  std::int64_t local = 0, whole = 0;
  bool started = false;
  for (const std::int64_t segment : split->segments) {
    const std::int64_t part = segment / split->parts;
    if (local == p.begin) {
      started = true;
      w.whole_row_begin = whole;
    }
    if (started) w.row_segments.push_back(segment);
    local += part;
    whole += segment;
    if (started && local == p.end) {
      w.whole_row_end = whole;
      if (w.row_segments.size() == 1) w.row_segments.clear();
      return w;
    }
  }
  return fail(ErrorCode::invalid_argument, "LoRA on ", p.linear, ": rows [", p.begin, ", ", p.end,
              ") do not cover whole segments of its tensor-parallel split");
}

// Freezes the model, then adds the planned adapters (their dropout seeds told apart by path).
Result<std::vector<LoraAdapterInfo>> make_adapters(Module& model, const std::vector<Planned>& plan, const LoraOptions& o) {
  for (const auto& p : plan)
    if (!p.layer->lora_adapters().empty())
      return fail(ErrorCode::invalid_argument, "apply_lora: ", p.linear, " already has adapters");
  COSHARD_TRY(model.set_trainable(false));
  std::vector<LoraAdapterInfo> made;
  for (const auto& p : plan) {
    const std::string path = p.linear + "." + p.name;
    LoraOptions own = o;
    own.seed = detail::SplitMix64{o.seed ^ detail::fnv1a(path)}.next();
    COSHARD_TRY_ASSIGN(const LoraPlacement where, placement_of(p, o));
    COSHARD_TRY_ASSIGN(LoraAdapter * adapter, p.layer->add_lora(p.name, where, own));
    made.push_back({path, p.linear, p.hf_projection, p.layer_index, adapter});
  }
  return made;
}

// The model's Linear layers by path, in model order (adapters' own excluded: they are not Linear).
std::vector<std::pair<std::string, Linear*>> linears_of(Module& model) {
  std::vector<std::pair<std::string, Linear*>> out;
  model.for_each_module([&](const std::string& path, Module& m) {
    if (auto* l = dynamic_cast<Linear*>(&m)) out.emplace_back(path, l);
  });
  return out;
}

// PEFT's rule for a list entry (tuners_utils.check_target_module_exists): the module's name is the
// entry, or ends in "." + the entry.
bool peft_list_matches(std::string_view target, std::string_view name) {
  return name == target || (name.size() > target.size() && name.ends_with(target) &&
                            name[name.size() - target.size() - 1] == '.');
}

// A target that matched no linear layer: its error, naming what it did match when that was not
// a linear layer.
Unexpected matched_nothing(Module& model, const std::string& target) {
  std::string others;
  model.for_each_module([&](const std::string& path, Module& m) {
    if (!path.empty() && others.size() < 200 && glob_matches(target, path))
      others += (others.empty() ? "" : ", ") + path + " (" + std::string(m.type_name()) + ")";
  });
  return fail(ErrorCode::invalid_argument, "LoRA target \"", target, "\" matches no linear layer",
              others.empty() ? std::string(" (nor any module)") : " (it matches " + others + ")");
}

}  // namespace

// ---- LoraAdapter ----

LoraAdapter::LoraAdapter(std::int64_t in_features, std::int64_t row_begin, std::int64_t row_end,
                         std::int64_t out_features, const LoraOptions& options)
    : LoraAdapter(LoraPlacement{.in = in_features, .row_begin = row_begin, .row_end = row_end, .out = out_features,
                                .whole_in = in_features, .whole_row_begin = row_begin, .whole_row_end = row_end, .row_segments = {}},
                  options) {}

namespace {

std::int64_t parts_of(const LoraPlacement& w) noexcept { return w.split == LoraSplit::none || !w.group ? 1 : w.group->size(); }
std::int64_t index_of(const LoraPlacement& w) noexcept { return w.split == LoraSplit::none || !w.group ? 0 : w.group->rank(); }

}  // namespace

LoraAdapter::LoraAdapter(const LoraPlacement& where, const LoraOptions& options)
    : where_(where),
      in_(where.in),
      row_begin_(where.row_begin),
      row_end_(where.row_end),
      out_(where.out),
      rank_(options.rank),
      a_rows_(options.rank),
      alpha_(options.alpha),
      dropout_(options.dropout),
      seed_(options.seed) {
  const std::int64_t parts = parts_of(where), index = index_of(where);
  if (where.split == LoraSplit::output_rows) a_rows_ = rank_ / parts;
  if (where.split == LoraSplit::input_columns) {  // (this rank's rows of the adapter's, in the whole output)
    const std::int64_t rows = (where.row_end - where.row_begin) / parts;
    row_begin_ = where.row_begin + index * rows;
    row_end_ = row_begin_ + rows;
  }
  const double bound = 1.0 / std::sqrt(static_cast<double>(where.whole_in));  // kaiming_uniform_(a=sqrt(5)), the whole's fan-in
  register_parameter("A", Shape{a_rows_, in_}, Init::uniform(-bound, bound));
  register_parameter("B", Shape{row_end_ - row_begin_, rank_}, Init::zeros());
}

Result<void> LoraAdapter::split_parameters() {
  if (where_.split == LoraSplit::none) return {};
  const std::int64_t parts = parts_of(where_), index = index_of(where_);
  const std::int64_t whole_rows = where_.whole_row_end - where_.whole_row_begin;
  auto part = [&](int dim, std::int64_t along, Shape whole) {
    return TensorSplit{.dim = dim, .segments = {along}, .parts = parts, .index = index, .whole = whole};
  };
  if (where_.split == LoraSplit::output_rows) COSHARD_TRY(a().set_split(part(0, rank_, Shape{rank_, where_.whole_in})));
  else COSHARD_TRY(a().set_split(part(1, where_.whole_in, Shape{rank_, where_.whole_in})));
  if (where_.split == LoraSplit::output_rows && !where_.row_segments.empty())
    return b().set_split(TensorSplit{.dim = 0, .segments = where_.row_segments, .parts = parts, .index = index,
                                     .whole = Shape{whole_rows, rank_}});
  return b().set_split(part(0, whole_rows, Shape{whole_rows, rank_}));
}

Result<Tensor> LoraAdapter::dropout_mask(Context& ctx, const Tensor& input) {
  // A forward's ordinal decides its mask; a recompute (activation checkpointing) replays the
  // mask of the forward whose backward comes next.
  std::uint64_t ordinal = 0;
  if (ctx.recomputing() && !pending_.empty()) {
    ordinal = pending_.back();
  } else {
    ordinal = forwards_++;
    pending_.push_back(ordinal);
  }
  const std::int64_t n = input.numel();
  std::vector<float> values(static_cast<std::size_t>(n));
  const auto keep = static_cast<float>(1.0 / (1.0 - dropout_));
  detail::SplitMix64 rng{seed_ ^ detail::SplitMix64{ordinal}.next()};
  if (where_.split == LoraSplit::input_columns) {
    // This rank's columns of the whole input's mask (the unsplit run's, element for element).
    const std::int64_t rows = input.shape().rows(), first = index_of(where_) * in_;
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t c = 0; c < where_.whole_in; ++c) {
        const float v = rng.uniform01() < dropout_ ? 0.0f : keep;
        if (c >= first && c < first + in_) values[static_cast<std::size_t>(r * in_ + c - first)] = v;
      }
  } else {
    for (auto& v : values) v = rng.uniform01() < dropout_ ? 0.0f : keep;
  }
  COSHARD_TRY_ASSIGN(Tensor f32, ctx.upload(std::as_bytes(std::span<const float>(values)), input.shape(), DataType::f32));
  if (input.dtype() == DataType::f32) return f32;
  COSHARD_TRY_ASSIGN(Tensor mask, ctx.empty(input.shape(), input.dtype()));
  COSHARD_TRY(ctx.kernels().cast(ctx.stream(), DataType::f32, f32.data(), input.dtype(), mask.data(), n));
  return mask;
}

async::Task<Result<Tensor>> LoraAdapter::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY(detail::check_activation(ctx, input, in_, "LoraAdapter"));
  const DataType dt = input.dtype();
  COSHARD_CO_TRY(detail::check_param(a(), dt, "LoraAdapter"));
  COSHARD_CO_TRY(detail::check_param(b(), dt, "LoraAdapter"));
  Tensor out = add_into_;
  if (!out || out.shape() != input.shape().with_back(out_) || out.dtype() != dt)
    co_return fail(ErrorCode::invalid_argument, "LoraAdapter: run by its Linear only (no output of shape ",
                   input.shape().with_back(out_).to_string(), " to add into)");
  const std::int64_t rows = input.shape().rows();
  auto& k = ctx.kernels();
  Saved saved;
  saved.input = input;
  if (dropout_ > 0) {
    COSHARD_CO_TRY_ASSIGN(saved.mask, dropout_mask(ctx, input));
    COSHARD_CO_TRY_ASSIGN(saved.input, ctx.empty(input.shape(), dt));
    COSHARD_CO_TRY(k.mul(ctx.stream(), dt, input.data(), saved.mask.data(), saved.input.data(), input.numel()));
  }
  if (where_.split == LoraSplit::output_rows) {
    COSHARD_CO_TRY(forward_output_rows(ctx, saved, out));
    saved_.push(std::move(saved));
    co_return out;
  }
  // product [rows, rank] = x A^T; out[:, begin:end] += scale * product B^T (ldc: the whole row).
  COSHARD_CO_TRY_ASSIGN(saved.product, ctx.empty(Shape{rows, rank_}, dt));
  COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                        GemmArgs{.trans_b = true, .m = rows, .n = rank_, .k = in_, .a = saved.input.data(), .lda = in_,
                                 .b = a().value().data(), .ldb = in_, .c = saved.product.data(), .ldc = rank_}));
  // (split by input columns: each rank's columns gave a part of the product)
  if (where_.split == LoraSplit::input_columns) {
    COSHARD_CO_TRY_ASSIGN(saved.product, sum_over_tensor_ranks(ctx, *where_.group, saved.product, kLoraProduct));
  }
  auto* rows_out = static_cast<std::byte*>(out.data()) + static_cast<std::size_t>(row_begin_) * size_of(dt);
  COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                        GemmArgs{.trans_b = true, .m = rows, .n = row_end_ - row_begin_, .k = rank_,
                                 .a = saved.product.data(), .lda = rank_, .b = b().value().data(), .ldb = rank_,
                                 .c = rows_out, .ldc = out_, .alpha = scale(), .beta = 1.0f}));
  saved_.push(std::move(saved));
  co_return out;
}

async::Task<Result<Tensor>> LoraAdapter::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(Saved saved, saved_.pop("LoraAdapter"));
  if (dropout_ > 0 && !pending_.empty()) pending_.pop_back();
  const DataType dt = saved.input.dtype();
  COSHARD_CO_TRY(detail::check_grad(grad_output, saved.input.shape().with_back(out_), dt, "LoraAdapter"));
  if (where_.split == LoraSplit::output_rows) co_return backward_output_rows(ctx, saved, grad_output);
  const std::int64_t rows = saved.input.shape().rows(), width = row_end_ - row_begin_;
  auto& k = ctx.kernels();
  const auto* dy = static_cast<const std::byte*>(grad_output.data()) + static_cast<std::size_t>(row_begin_) * size_of(dt);
  // dB += scale * dy[:, rows]^T product; dproduct = scale * dy[:, rows] B.
  if (b().grad())
    COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                          GemmArgs{.trans_a = true, .m = width, .n = rank_, .k = rows, .a = dy, .lda = out_,
                                   .b = saved.product.data(), .ldb = rank_, .c = b().grad().data(), .ldc = rank_,
                                   .alpha = scale(), .beta = 1.0f}));
  COSHARD_CO_TRY_ASSIGN(Tensor dproduct, ctx.empty(Shape{rows, rank_}, dt));
  COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                        GemmArgs{.m = rows, .n = rank_, .k = width, .a = dy, .lda = out_, .b = b().value().data(),
                                 .ldb = rank_, .c = dproduct.data(), .ldc = rank_, .alpha = scale()}));
  // (split by input columns: each rank's rows of B gave a part of it)
  if (where_.split == LoraSplit::input_columns) {
    COSHARD_CO_TRY_ASSIGN(dproduct, sum_over_tensor_ranks(ctx, *where_.group, dproduct, kLoraProductGradient));
  }
  // dA += dproduct^T x; dx = dproduct A (times the dropout's mask).
  if (a().grad())
    COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                          GemmArgs{.trans_a = true, .m = rank_, .n = in_, .k = rows, .a = dproduct.data(), .lda = rank_,
                                   .b = saved.input.data(), .ldb = in_, .c = a().grad().data(), .ldc = in_,
                                   .beta = 1.0f}));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(saved.input.shape(), dt));
  COSHARD_CO_TRY(k.gemm(ctx.stream(), dt,
                        GemmArgs{.m = rows, .n = in_, .k = rank_, .a = dproduct.data(), .lda = rank_,
                                 .b = a().value().data(), .ldb = in_, .c = dx.data(), .ldc = in_}));
  if (saved.mask) COSHARD_CO_TRY(k.mul(ctx.stream(), dt, dx.data(), saved.mask.data(), dx.data(), dx.numel()));
  co_return dx;
}

// Split by output rows, the product kept transposed ([rank, rows]): each rank makes its rows of the
// rank dimension (A's rows here), gathered rank-major into the whole, then its own output rows.
Result<void> LoraAdapter::forward_output_rows(Context& ctx, Saved& saved, const Tensor& out) {
  const DataType dt = saved.input.dtype();
  const std::int64_t rows = saved.input.shape().rows();
  auto& k = ctx.kernels();
  COSHARD_TRY_ASSIGN(Tensor part, ctx.empty(Shape{a_rows_, rows}, dt));  // A x^T, this rank's rows of it
  COSHARD_TRY(k.gemm(ctx.stream(), dt,
                     GemmArgs{.trans_b = true, .m = a_rows_, .n = rows, .k = in_, .a = a().value().data(), .lda = in_,
                              .b = saved.input.data(), .ldb = in_, .c = part.data(), .ldc = rows}));
  COSHARD_TRY_ASSIGN(saved.product, gather_over_tensor_ranks(ctx, *where_.group, part, kLoraProduct));
  auto* rows_out = static_cast<std::byte*>(out.data()) + static_cast<std::size_t>(row_begin_) * size_of(dt);
  return k.gemm(ctx.stream(), dt,
                GemmArgs{.trans_a = true, .trans_b = true, .m = rows, .n = row_end_ - row_begin_, .k = rank_,
                         .a = saved.product.data(), .lda = rows, .b = b().value().data(), .ldb = rank_, .c = rows_out,
                         .ldc = out_, .alpha = scale(), .beta = 1.0f});
}

Result<Tensor> LoraAdapter::backward_output_rows(Context& ctx, const Saved& saved, const Tensor& grad_output) {
  const DataType dt = saved.input.dtype();
  const std::int64_t rows = saved.input.shape().rows(), width = row_end_ - row_begin_;
  auto& k = ctx.kernels();
  const auto* dy = static_cast<const std::byte*>(grad_output.data()) + static_cast<std::size_t>(row_begin_) * size_of(dt);
  // dB += scale * dy[:, rows]^T product; the product's gradient (transposed) = scale * B^T dy^T,
  // a part from each rank's rows, summed.
  if (b().grad())
    COSHARD_TRY(k.gemm(ctx.stream(), dt,
                       GemmArgs{.trans_a = true, .trans_b = true, .m = width, .n = rank_, .k = rows, .a = dy, .lda = out_,
                                .b = saved.product.data(), .ldb = rows, .c = b().grad().data(), .ldc = rank_,
                                .alpha = scale(), .beta = 1.0f}));
  COSHARD_TRY_ASSIGN(Tensor dproduct, ctx.empty(Shape{rank_, rows}, dt));
  COSHARD_TRY(k.gemm(ctx.stream(), dt,
                     GemmArgs{.trans_a = true, .trans_b = true, .m = rank_, .n = rows, .k = width, .a = b().value().data(),
                              .lda = rank_, .b = dy, .ldb = out_, .c = dproduct.data(), .ldc = rows, .alpha = scale()}));
  COSHARD_TRY_ASSIGN(dproduct, sum_over_tensor_ranks(ctx, *where_.group, dproduct, kLoraProductGradient));
  // This rank's rows of it: dA += mine x; dx = mine^T A (a part: the layer's fork sums dx).
  const auto* mine = static_cast<const std::byte*>(dproduct.data()) +
                     static_cast<std::size_t>(index_of(where_) * a_rows_ * rows) * size_of(dt);
  if (a().grad())
    COSHARD_TRY(k.gemm(ctx.stream(), dt,
                       GemmArgs{.m = a_rows_, .n = in_, .k = rows, .a = mine, .lda = rows, .b = saved.input.data(),
                                .ldb = in_, .c = a().grad().data(), .ldc = in_, .beta = 1.0f}));
  COSHARD_TRY_ASSIGN(Tensor dx, ctx.empty(saved.input.shape(), dt));
  COSHARD_TRY(k.gemm(ctx.stream(), dt,
                     GemmArgs{.trans_a = true, .m = rows, .n = in_, .k = a_rows_, .a = mine, .lda = rows,
                              .b = a().value().data(), .ldb = in_, .c = dx.data(), .ldc = in_}));
  if (saved.mask) COSHARD_TRY(k.mul(ctx.stream(), dt, dx.data(), saved.mask.data(), dx.data(), dx.numel()));
  return dx;
}

// ---- apply_lora ----

namespace {

// Any model: one adapter per matched Linear, over all its rows.
Result<std::vector<LoraAdapterInfo>> adapt_by_glob(Module& model, const LoraOptions& options) {
  const auto linears = linears_of(model);
  std::vector<Planned> plan;
  std::unordered_set<const Linear*> chosen;
  for (const auto& target : options.targets) {
    bool matched = false;
    for (const auto& [path, layer] : linears) {
      if (!glob_matches(target, path) && !peft_list_matches(target, path)) continue;
      matched = true;
      if (chosen.insert(layer).second) plan.push_back({path, layer, "lora", "", -1, 0, layer->out_features()});
    }
    if (!matched) return matched_nothing(model, target);
  }
  // (in model order, whatever the targets' order)
  std::vector<Planned> ordered;
  for (const auto& [path, layer] : linears)
    for (const auto& p : plan)
      if (p.layer == layer) ordered.push_back(p);
  return make_adapters(model, ordered, options);
}

// make_llama's blocks, as found in a model: h{l}.attn.rope (its heads), .attn.qkv, .attn.proj,
// .mlp.gate_up and .mlp.down, for every l from 0.
struct LlamaLayout {
  std::int64_t layers = 0, dim = 0, heads = 0, kv_heads = 0, head_dim = 0, intermediate = 0;
};

std::optional<LlamaLayout> llama_layout(Module& model) {
  std::map<std::string, Module*> by_path;
  model.for_each_module([&](const std::string& path, Module& m) { by_path[path] = &m; });
  LlamaLayout c;
  for (;; ++c.layers) {
    const std::string h = "h" + std::to_string(c.layers) + ".";
    auto* rope = by_path.contains(h + "attn.rope") ? dynamic_cast<RotaryEmbedding*>(by_path[h + "attn.rope"]) : nullptr;
    if (!rope) break;
    auto linear = [&](const std::string& name) {
      return by_path.contains(h + name) ? dynamic_cast<Linear*>(by_path[h + name]) : nullptr;
    };
    Linear *qkv = linear("attn.qkv"), *proj = linear("attn.proj"), *gate_up = linear("mlp.gate_up"), *down = linear("mlp.down");
    if (!qkv || !proj || !gate_up || !down) return std::nullopt;
    const LlamaLayout here{0, proj->out_features(), rope->n_heads(), rope->n_kv_heads(), rope->head_dim(),
                           gate_up->out_features() / 2};
    if (qkv->out_features() != (here.heads + 2 * here.kv_heads) * here.head_dim || down->out_features() != here.dim)
      return std::nullopt;
    if (c.layers > 0 && (here.dim != c.dim || here.heads != c.heads || here.kv_heads != c.kv_heads ||
                         here.head_dim != c.head_dim || here.intermediate != c.intermediate))
      return std::nullopt;
    const std::int64_t layers = c.layers;
    c = here;
    c.layers = layers;
  }
  if (c.layers == 0) return std::nullopt;
  return c;
}

// transformers' name of block l's projection: "model.layers.3.self_attn.q_proj", "model.layers.3.mlp.up_proj".
std::string hf_module_name(std::int64_t l, std::string_view projection) {
  const bool attention = projection == "q_proj" || projection == "k_proj" || projection == "v_proj" || projection == "o_proj";
  return "model.layers." + std::to_string(l) + (attention ? ".self_attn." : ".mlp.") + std::string(projection);
}

// make_llama's model: Hugging Face's projection names, one adapter per projection of a fused layer.
Result<std::vector<LoraAdapterInfo>> adapt_llama(Module& model, const LlamaLayout& c, const LoraOptions& options) {
  const std::int64_t hd = c.head_dim, q = c.heads * hd, kv = c.kv_heads * hd, I = c.intermediate;
  // Each block's linear layers and the Hugging Face projections they hold (rows of the output).
  struct Projection {
    const char* hf;
    const char* linear;  // under h{l}
    std::int64_t begin, end;
  };
  const Projection projections[] = {{"q_proj", "attn.qkv", 0, q},           {"k_proj", "attn.qkv", q, q + kv},
                                    {"v_proj", "attn.qkv", q + kv, q + 2 * kv}, {"o_proj", "attn.proj", 0, c.dim},
                                    {"gate_proj", "mlp.gate_up", 0, I},        {"up_proj", "mlp.gate_up", I, 2 * I},
                                    {"down_proj", "mlp.down", 0, c.dim}};
  const auto linears = linears_of(model);
  auto find = [&](const std::string& path) -> Linear* {
    for (const auto& [p, l] : linears)
      if (p == path) return l;
    return nullptr;
  };
  // Every (layer, projection) a target asks for, then in model order.
  std::vector<std::vector<bool>> wanted(static_cast<std::size_t>(c.layers), std::vector<bool>(std::size(projections)));
  std::vector<std::pair<std::string, Linear*>> other;  // non-block layers (an untied head), by glob
  for (const auto& target : options.targets) {
    const std::string_view bare = std::string_view(target).starts_with("*.") ? std::string_view(target).substr(2) : target;
    bool matched = false;
    // transformers' module names, by PEFT's rule: "q_proj", "self_attn.q_proj",
    // "model.layers.3.self_attn.q_proj" (that block's alone), "lm_head".
    for (std::int64_t l = 0; l < c.layers; ++l)
      for (std::size_t j = 0; j < std::size(projections); ++j)
        if (peft_list_matches(bare, hf_module_name(l, projections[j].hf))) {
          matched = true;
          wanted[static_cast<std::size_t>(l)][j] = true;
        }
    if (peft_list_matches(bare, "lm_head"))
      if (Linear* head = find("head")) {
        matched = true;
        if (std::find(other.begin(), other.end(), std::pair<std::string, Linear*>{"head", head}) == other.end())
          other.emplace_back("head", head);
      }
    if (matched) continue;
    for (const auto& [path, layer] : linears) {
      if (!glob_matches(target, path)) continue;
      bool in_block = false;
      for (std::int64_t l = 0; l < c.layers; ++l)
        for (std::size_t j = 0; j < std::size(projections); ++j)
          if (path == "h" + std::to_string(l) + "." + projections[j].linear) {
            wanted[static_cast<std::size_t>(l)][j] = true;
            in_block = true;
          }
      if (!in_block && std::find(other.begin(), other.end(), std::pair{path, layer}) == other.end()) other.emplace_back(path, layer);
      matched = true;
    }
    if (!matched) return matched_nothing(model, target);
  }
  std::vector<Planned> plan;
  for (std::int64_t l = 0; l < c.layers; ++l)
    for (std::size_t j = 0; j < std::size(projections); ++j) {
      if (!wanted[static_cast<std::size_t>(l)][j]) continue;
      const Projection& p = projections[j];
      const std::string path = "h" + std::to_string(l) + "." + p.linear;
      Linear* layer = find(path);
      if (!layer || layer->out_features() < p.end)
        return fail(ErrorCode::internal, "apply_lora: no linear layer ", path, " of at least ", p.end, " outputs");
      plan.push_back({path, layer, std::string("lora_") + p.hf, p.hf, l, p.begin, p.end});
    }
  for (const auto& [path, layer] : other) plan.push_back({path, layer, "lora", "", -1, 0, layer->out_features()});
  return make_adapters(model, plan, options);
}

}  // namespace

std::vector<std::string> default_lora_targets(Module& model) {
  if (llama_layout(model)) return {"q_proj", "v_proj"};
  bool gpt = false;
  model.for_each_module([&](const std::string& path, Module& m) {
    gpt = gpt || (path.ends_with(".attn.qkv") && dynamic_cast<Linear*>(&m) != nullptr);
  });
  if (gpt) return {"*.attn.qkv"};
  return {};
}

Result<std::vector<LoraAdapterInfo>> apply_lora(Module& model, const LoraOptions& options) {
  COSHARD_TRY(check_options(options));
  if (const auto llama = llama_layout(model)) return adapt_llama(model, *llama, options);
  return adapt_by_glob(model, options);
}

}  // namespace coshard::modules
