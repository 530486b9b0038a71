// Low-rank adapters (LoRA, Hu et al. 2021, as Hugging Face PEFT makes them) on linear layers:
// y = W x + (alpha / rank) * B (A dropout(x)) for the adapted rows of the output, with W (and the
// rest of the model) frozen, A [rank, in] initialised as PEFT does (Kaiming-uniform with
// a = sqrt(5): uniform in +-1/sqrt(in)) and B [rows, rank] zero, so training starts from the base.
//
// An adapter is a child of its Linear (the layer's own parameter names do not change, so a base
// loads from the same files before and after), run by the Linear after its own product through
// the Context's hooks: an engine sees each adapter as a small module of its own (its unit
// coalesced with its neighbours where small), and the base layer as a frozen unit. A fused
// projection (a Llama's qkv, holding Hugging Face's q_proj, k_proj and v_proj) takes one adapter
// per projection it holds, each acting on that projection's rows only.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/modules/layers.hpp"
#include "coshard/modules/module.hpp"

namespace coshard::collectives {
class Communicator;
}

namespace coshard::modules {

// How an adapter of a tensor-parallel layer is split with it (apply_lora chooses it from the
// layer's weight's split, Parameter::split):
//   none: a whole layer.
//   output_rows: a column-parallel layer (its output rows split, its input whole). B holds this
//     rank's rows of the adapter's; A this rank's rows of the rank dimension ([rank / T, in]): the
//     product A x is gathered over the tensor ranks in forward, its gradient summed in backward.
//   input_columns: a row-parallel layer (its input columns split, its output a partial sum that
//     the join sums). A holds this rank's columns; B this rank's rows ([rows / T, rank]), added
//     into those rows of the layer's partial output: the product A x is summed over the tensor
//     ranks in forward, its gradient in backward.
// Either way every parameter of the adapter is a part of the whole adapter (Parameter::split),
// which checkpoints, exports and PEFT folders put back together; the run is the unsplit one's.
enum class LoraSplit : std::uint8_t { none, output_rows, input_columns };

// Where an adapter sits: its layer's inputs and outputs and its rows of that output (this rank's),
// and with tensor parallelism the split, the tensor group and the same in the whole layer.
struct LoraPlacement {
  std::int64_t in = 0, row_begin = 0, row_end = 0, out = 0;
  LoraSplit split = LoraSplit::none;
  collectives::Communicator* group = nullptr;
  std::int64_t whole_in = 0, whole_row_begin = 0, whole_row_end = 0;
  // output_rows: the whole sizes of the layer's segments its rows cover (Parameter::split's
  // segments: a fused layer's projections), empty for one segment.
  std::vector<std::int64_t> row_segments;
};

struct LoraOptions {
  // Which linear layers get adapters: globs over module paths (`*` any run of characters, dots
  // included), as Module::for_each_module names them ("h*.attn.qkv", "*.mlp.*"), or a path's
  // last names as PEFT matches a list entry (the path is the entry or ends in "." + it:
  // "attn.qkv"). With a Llama (apply_lora with its config) transformers' module names are targets
  // too, by the same rule: "q_proj" (every block's), "self_attn.q_proj",
  // "model.layers.3.self_attn.q_proj" (block 3's alone), "lm_head"; the projections are q_proj,
  // k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj. Every target must match at least one
  // linear layer.
  std::vector<std::string> targets;
  std::int64_t rank = 8;  // PEFT's r
  double alpha = 8;       // PEFT's lora_alpha: the adapter's product is scaled by alpha / rank
  double dropout = 0;     // on the adapter's input, in [0, 1)
  std::uint64_t seed = 0;  // the dropout masks' (and nothing else's)
  // A model split for tensor parallelism (make_llama with a group): that group. The adapters of
  // its split layers are split with them (LoraSplit); a split layer targeted without it is
  // refused by name.
  collectives::Communicator* tensor_group = nullptr;
};

// One adapter on rows [row_begin, row_end) of a Linear's output (all of them unless fused).
class LoraAdapter final : public Module {
 public:
  LoraAdapter(std::int64_t in_features, std::int64_t row_begin, std::int64_t row_end, std::int64_t out_features,
              const LoraOptions& options);
  // Anywhere, a tensor-parallel layer's part included (Linear::add_lora checks `where` first).
  LoraAdapter(const LoraPlacement& where, const LoraOptions& options);
  std::string_view type_name() const override { return "LoraAdapter"; }
  // Adds scale * B A dropout(input) into the rows of the output its Linear gave it (add_into),
  // and returns that output.
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  // grad_output is the Linear's whole output gradient: returns this adapter's part of dL/dinput,
  // adding into A's and B's gradients.
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  void clear_saved() override { saved_.clear(); }

