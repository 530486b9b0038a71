#include "coshard/trainer/memory.hpp"

namespace coshard::trainer {

Result<zero::MemoryEstimate> estimate_memory(const TrainerConfig& c, modules::Module& model, int world_size,
                                                const MemoryInputs& in) {
  COSHARD_TRY(c.validate());
  if (in.rows_per_rank < 0 || in.seq < 0)
    return fail(ErrorCode::invalid_argument, "memory estimate: ", in.rows_per_rank, " rows of ", in.seq,
                " tokens a rank: expected counts >= 0");
  const std::size_t states = c.optimizer == OptimizerKind::adamw ? 2 : c.momentum != 0 ? 1 : 0;
  COSHARD_TRY_ASSIGN(const zero::EngineOptions o, c.engine_options_for(model, world_size));
  COSHARD_TRY_ASSIGN(auto m, zero::estimate_engine_memory(model, world_size, o, states));
  using P = zero::MemoryPlace;
  // Every micro-batch of the step is uploaded at once: token ids and targets, i32 each.
  m.add(P::device, "batch (token ids and targets)",
        static_cast<std::size_t>(in.rows_per_rank) * static_cast<std::size_t>(in.seq) * 2 * sizeof(std::int32_t));
  m.add(P::device, "activations (one micro-batch)", in.activation_bytes);
  std::size_t shards = 0, trained_shards = 0, numel = 0;
  COSHARD_TRY_ASSIGN(const auto units, zero::plan_units(model, world_size, o, states));
  for (const auto& u : units) {
    shards += static_cast<std::size_t>(u.shard);
    if (!u.frozen) trained_shards += static_cast<std::size_t>(u.shard);
    numel += static_cast<std::size_t>(u.numel);
  }
  const std::size_t e = modules::size_of(o.dtype);
  if (in.checkpoints) {
    // A rank's file: its parameter blocks, the fp32 masters when apart from them, and the state
    // (frozen units: their parameters only).
    const bool master = o.dtype != modules::DataType::f32 || o.offload_optimizer != zero::OffloadTarget::none;
    m.add(P::pinned_host, "checkpoint staging", shards * e + trained_shards * ((master ? 4 : 0) + 4 * states));
  }
  // (tensor parallelism: the parts put together; the replicated parameters counted as if split too)
  if (in.export_model)
    m.add(P::pageable_host, "export (the whole model, gathered)", numel * e * static_cast<std::size_t>(c.tensor_parallel_size));
  return m;
}

}  // namespace coshard::trainer
