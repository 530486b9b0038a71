// The output layer's product fused with the cross-entropy over it (private to the layers): what a
// FusedCrossEntropyLoss shares with the layer it is attached to (a Linear or a tied
// TokenEmbedding). When targets are set, the layer's forward gives the loss, made a chunk of
// vocabulary columns at a time: each chunk's logits [N, Vc] are one product and one pass of
// chunk_ce_sums, and only the rows' running max and sums stay. Its backward makes each chunk's
// logits again, turns them into their gradient in place, and adds the chunk's products into the
// weight's gradient (rows [first, first + Vc), one product each, as unchunked) and into the
// input's gradient (summed over the chunks unrounded, in the stat dtype, rounded once). The whole
// logits are never held: the peak is one chunk.
#pragma once

#include <cstdint>
#include <string_view>

#include "coshard/modules/module.hpp"

namespace coshard::modules::detail {

class OutputLoss {
 public:
  explicit OutputLoss(std::int64_t chunk_bytes) noexcept : chunk_bytes_(chunk_bytes) {}

  // Set by the loss: the targets of the layer's next forward (consumed by it), or none.
  void set_targets(Tensor targets) noexcept { targets_ = std::move(targets); }
  const Tensor& targets() const noexcept { return targets_; }
  // Whether the layer's next forward gives the loss (attached, targets set).
  bool armed() const noexcept { return attached_ && static_cast<bool>(targets_); }
  void set_attached(bool attached) noexcept { attached_ = attached; }
  bool attached() const noexcept { return attached_; }

  // The layer's product and the loss: hidden [..., in] through w [vocab, in] (+ bias [vocab]).
  // Returns the loss (one stat-dtype element) and keeps what backward needs.
  Result<Tensor> forward(Context& ctx, Tensor hidden, const Parameter& w, const Parameter* bias, std::int64_t in,
                         std::int64_t vocab, std::string_view who);
  // Whether the layer's last forward was this one's (its backward is then this one's).
  bool holds_forward() const noexcept { return static_cast<bool>(saved_.hidden); }
  // dL/dhidden for the loss's seed, adding into w's (and bias's) gradient where they train.
  Result<Tensor> backward(Context& ctx, const Tensor& seed, const Parameter& w, const Parameter* bias, std::int64_t in,
                          std::int64_t vocab, std::string_view who);
  // Whether `value` is the loss the last forward gave (the loss module passes it on, and takes it).
  bool produced(const Tensor& value) const noexcept {
    return value && saved_.loss && value.data() == saved_.loss.data();
  }
  void take() noexcept { taken_ = true; }
  // Whether a loss this layer gave was dropped (its module's saved state cleared) before the loss
  // module took it: the layer inside activation checkpointing, or clear_saved between the forwards.
  bool dropped() const noexcept { return dropped_; }
  // The module's clear_saved.
  void clear_saved() noexcept {
    if (saved_.loss && !taken_) dropped_ = true;
    saved_ = {};
  }
  // A forward of the layer's own (logits): what an earlier fused forward left no longer counts.
  void forget() noexcept {
    saved_ = {};
    dropped_ = false;
  }
  void clear() noexcept {
    saved_ = {};
    targets_ = {};
    dropped_ = false;
  }

  // The columns of one chunk for `rows` rows of `dt` logits in a vocabulary of `vocab`: as many
  // as chunk_bytes holds (a multiple of 64 above 64), at least 1, at most vocab.
  std::int64_t chunk_columns(std::int64_t rows, DataType dt, std::int64_t vocab) const noexcept;
  std::int64_t chunk_bytes() const noexcept { return chunk_bytes_; }
  // The chunks the last forward made (0 before any).
  std::int64_t last_chunks() const noexcept { return last_chunks_; }

 private:
  struct Saved {
    Tensor hidden, targets, max, sums, loss;
  };
  std::int64_t chunk_bytes_;
  bool attached_ = false;
  Tensor targets_;
  Saved saved_;
  bool taken_ = false, dropped_ = false;
  std::int64_t last_chunks_ = 0;
};

}  // namespace coshard::modules::detail
