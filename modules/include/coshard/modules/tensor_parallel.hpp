// Tensor parallelism (Megatron-LM's split of a transformer over `group`, the tensor ranks).
//
// A column-parallel Linear keeps rows of the whole weight (each rank's slice of the outputs:
// its attention heads, its slice of the MLP); a row-parallel Linear keeps the matching columns
// (its slice of the inputs) and gives a partial sum. Two modules around such a pair move the
// gradients and the partial sums, each one all-reduce:
//   TensorParallelFork (Megatron's f): forward hands the replicated input on unchanged; backward
//     sums the input's gradient over the tensor ranks (each rank's slice contributed a part).
//   TensorParallelJoin (Megatron's g): forward sums the partial outputs over the tensor ranks;
//     backward hands the gradient on unchanged (every rank needs all of it).
// The embedding and the output layer split the vocabulary (rows of the table) and
// VocabParallelCrossEntropyLoss takes the logits' columns as they are split: it never gathers
// them (two all-reduces of N and 2N statistics instead of N x vocab logits).
//
// Each all-reduce is enqueued on the group's communication stream after the compute stream's
// work, and the compute stream waits for its event: the host never waits. The parameters keep
// their whole names ("h0.attn.qkv.weight") with the part's shape, and say which part they are
// (Parameter::split): they start from the unsplit model's initial values, and checkpoints and
// exports can put the whole back together. Everything else (norms) is replicated: every tensor
// rank holds and computes the same values.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/llama_layers.hpp"

namespace coshard::modules {

// The tensor ranks' sum of `input` (a new tensor; `input` is left as it was), on `group`'s
// stream, ordered after ctx's stream and before what ctx's stream does next (through the
// context's hooks: an engine times the wait). `purpose` names it in errors, the flight recorder
// and the timeline, and must outlive the step. A group of one rank returns `input`.
Result<Tensor> sum_over_tensor_ranks(Context& ctx, collectives::Communicator& group, const Tensor& input,
                                     const std::string& purpose);
// The tensor ranks' `input`s one after the other, rank-major along the first dimension ([N, ...]
// from each of T ranks: [T N, ...]), ordered as sum_over_tensor_ranks. A group of one rank
// returns `input`.
Result<Tensor> gather_over_tensor_ranks(Context& ctx, collectives::Communicator& group, const Tensor& input,
                                        const std::string& purpose);

// Megatron's f: identity forward, the sum over the tensor ranks backward.
class TensorParallelFork final : public Module {
 public:
  TensorParallelFork(collectives::Communicator& group, std::string purpose)
      : group_(&group), purpose_(std::move(purpose)) {}
  std::string_view type_name() const override { return "TensorParallelFork"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;

 private:
  collectives::Communicator* group_;
  std::string purpose_;
};

// Megatron's g: the sum over the tensor ranks forward, identity backward.
class TensorParallelJoin final : public Module {
 public:
  TensorParallelJoin(collectives::Communicator& group, std::string purpose)
      : group_(&group), purpose_(std::move(purpose)) {}
  std::string_view type_name() const override { return "TensorParallelJoin"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;

 private:
  collectives::Communicator* group_;
  std::string purpose_;
};

// Whether `whole` splits into `parts` equal pieces; the error names `what` ("the 4 key/value
// heads") and both numbers.
Result<void> check_divides(std::int64_t whole, std::int64_t parts, std::string_view what);

// A Linear of this rank's rows of a whole [sum(out_segments), in] weight: each output segment
// (q | k | v of a fused projection, say) split evenly over the group, this rank's piece of each in
// order. Refused by name when a segment does not divide.
Result<std::unique_ptr<Linear>> column_parallel_linear(std::int64_t in_features, std::span<const std::int64_t> out_segments,
                                                       bool bias, Init weight_init, collectives::Communicator& group);
// A Linear of this rank's columns of a whole [out, in] weight, without a bias (a bias would be
// added once, after the sum): its output is a partial sum for a TensorParallelJoin.
Result<std::unique_ptr<Linear>> row_parallel_linear(std::int64_t in_features, std::int64_t out_features,
                                                    Init weight_init, collectives::Communicator& group);
// A TokenEmbedding of this rank's rows [rank * vocab / size, (rank + 1) * vocab / size) of the
// whole table: forward gives zeros for other ranks' tokens (a TensorParallelJoin sums them), and
// as a tied output layer this rank's columns of the logits.
Result<std::unique_ptr<TokenEmbedding>> vocab_parallel_embedding(std::int64_t vocab, std::int64_t dim, Init init,
                                                                 collectives::Communicator& group);

// Mean softmax cross-entropy over logits [..., V / size] that are this rank's columns
// [rank * V / size, (rank + 1) * V / size) of a vocabulary of V, against the whole targets: the
// same loss and gradients as CrossEntropyLoss on the whole logits, from two all-reduces of
// per-row statistics (the max, then the sum of exponentials and the target's logit).
class VocabParallelCrossEntropyLoss final : public Loss {
 public:
  // `vocab` 0: the logits' columns times the group's size.
  explicit VocabParallelCrossEntropyLoss(collectives::Communicator& group, std::int64_t vocab = 0)
      : group_(&group), vocab_(vocab) {}
  std::string_view type_name() const override { return "VocabParallelCrossEntropyLoss"; }
  void set_targets(Tensor targets) override { targets_ = std::move(targets); }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor logits) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor seed) override;
  void clear_saved() override { saved_ = {}; }

 private:
  struct Saved {
    Tensor logits, max, sums;
  };
  collectives::Communicator* group_;
  std::int64_t vocab_;
  Tensor targets_;
  Saved saved_;
};

}  // namespace coshard::modules
