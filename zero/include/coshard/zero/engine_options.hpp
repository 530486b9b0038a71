// What an Engine is made with (Engine::create): the stage, the fetch and prefetch budgets, hybrid
// sharding, offload of the optimizer and the parameters, step modes and timing; and the checks of
// option sets a configuration layer can run before it builds. engine.hpp has the engine's rules.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <limits>
#include <string>
#include <string_view>

#include "coshard/collectives/communicator.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/modules/optimizer.hpp"

namespace coshard::zero {

using modules::DataType;
using modules::StepControlOptions;

enum class FetchMode : std::uint8_t {
  all_gather,  // each rank sends its shard (default)
  all_reduce,  // zero the buffer, place the local shard, sum (favoured by some interconnects)
};

// What a quantized collective carries (ZeRO++): nothing quantized, or blocks of int8 (int4: the
// gradients' reduction only) with one f32 scale per block.
enum class Quantization : std::uint8_t { none, int8, int4 };
std::string_view to_string(Quantization q) noexcept;

// Where optimizer state or parameters live when offloaded from the compute device.
enum class OffloadTarget : std::uint8_t {
  none,  // on the compute device
  cpu,   // in pinned host memory; the optimizer steps on a CPU stream (ZeRO-Offload)
  nvme,  // on NVMe, streamed through pinned buffers (ZeRO-Infinity)
};
using OptimizerOffload = OffloadTarget;
std::string_view to_string(OffloadTarget t) noexcept;

// Where one kind of state is offloaded, with what that place needs. It reads as its target
// (compared, switched on, printed) and assigning a target keeps the rest.
struct OffloadOptions {
  OffloadTarget device = OffloadTarget::none;
  // nvme: the folder of the swap files (each rank its own). The parameters' shards live in the
  // optimizer's swap files: their own path, when given, must be the same folder.
  std::filesystem::path nvme_path;
  // nvme: pinned buffers streamed through (optimizer: >= 2, one in use, reads ahead, writes
  // behind; parameters: reads ahead along the trace).
  int buffer_count = 4;