  Parameter& a() const noexcept { return *parameters()[0]; }  // "A" [rank, in] (this rank's part of it)
  Parameter& b() const noexcept { return *parameters()[1]; }  // "B" [rows, rank] (this rank's part of it)
  std::int64_t rank() const noexcept { return rank_; }
  std::int64_t row_begin() const noexcept { return row_begin_; }
  std::int64_t row_end() const noexcept { return row_end_; }
  LoraSplit split() const noexcept { return where_.split; }
  // In the whole layer (what a merge folds into: the same as above without tensor parallelism).
  std::int64_t whole_in() const noexcept { return where_.whole_in; }
  std::int64_t whole_row_begin() const noexcept { return where_.whole_row_begin; }
  std::int64_t whole_row_end() const noexcept { return where_.whole_row_end; }
  double alpha() const noexcept { return alpha_; }
  double dropout() const noexcept { return dropout_; }
  float scale() const noexcept { return static_cast<float>(alpha_ / static_cast<double>(rank_)); }

 private:
  friend class Linear;
  struct Saved {
    Tensor input;  // after dropout
    Tensor mask;   // the dropout's (0 or 1 / (1 - p)); empty without dropout
    Tensor product;  // A x, [rows, rank] ([rank, rows] when split by output rows: gathered rank-major)
  };
  Result<Tensor> dropout_mask(Context& ctx, const Tensor& input);
  Result<void> split_parameters();  // (Linear::add_lora: each parameter a part of the whole adapter's)
  // The output_rows split's passes (the others share one code path).
  Result<void> forward_output_rows(Context& ctx, Saved& saved, const Tensor& out);
  Result<Tensor> backward_output_rows(Context& ctx, const Saved& saved, const Tensor& grad_output);
  LoraPlacement where_;
  std::int64_t in_, row_begin_, row_end_, out_, rank_;
  std::int64_t a_rows_;  // A's rows here: rank, or rank / T split by output rows
  double alpha_, dropout_;
  std::uint64_t seed_;
  std::uint64_t forwards_ = 0;  // dropout: each forward's mask from its ordinal
  std::vector<std::uint64_t> pending_;  // the ordinals of forwards whose backward is to come
  Tensor add_into_;  // set by the Linear before each forward
  SavedPerCall<Saved> saved_;
};

// What apply_lora made: each adapter's module path ("h0.attn.qkv.lora_q_proj"), the linear layer
// it adapts, and the Hugging Face projection it stands for in a Llama ("" elsewhere).
struct LoraAdapterInfo {
  std::string path;
  std::string linear;
  std::string hf_projection;
  std::int64_t layer = -1;  // a Llama's block index (-1 elsewhere)
  LoraAdapter* adapter = nullptr;
};

// Adds adapters to every Linear whose path matches a target, and freezes every other parameter
// of the model. A model make_llama built is recognised by its blocks: Hugging Face's projection
// names are targets too, and its fused qkv and gate_up take one adapter per projection they hold
// (any other model: one adapter per matched layer, over all its rows). Errors name the value: a
// target matching nothing, or matching a module that is not a Linear, a rank < 1, a non-positive
// or non-finite alpha, a dropout outside [0, 1), a Linear that already has adapters. Before any
// ParameterStore or engine is made for the model.
Result<std::vector<LoraAdapterInfo>> apply_lora(Module& model, const LoraOptions& options);

// PEFT's rule for a list entry of target_modules (tuners_utils.check_target_module_exists): the
// module's name is `entry`, or ends in "." + `entry`.
bool peft_list_matches(std::string_view entry, std::string_view name) noexcept;
// transformers' name of a Llama block's projection: "model.layers.3.self_attn.q_proj" for q, k, v
// and o, "model.layers.3.mlp.up_proj" for gate, up and down.
std::string llama_module_name(std::int64_t layer, std::string_view projection);
// transformers' name of a mixture-of-experts layer's expert projection: Qwen3-MoE's
// "model.layers.3.mlp.experts.5.gate_proj" (gate_proj, up_proj, down_proj), Mixtral's
// "model.layers.3.block_sparse_moe.experts.5.w1" (w1, w3, w2).
std::string llama_expert_module_name(std::int64_t layer, std::int64_t expert, std::string_view projection);

// PEFT's default targets for a model: q_proj and v_proj for one make_llama built, every
// attention's fused qkv ("*.attn.qkv", GPT-2's c_attn) for one make_gpt built; empty otherwise.
std::vector<std::string> default_lora_targets(Module& model);

}  // namespace coshard::modules
