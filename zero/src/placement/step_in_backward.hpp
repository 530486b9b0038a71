// What becomes of an offloaded unit's gradient shard during backward, when a step has one
// micro-batch (StepMode::grads_out_in_backward): copied out to pinned memory right after its
// reduction and, with step_in_backward, stepped on the host as soon as its last shard of the
// step is out, while backward goes on; with the optimizer on nvme, handed instead to one pass of
// the swapper that runs beside forward and backward (SwapPass): it reads each unit's sub-group
// ahead and steps it when the unit arrives (step_in_backward), or writes the unit's gradient
// shard into its swap file (swap_gradients). Private: not installed.
#pragma once

#include <optional>
#include <vector>

#include "coshard/async/channel.hpp"
#include "coshard/async/join_handle.hpp"
#include "placement/optimizer_placement.hpp"

namespace coshard::zero::detail {

// u's gradient shard has just been reduced on the communication stream in a step whose shards
// leave during backward: to pinned memory (unless a pass of the swapper takes it from the
// device), then stepped on the host or handed to the pass once its last backward is done.
Result<void> shard_reduced(const OptimizerWiring& w, OptimizerPlacement& placement, FetchUnit& u);

// After a step_in_backward step whose optimizer report says it was skipped (the overflow flag is
// summed over ranks, so every rank reads the same): the units stepped during backward cannot be
// skipped any more, so the step fails, on every rank alike.
Result<void> step_in_backward_saw_non_finite(const OptimizerWiring& w);

// One pass of the swapper beside forward and backward (optimizer on nvme with step_in_backward or
// swap_gradients), fed the units as their gradient shards are ready. It goes in the order the
// units came last step (reverse unit order at first: backward goes roughly that way).
class SwapPass {
 public:
  // Spawns the pass: stepping each unit as it comes at `lr` (StepMode::stepping_in_backward), or
  // writing its gradient out (grads_to_nvme).
  Result<void> start(OptimizerWiring w, float lr);
  bool running() const noexcept { return pass_.valid(); }
  // Unit u goes to the pass (its gradient shard out, or still on the device for the pass to take).
  // A pass that failed (an I/O error) is gone: backward goes on regardless, so that the step fails
  // where stepping after backward would, with every rank's collectives launched alike, when the
  // pass is awaited (with its error).
  Result<void> hand_over(const OptimizerWiring& w, FetchUnit& u);
  // Every unit is handed over: the pass ends at the last.
  void all_handed_over() { ready_.reset(); }
  // Awaits the pass (its error, if any), and keeps the order the units came in for the next step.
  async::Task<Result<void>> finish();
  // The step failed before the pass was awaited: with the channel closed, the pass stops at the
  // first unit not handed over, and its transfers finish before the engine goes on.
  async::Task<void> abandon();
  // With grads_through_pass the shards handed to the pass wait on the device until it steps them:
  // a unit's backward waits here while those pending would pass the two largest units' shards
  // (`limit`, set by the NVMe placement), for the pass's next tick (a piece stepped, or an arrival
  // awaited). It never waits while the pass awaits an arrival (that could be this very unit).
  async::Task<Result<void>> wait_before_backward(const OptimizerWiring& w, const FetchUnit& u);
  std::size_t pending_limit = 0;
  // A piece of unit u's gradient shard from the device into `piece` (pinned, f32) on the
  // communication stream, after its reduction; the host stream after the copy, the piece's
  // statistics added there; the device shard given back after its last piece.
  Result<void> take_gradient_piece(const OptimizerWiring& w, FetchUnit& u, const SwapPiece& p, const modules::Tensor& piece);

 private:
  // The sub-groups of the pass, in the order it expects their units to arrive. Trained units only.
  std::vector<std::size_t> pieces_in_expected_order(const OptimizerWiring& w) const;
  // The pass awaits unit k's arrival through `ready` (noting in `arrived` every unit that comes
  // meanwhile), telling a waiting backward through `ticks`; fails when `ready` closes first (the
  // step ended before the unit came).
  async::Task<Result<void>> await_arrival(const OptimizerWiring& w, std::size_t k, async::Receiver<std::size_t>& ready,
                                          std::vector<bool>& arrived, async::Sender<char>& ticks);
  async::Task<Result<void>> step_as_units_arrive(OptimizerWiring w, async::Receiver<std::size_t> ready, float lr,
                                                 async::Sender<char> ticks);
  async::Task<Result<void>> write_gradients_out(OptimizerWiring w, async::Receiver<std::size_t> ready,
                                                async::Sender<char> ticks);

  std::optional<async::Sender<std::size_t>> ready_;
  async::JoinHandle<Result<void>> pass_;
  std::vector<std::size_t> last_order_, handed_order_;
  std::size_t pending_bytes_ = 0;
  bool awaits_arrival_ = false;
  std::optional<async::Receiver<char>> ticks_;
};

// nvme (optimizer_on_nvme.cpp): sub-group i's piece of its unit's shard (params: the shard's
// piece, or the master on nvme) with its master and state, as views of the swap buffer `bytes`.
UnitShard swapped_shard(const OptimizerWiring& w, std::size_t i, std::span<std::byte> bytes);
// nvme: sub-group i stepped on the host stream, and the new piece of the shard copied to the
// device on `to` (the buffer goes back to the swapper, to be written and reused, only after that
// copy). nvme parameters: the master in the file is the shard.
async::Task<Result<void>> step_swapped_piece(const OptimizerWiring& w, std::size_t i, std::span<std::byte> bytes,
                                             float lr, async::Stream& to);

}  // namespace coshard::zero::detail