  OffloadOptions& operator=(OffloadTarget target) noexcept {
    device = target;
    return *this;
  }
  operator OffloadTarget() const noexcept { return device; }  // NOLINT(google-explicit-constructor)
};

struct EngineOptions {
  // 0: plain data parallelism (parameters, gradients and optimizer state whole on every rank,
  // each unit's gradient all-reduced as its backward ends); 1, 2, 3: ZeRO's stages.
  int zero_stage = 3;
  DataType dtype = DataType::f32;          // parameters, activations, gradients before reduction (shards of gradients and masters are fp32)
  std::size_t module_granularity_bytes = 0;
  std::size_t max_live_bytes = std::numeric_limits<std::size_t>::max();  // gathered parameter bytes
  std::size_t prefetch_bucket_bytes = 0;   // 0: fetch on demand only (unless adaptive)
  // Adaptive prefetch (DeepSpeed's "auto"): how far ahead to gather follows the measured gather
  // time of each unit and compute time at each position of the trace (device timestamps, read one
  // step behind) and the free budget. prefetch_bucket_bytes, when set, caps it. Implies timing.
  bool adaptive_prefetch = false;
  std::size_t max_reuse_distance = 0;      // keep a unit needed again within this many fetches
  // The same in DeepSpeed's measure: keep a unit needed again before this many parameter
  // elements are fetched (stage3_max_reuse_distance). Either rule keeps a unit.
  std::size_t max_reuse_distance_elements = 0;
  std::size_t persistence_threshold_bytes = 0;  // smaller units stay gathered for the whole step
  // Stage 3: a frozen unit (every parameter frozen: a fine-tuned model's base, LoRA's) cannot
  // change within a step, so after a use it stays gathered for the rest of the step (the next
  // micro-batch's forward, its backward) while max_live_bytes keeps room for the largest unit,
  // instead of being gathered again for each use.
  bool keep_frozen_gathered = true;
  FetchMode fetch_mode = FetchMode::all_gather;
  // Stage 3: quantized weight gathers (ZeRO++'s qwZ; DeepSpeed's zero_quantized_weights). Each
  // rank quantizes its shard in blocks of quantize_weights_block elements (int8, symmetric, one
  // f32 scale a block), the gather carries those bytes (about a quarter of f32's, half of
  // bf16's), and every rank dequantizes every piece, its own too, into the compute dtype: all
  // ranks compute with the same weights. The shards, the fp32 masters and the optimizer never see
  // a quantized value; checkpoints, exports and gather_parameters() gather exactly. A block
  // holding inf or NaN comes back all NaN (the loss shows it), never a quiet finite value.
  // none or int8.
  Quantization quantize_weights = Quantization::none;
  // The same for frozen units alone (every parameter frozen: a fine-tuned base, LoRA's;
  // DeepSpeed's zero_quantized_nontrainable_weights): the units that train gather exactly.
  Quantization quantize_frozen_weights = Quantization::none;
  // The elements a scale covers (>= 8: below that the scales outweigh the values they save); a
  // block never spans two parameters (each rank's piece is cut where a parameter begins or ends).
  // Smaller blocks: closer weights, more scales (256: 1.6% over the int8 values).
  std::int64_t quantize_weights_block = 256;
  // Stages 2-3: quantized gradient reduction (ZeRO++'s qgZ; DeepSpeed's zero_quantized_gradients).
  // Each unit's reduce-scatter becomes: every rank quantizes each rank's block of its whole
  // gradient (int8, blocks of quantize_gradients_block elements cut at parameter boundaries, one
  // f32 scale a block), an all-to-all sends each rank the pieces of its own block, and each rank
  // dequantizes and sums them in f32 (in rank order), rounded once into the compute dtype: about a
  // quarter of f32's bytes (half of bf16's). Hybrid sharding's all-reduce across the copies stays
  // exact. The fp32 gradient shard, the norm, clipping and the overflow check see what the
  // reduction gave (a gradient block holding inf or NaN comes back all NaN: the overflow check
  // skips the step as it would). none or int8.
  Quantization quantize_gradients = Quantization::none;
  std::int64_t quantize_gradients_block = 256;
  // Stage 3: a secondary partition of the gathered weights (ZeRO++'s hpZ; DeepSpeed's
  // zero_hpz_partition_size). A unit's first gather of a training step goes over its whole shard
  // group as configured (int8 blocks with quantize_weights); each rank then keeps its slice of the
  // gathered values, 1/N of them, and every later gather of the unit in that step (backward,
  // activation checkpointing's replay, the next micro-batch's forward) gathers the slices within
  // the N consecutive ranks that hold them (one node, under a launcher that numbers ranks node by
  // node), exactly: every use of the step computes with the first gather's values, bit for bit.
  // Shards, optimizer state and gradient reductions stay over the whole group (ZeRO-3's memory,
  // plus the slices: a unit's padded bytes / N on the device). 1: none. N must divide every
  // sharded unit's group (the world, or hybrid sharding's); a unit sharded over N ranks or fewer
  // gathers as it did.
  int secondary_partition_ranks = 1;
  // Timed events around every wait of the compute stream on communication, so each step reports
  // exposed_comm_ms (read after the step from device timestamps, never by a synchronize). A few
  // more events a unit: off by default, on in the Trainer.
  bool timing = false;
  // Also a timeline of the step: compute spans per unit and pass, gathers (fetch or prefetch)
  // and reduce-scatters on the communication stream, waits, releases. Implies timing.
  bool record_timeline = false;
  // Optimizer offload: the fp32 masters and the optimizer's moments of this rank's shards live in
  // pinned host memory and the optimizer steps there (CPU kernels, a stream of its own); each step
  // copies the reduced gradient shards out and the updated shards back. The Optimizer given to
  // create() gets host groups. bf16/f16 parameters: the host step writes them, cast down from the
  // fp32 masters (which stay in ordinary host memory: they never cross), into pinned memory, and
  // half the bytes go back to the device.
  // nvme: the swapped state in offload_optimizer.nvme_path, streamed through buffer_count pinned
  // buffers.
  OffloadOptions offload_optimizer;
  // offload_optimizer=nvme: each unit's master and state stream through the swapper in sub-groups
  // of at most this many elements (DeepSpeed's sub_group_size), so the pinned swap buffers are
  // sized by it rather than by the largest unit (a large vocabulary's embedding: 4.4 GiB of
  // master and AdamW state for Llama-3.2-3B's); rounded up to whole pages of fp32. 0: one
  // sub-group per unit. The same bits whatever the size.
  std::size_t sub_group_size = std::size_t{1} << 26;
  // Pinned host memory the offload may use; 0: exactly what it needs. Too small: create() fails.
  std::size_t host_memory_budget = 0;
  // Parameter offload (ZeRO-Infinity; stage 3, with the optimizer offloaded): this rank's
  // parameter shards leave the device. cpu: a shard is its fp32 master in pinned memory (bf16/f16,
  // or with the optimizer on nvme: a pinned copy in the compute dtype each step refreshes); nvme
  // (needs the optimizer on nvme): a shard is the master at the head of its unit's swap file,
  // rounded to bf16/f16 on the host as its read lands. A gather copies the shard into its place
  // in the gathered buffer and gathers in place; nvme reads run ahead along the trace, at most
  // offload_params.buffer_count at once (pinned buffers of the largest fp32 master, under the budget).
  OffloadOptions offload_params;
  // With offload_params=cpu or offload_optimizer=cpu: the device memory the engine's state may
  // take, in bytes (the memory estimate's device lines: gathered parameters, gradient buffers,
  // parameter shards, optimizer state). Placed unit by unit, in an order that pays: the first and
  // the last units first (alternating inwards), whose gathers open forward and backward with no
  // compute before them to hide behind; the rest are prefetched behind compute.
  // - offload_params=cpu: the shards of as many units as fit stay on the device, the rest in
  //   pinned host memory.
  // - offload_optimizer=cpu (DeepSpeed's Twin-Flow): then, with what is left, the optimizer state
  //   of as many units whose shards are on the device: their fp32 gradient shards, masters and
  //   state stay on the device and they step there, on the compute stream; the rest step on the
  //   host as before. (Shards first: a byte of shard kept saves a copy at every gather, a byte of
  //   state one copy each way a step.) The same bits as either end, but for the gradient norm's
  //   last bit when clipping (its sum is added in two parts).
  // 0: everything offloaded as offload_params and offload_optimizer say. Activations come on top.
  // A budget the rest of the plan already exceeds is refused, naming both.
  std::size_t device_memory_budget = 0;
  // The micro-batches each step will declare, when known ahead (a trainer's gradient
  // accumulation); 0: not known. Only the memory estimate reads it: with the optimizer offloaded,
  // a unit's fp32 gradient shard is on the device only from its reduction until it is out in
  // pinned memory when a step has one micro-batch (the estimate counts the two largest), and for
  // the whole step otherwise (every shard).
  int expected_micro_batches = 0;
  // With offload_optimizer=cpu or nvme at stages 2-3: each unit's shard is stepped on the CPU
  // stream as soon as its last gradient shard of the step is out, while backward goes on, instead
  // of after the whole backward. cpu: the updated shards go back to the device after backward.
  // nvme: one pass of the swapper runs beside forward and backward, reading each sub-group ahead
  // in the order the units' gradients came last step and writing it back once stepped; the new
  // shard goes to the device on the communication stream as soon as it is stepped; no gradient
  // shard is kept in pinned memory: each stays on the device until the pass copies its pieces into
  // their swap buffers (also when a step of several micro-batches steps after backward). It
  // needs gradient clipping off and no loss scaling (each update then depends on its own unit's
  // gradients alone), and gives the same bits. A step with more than one micro-batch steps after
  // backward. A non-finite gradient cannot skip units already stepped: such a step fails on
  // every rank, naming it, instead of being skipped (restore a checkpoint).
  bool step_in_backward = false;
  // With offload_optimizer=nvme and without step_in_backward: the gradient shards are swapped to
  // NVMe (DeepSpeed ZeRO-Infinity's gradient swapping) instead of kept in pinned memory until the
  // optimizer's pass: each unit's shard is written into its swap file (a region after the master
  // and state) by a pass of the swapper beside backward as soon as it is reduced, its statistics
  // added there, and leaves the device; after backward the norm is summed over the ranks and the
  // optimizer's pass reads each sub-group's gradient with its master and state. Gradient clipping
  // and loss scaling work as without it. Costs the gradients' bytes written and read once a step;
  // saves their pinned memory (this rank's fp32 shards). With step_in_backward the gradients
  // already skip pinned memory (through the swapper's pass): it has no effect there.
  bool swap_gradients = false;
  // create() refuses a plan whose memory estimate (memory_estimate.hpp: parameters, gradients,
  // optimizer state, offload buffers, swap files) this machine cannot hold now, naming the bytes,
  // before it allocates anything. Off: build anyway (the estimate is a model of what is held).
  bool check_memory = true;
  // Hybrid sharding (PyTorch's HSDP, DeepSpeed's MiCS), stages 1-3: each unit is sharded over a
  // group of this many consecutive ranks (ranks [g * size, (g + 1) * size)) and replicated
  // across the world / size groups. Gathers stay within the group; a gradient is
  // reduce-scattered within it, then all-reduced across the copies (ranks holding the same
  // block); each rank steps its block. A size that fills one node keeps every gather on the
  // node's links and sends each gradient shard once across nodes. 0: the whole world (full
  // sharding, the default); it must divide the world size. Stage 0 shards nothing: any
  // valid size gives the same training.
  int shard_group_size = 0;
  // Per module: the shard group size for the parameters of the module at this path ("" is the
  // model itself), 0 for shard_group_size. Units never mix sizes (experts over 2 ranks and the
  // dense layers over 8, say). Every rank must answer alike: create() checks that they do.
  std::function<int(std::string_view module_path)> shard_group_size_of;
  // Tensor parallelism beside ZeRO (a 2-D mesh, collectives/mesh.hpp): the tensor ranks this
  // rank's model is split over (modules/tensor_parallel.hpp), while the engine's communicator is
  // this rank's data-parallel group. The clipping norm and the overflow flag are summed over both;
  // a replicated parameter (no Parameter::split) counts on tensor rank 0 only, and never shares
  // a unit with a split one. Null or one rank: none. Set by create(ctx, mesh, ...); it must
  // outlive the engine.
  collectives::Communicator* tensor_parallel = nullptr;
};

// Where parameters may be offloaded given the rest (Engine::create checks it; a configuration
// layer can check it before building): the first rule broken, named.
Result<void> check_offload_placement(const EngineOptions& o);
// The secondary partition's size given the rest at `world` ranks (0: the world is not known yet,
// as when a configuration is read; the rules that need it wait): the first rule broken, named.
Result<void> check_secondary_partition(const EngineOptions& o, int world);
// Whether step_in_backward can go with the rest (the optimizer's clipping and loss scaling among
// them): the first rule broken, named. Engine::create checks it; so can a configuration layer.
Result<void> check_step_in_backward(const EngineOptions& o, const StepControlOptions& control);
// Whether swap_gradients can go with the offload asked for (offload_optimizer=nvme).
Result<void> check_swap_gradients(const EngineOptions& o);
// Whether the quantized gathers and gradients asked for can be had (weights: stage 3, all_gather
// fetches; gradients: stages 2-3; int8, a block of at least 8): the first rule broken, named.
Result<void> check_quantized_gathers(const EngineOptions& o);

}  // namespace coshard::zero
