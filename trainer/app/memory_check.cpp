#include "memory_check.hpp"

#include "coshard/collectives/local.hpp"
#include "coshard/collectives/mesh.hpp"
#include "coshard/trainer/memory.hpp"

namespace coshard::train_app {

using zero::format_bytes;
using zero::MemoryPlace;

Result<RunMemory> estimate_run(const trainer::TrainerConfig& c, const RunShape& shape) {
  // Tensor parallelism: a rank holds its part of the model (built over a group of the tensor size
  // on the Local backend: shapes only, every rank's part the same), ZeRO shards it over the data
  // ranks, and its activations are those of a Llama of its heads, MLP slice and vocabulary slice.
  const int tensor = c.tensor_parallel_size;
  COSHARD_TRY(collectives::validate(collectives::MeshShape{.tensor = tensor}, shape.world));
  std::vector<std::unique_ptr<collectives::Communicator>> group;
  if (tensor > 1) {
    COSHARD_TRY_ASSIGN(group, collectives::make_local_communicators(tensor));
  }
  COSHARD_TRY_ASSIGN(auto model, tensor > 1 ? shape.model.build(*group.front()) : shape.model.build());
  // (the frozen base holds no gradient, master or state; a split model's adapters split with it)
  COSHARD_TRY(trainer::apply_lora(c, *model, tensor > 1 ? group.front().get() : nullptr));
  for (const auto& pattern : c.freeze)  // (frozen units hold no gradient, master or state)
    if (auto frozen = model->set_trainable_matching(pattern, false); !frozen)
      return fail(std::move(frozen).error().with_context("freeze"));
  const int data = shape.world / tensor;
  const std::int64_t rows = shape.batch / data;
  ModelChoice part = shape.model;
  if (tensor > 1) {
    part.llama.heads /= tensor;
    part.llama.kv_heads /= tensor;
    part.llama.intermediate /= tensor;
    part.llama.vocab /= tensor;
    if (part.llama.head_dim == 0) part.llama.head_dim = shape.model.llama.resolved_head_dim();
  }
  trainer::MemoryInputs in;
  in.rows_per_rank = rows;
  in.seq = shape.seq;
  in.activation_bytes = part.activation_bytes(rows / c.gradient_accumulation_steps, shape.seq, c.engine_options().dtype,
                                              c.activation_checkpointing, shape.device, c.attention,
                                              c.chunked_cross_entropy_bytes(shape.device));
  in.checkpoints = shape.checkpoints;
  in.export_model = shape.export_model;
  RunMemory out;
  COSHARD_TRY_ASSIGN(out.per_rank, trainer::estimate_memory(c, *model, data, in));
  // Each rank draws the step's global batch on the host, then takes its rows (i32 ids and targets).
  out.per_rank.add(MemoryPlace::pageable_host, "host batches (the global batch, this rank's rows)",
                   static_cast<std::size_t>(shape.batch + rows) * static_cast<std::size_t>(shape.seq) * 8);
  auto machine = zero::machine_memory(shape.device, c.engine_options().offload_optimizer == zero::OffloadTarget::nvme
                                                           ? c.offload_optimizer.nvme_path
                                                           : std::filesystem::path());
  if (machine) out.machine = std::move(*machine);
  else out.machine_error = machine.error().message();
  return out;
}

std::string describe_run(const RunMemory& m, const RunShape& shape, const trainer::TrainerConfig& c) {
  std::string out = "memory estimate: " + std::to_string(shape.model.parameter_count()) + "-parameter " +
                    shape.model.describe() + ", seq " + std::to_string(shape.seq) + ", ZeRO-" +
                    std::to_string(c.zero_stage) + ", " + std::to_string(shape.world) + " rank(s)" +
                    (c.tensor_parallel_size > 1 ? " (data " + std::to_string(shape.world / c.tensor_parallel_size) +
                                                      " x tensor " + std::to_string(c.tensor_parallel_size) + ")"
                                                : std::string()) +
                    " on " +
                    shape.device.to_string() + ", " + std::string(collectives::to_string(c.engine_options().dtype)) +
                    ", global batch " + std::to_string(shape.batch) +
                    (c.activation_checkpointing.enabled() ? ", activation checkpointing " + c.activation_checkpointing.to_string() : "") +
                    "\n";
  out += "per rank:\n" + m.per_rank.describe();
  const auto n = static_cast<std::size_t>(shape.ranks_here);
  out += "this process (" + std::to_string(n) + " rank" + (n == 1 ? "" : "s") + "):";
  for (const MemoryPlace place : {MemoryPlace::device, MemoryPlace::pinned_host, MemoryPlace::pageable_host, MemoryPlace::nvme})
    if (const std::size_t b = m.per_rank.bytes(place); b > 0)
      out += " " + std::string(zero::to_string(place)) + " " + format_bytes(b * n) + ";";
  out.back() = '\n';
  out += "machine: " + (m.machine ? m.machine->describe() : "unknown (" + m.machine_error + ")") + "\n";
  return out;
}

Result<void> check_run(const RunMemory& m, const RunShape& shape) {
  if (!m.machine) return {};
  return zero::check_fits(m.per_rank, shape.ranks_here, *m.machine);
}

Result<AttentionChoice> choose_attention(const trainer::TrainerConfig& config, const RunShape& shape,
                                         RunMemory as_configured) {
  AttentionChoice kept{config.attention, std::move(as_configured)};
  if (shape.device.is_cpu() || config.attention != modules::AttentionKernels::fused ||
      shape.model.head_dim() < kMaterializedFromHeadSize ||
      !modules::attention_is_fused(shape.device, config.engine_options().dtype, shape.model.head_dim(),
                                   modules::AttentionKernels::fused))
    return kept;
  trainer::TrainerConfig materialized = config;
  materialized.attention = modules::AttentionKernels::materialized;
  COSHARD_TRY_ASSIGN(RunMemory memory, estimate_run(materialized, shape));
  if (!fits_with_headroom(memory, shape.ranks_here) || !check_run(memory, shape)) return kept;
  return AttentionChoice{modules::AttentionKernels::materialized, std::move(memory)};
}

}  // namespace coshard::train_app
