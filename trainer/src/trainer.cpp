#include "coshard/trainer/trainer.hpp"

#include "coshard/trainer/tensorboard.hpp"

#include <nlohmann/json.hpp>

#include <chrono>
#include <cmath>
#include <optional>

#include "coshard/async/json_limits.hpp"
#include "coshard/modules/tensor_parallel.hpp"
#include "coshard/async/log.hpp"
#include "rank_agreement.hpp"
#include "coshard/modules/moe.hpp"
#include "moe_metrics.hpp"
#include "step_metrics.hpp"
#include "coshard/trainer/settings.hpp"
#include "trainer_impl.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/sync.hpp"
#include "coshard/async/stream.hpp"

namespace coshard::trainer {

using modules::DataType;
using modules::Shape;
using modules::Tensor;

std::span<const StepMetric> step_metrics() noexcept {
  using json = nlohmann::json;
  static constexpr StepMetric metrics[] = {
      {"step", "", false, [](const StepStats& s) { return json(s.step); }},
      {"loss", "train/loss", false, [](const StepStats& s) { return json(s.loss); }},
      {"tokens_per_s", "perf/tokens_per_s", false, [](const StepStats& s) { return json(s.tokens_per_s); }},
      {"step_ms", "perf/step_ms", false, [](const StepStats& s) { return json(s.step_ms); }},
      {"tokens", "", false, [](const StepStats& s) { return json(s.tokens); }},
      {"lr", "train/lr", false, [](const StepStats& s) { return json(s.lr); }},
      {"gathered_bytes", "comm/gathered_bytes", false, [](const StepStats& s) { return json(s.gathered_bytes); }},
      // (the secondary partition's gathers within a node: not in gathered_bytes)
      {"secondary_gathered_bytes", "comm/secondary_gathered_bytes", false,
       [](const StepStats& s) { return json(s.secondary_gathered_bytes); }},
      {"reduce_scattered_bytes", "comm/reduce_scattered_bytes", false,
       [](const StepStats& s) { return json(s.reduce_scattered_bytes); }},
      {"peak_gathered_bytes", "memory/peak_gathered_bytes", false, [](const StepStats& s) { return json(s.peak_live_bytes); }},
      {"peak_prefetched_bytes", "", false, [](const StepStats& s) { return json(s.peak_prefetched_bytes); }},
      {"peak_activation_bytes", "memory/peak_activation_bytes", false,
       [](const StepStats& s) { return json(s.peak_activation_bytes); }},
      {"peak_memory_bytes", "memory/peak_bytes", false, [](const StepStats& s) { return json(s.peak_memory_bytes); }},
      {"blocking_waits", "perf/blocking_waits", false, [](const StepStats& s) { return json(s.blocking_waits); }},
      {"swap_bytes", "offload/swap_bytes", false, [](const StepStats& s) { return json(s.swap_bytes); }},
      {"prefetch_hit_rate", "zero/prefetch_hit_rate", false, [](const StepStats& s) { return json(s.hit_rate()); }},
      // timing off: unknown, never a made-up 0
      {"exposed_comm_ms", "perf/exposed_comm_ms", true,
       [](const StepStats& s) { return s.exposed_comm_ms ? json(*s.exposed_comm_ms) : json(); }},
      {"collective_launches", "", false, [](const StepStats& s) { return json(s.collective_launches); }},
      // Where the step went (zero::StepTimeSplit): busy time of the CPU streams (absent on CUDA),
      // and with NVMe offload what the disk moved and how long it was busy.
      {"compute_ms", "perf/compute_ms", false,
       [](const StepStats& s) { return s.time_split.compute_ms ? json(*s.time_split.compute_ms) : json(); }},
      {"compute_idle_ms", "perf/compute_idle_ms", false,
       [](const StepStats& s) { return s.time_split.compute_idle_ms() ? json(*s.time_split.compute_idle_ms()) : json(); }},
      {"optimizer_ms", "perf/optimizer_ms", false,
       [](const StepStats& s) { return s.time_split.optimizer_ms ? json(*s.time_split.optimizer_ms) : json(); }},
      {"nvme_read_bytes", "offload/nvme_read_bytes", false,
       [](const StepStats& s) { return s.time_split.nvme ? json(s.time_split.nvme_read_bytes) : json(); }},
      {"nvme_written_bytes", "offload/nvme_written_bytes", false,
       [](const StepStats& s) { return s.time_split.nvme ? json(s.time_split.nvme_written_bytes) : json(); }},
      {"nvme_read_ms", "offload/nvme_read_ms", false,
       [](const StepStats& s) { return s.time_split.nvme ? json(s.time_split.nvme_read_ms) : json(); }},
      {"nvme_write_ms", "offload/nvme_write_ms", false,
       [](const StepStats& s) { return s.time_split.nvme ? json(s.time_split.nvme_write_ms) : json(); }},
      {"nvme_busy_ms", "offload/nvme_busy_ms", false,
       [](const StepStats& s) { return s.time_split.nvme ? json(s.time_split.nvme_busy_ms) : json(); }},
      {"grad_norm", "train/grad_norm", false, [](const StepStats& s) { return json(s.optimizer.grad_norm); }},
      {"loss_scale", "train/loss_scale", false, [](const StepStats& s) { return json(s.optimizer.loss_scale); }},
      {"skipped", "", false, [](const StepStats& s) { return json(s.optimizer.last_skipped); }},
      {"trace_changed", "", false, [](const StepStats& s) { return json(s.trace_changed); }},
      // A mixture of experts' (absent for a dense model): the per-layer lists in the file alone,
      // each layer a TensorBoard scalar of its own (tensorboard_scalars).
      {"aux_loss", "train/aux_loss", false, [](const StepStats& s) { return s.aux_loss ? json(*s.aux_loss) : json(); }},
      {"moe_layers", "", false, [](const StepStats& s) { return s.moe_layers.empty() ? json() : json(s.moe_layers); }},
      {"experts_used", "", false,
       [](const StepStats& s) { return s.experts_used.empty() ? json() : json(s.experts_used); }},
      {"largest_expert_share", "", false,
       [](const StepStats& s) { return s.largest_expert_share.empty() ? json() : json(s.largest_expert_share); }},
      // (only on the steps that evaluate)
      {"val_loss", "val/loss", false, [](const StepStats& s) { return s.val_loss ? json(*s.val_loss) : json(); }},
  };
  return metrics;
}

std::string to_json_line(const StepStats& s) {
  nlohmann::ordered_json j;
  for (const auto& m : step_metrics()) {
    auto value = m.value(s);
    if (!value.is_null() || m.null_when_absent) j[std::string(m.key)] = std::move(value);
  }
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

Trainer::Trainer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Trainer::Trainer(Trainer&&) noexcept = default;
Trainer& Trainer::operator=(Trainer&&) noexcept = default;
Trainer::~Trainer() = default;

Result<void> Trainer::set_timeline_epoch(async::Event epoch) { return impl_->engine->set_timeline_epoch(std::move(epoch)); }
std::int64_t Trainer::steps_done() const noexcept { return impl_->engine->steps_done(); }
const TrainerConfig& Trainer::config() const noexcept { return impl_->config; }
int Trainer::rank() const noexcept { return impl_->comm->rank(); }
int Trainer::world_size() const noexcept { return impl_->comm->size(); }
int Trainer::world_rank() const noexcept { return impl_->world_rank; }
zero::Engine& Trainer::engine() noexcept { return *impl_->engine; }
modules::Context& Trainer::context() noexcept { return *impl_->ctx; }
modules::Loss& Trainer::loss() noexcept { return *impl_->loss; }
bool Trainer::cross_entropy_chunked() const noexcept { return impl_->own_chunked_loss != nullptr; }

Result<std::vector<modules::Batch>> upload_micro_batches(modules::Context& ctx, const HostBatch& rows, int k) {
  if (rows.rows <= 0 || rows.seq <= 0)
    return fail(ErrorCode::invalid_argument, "Trainer: a batch of ", rows.rows, " rows of ", rows.seq,
                " tokens: expected at least one row and one token");
  if (rows.tokens.size() != static_cast<std::size_t>(rows.rows * rows.seq) || rows.targets.size() != rows.tokens.size())
    return fail(ErrorCode::invalid_argument, "Trainer: batch of ", rows.rows, "x", rows.seq, " has ", rows.tokens.size(),
                " tokens and ", rows.targets.size(), " targets; expected ", rows.rows * rows.seq, " each");
  if (rows.rows % k != 0)
    return fail(ErrorCode::invalid_argument, "Trainer: ", rows.rows,
                " rows on this rank do not split into gradient_accumulation_steps=", k, " equal micro-batches");
  std::vector<modules::Batch> out;
  const std::int64_t per = rows.rows / k;
  for (int m = 0; m < k; ++m) {
    const auto first = static_cast<std::size_t>(m * per * rows.seq), count = static_cast<std::size_t>(per * rows.seq);
    auto part = [&](const std::vector<std::int32_t>& v) {
      return ctx.upload(std::as_bytes(std::span<const std::int32_t>(v).subspan(first, count)), Shape{per, rows.seq},
                        DataType::i32);
    };
    COSHARD_TRY_ASSIGN(Tensor tokens, part(rows.tokens));
    COSHARD_TRY_ASSIGN(Tensor targets, part(rows.targets));
    out.push_back({tokens, targets});
  }
  return out;
}

namespace {

// This rank's rows on the device, split along the first dimension into k micro-batches (views:
// no copy).
Result<std::vector<modules::Batch>> split_micro_batches(modules::Context& ctx, const modules::Batch& rows, int k) {
  for (const auto* t : {&rows.inputs, &rows.targets}) {
    if (!*t || t->shape().rank() < 1 || t->shape()[0] < 1)
      return fail(ErrorCode::invalid_argument, "Trainer: batch ", t == &rows.inputs ? "inputs " : "targets ",
                  *t ? t->describe() : "empty", ": expected at least one row");
    if (!(t->device() == ctx.device()))
      return fail(ErrorCode::invalid_argument, "Trainer: batch ", t->describe(), " is not on the trainer's device ",
                  ctx.device().to_string());
  }
  const std::int64_t R = rows.inputs.shape()[0];
  if (rows.targets.shape()[0] != R)
    return fail(ErrorCode::invalid_argument, "Trainer: inputs ", rows.inputs.describe(), " and targets ",
                rows.targets.describe(), " have different numbers of rows");
  if (R % k != 0)
    return fail(ErrorCode::invalid_argument, "Trainer: ", R, " rows on this rank do not split into ",
                "gradient_accumulation_steps=", k, " equal micro-batches");
  auto part = [&](const Tensor& t, int m) {
    std::vector<std::int64_t> dims(t.shape().dims().begin(), t.shape().dims().end());
    dims[0] = R / k;
    const Shape shape = Shape::from(dims);
    return t.slice(m * shape.numel(), shape);
  };
  std::vector<modules::Batch> out;
  for (int m = 0; m < k; ++m) out.push_back({part(rows.inputs, m), part(rows.targets, m)});
  return out;
}

}  // namespace

async::Task<Result<StepStats>> Trainer::step(const HostBatch& rows) {
  Impl& s = *impl_;
  const auto start = std::chrono::steady_clock::now();
  COSHARD_CO_TRY_ASSIGN(auto micro, upload_micro_batches(*s.ctx, rows, s.config.gradient_accumulation_steps));
  co_return co_await s.step(micro, rows.rows * rows.seq * s.comm->size(), start,
                            std::pair{rows.rows * s.comm->size(), rows.seq});
}

async::Task<Result<StepStats>> Trainer::step(const modules::Batch& rows) {
  Impl& s = *impl_;
  const auto start = std::chrono::steady_clock::now();
  COSHARD_CO_TRY_ASSIGN(auto micro, split_micro_batches(*s.ctx, rows, s.config.gradient_accumulation_steps));
  // Token ids count as tokens; other inputs as samples (their first dimension).
  const std::int64_t counted = rows.inputs.dtype() == modules::DataType::i32 ? rows.inputs.numel() : rows.inputs.shape()[0];
  co_return co_await s.step(micro, counted * s.comm->size(), start, std::nullopt);
}

async::Task<Result<StepStats>> Trainer::Impl::step(std::span<const modules::Batch> micro, std::int64_t counted,
                                                   std::chrono::steady_clock::time_point start,
                                                   std::optional<std::pair<std::int64_t, std::int64_t>> eval_shape) {
  Impl& s = *this;
  const float lr = s.config.lr_at(s.engine->steps_done());
  if (s.own_aux_loss) s.own_aux_loss->reset_totals();
  COSHARD_CO_TRY_ASSIGN(auto e, co_await s.engine->step(*s.loss, micro, lr));
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  StepStats out;
  static_cast<zero::EngineStepStats&>(out) = std::move(e);
  out.step = s.engine->steps_done();
  out.step_ms = seconds * 1e3;
  out.tokens = counted;
  out.tokens_per_s = seconds > 0 ? static_cast<double>(out.tokens) / seconds : 0;
  out.lr = lr;
  out.peak_memory_bytes = s.allocator->stats().peak_in_use_bytes;
  out.blocking_waits = async::blocking_waits() - s.blocking_waits_at_start;
  if (s.own_aux_loss) {
    COSHARD_CO_TRY(co_await detail::add_moe_stats(*s.ctx, *s.comm, *s.own_aux_loss, out));
    if (out.experts_used.size() == s.moe_layer_names.size()) out.moe_layers = s.moe_layer_names;
  }
  const bool due = (s.config.eval_every > 0 && out.step % s.config.eval_every == 0) || s.validation_requested;
  if (s.validation && eval_shape && due) {
    s.validation_requested = false;
    COSHARD_CO_TRY_ASSIGN(out.val_loss, co_await s.validation_loss(eval_shape->first, eval_shape->second));
  }
  if (s.tensorboard) COSHARD_CO_TRY(s.tensorboard->add_step(out));
  // A loss that is not finite: are the weights still? (A gather of every parameter, so only then;
  // the loss is averaged over ranks, so every rank checks.) Weights that are not stop the run here
  // (the steps after could only be skipped, and an export would write them).
  if (!std::isfinite(out.loss)) {
    auto finite = co_await s.engine->check_parameters_finite();
    if (!finite)
      co_return fail(ErrorCode::invalid_argument, "step ", out.step, ": the loss is ", out.loss, " (",
                     finite.error().message(), "); stopping");
  }
  // Every rank reaches the same verdict (the skip is decided from all-reduced statistics).
  s.skipped_in_a_row = out.optimizer.last_skipped ? s.skipped_in_a_row + 1 : 0;
  if (s.config.max_skipped_steps > 0 && s.skipped_in_a_row >= s.config.max_skipped_steps)
    co_return fail(ErrorCode::invalid_argument, "step ", out.step, ": ", s.skipped_in_a_row,
                   " steps in a row skipped for inf/NaN gradients (loss ", out.loss, ", loss scale ", out.optimizer.loss_scale,
                   "); stopping (max_skipped_steps=", s.config.max_skipped_steps,
                   "): a learning rate too high, or non-finite weights or data");
  co_return out;
}

async::Task<Result<double>> Trainer::evaluate(const HostBatch& rows) {
  Impl& s = *impl_;
  COSHARD_CO_TRY_ASSIGN(auto micro, upload_micro_batches(*s.ctx, rows, 1));
  co_return co_await s.engine->evaluate(*s.loss, micro.front());
}

async::Task<Result<double>> Trainer::evaluate(const modules::Batch& rows) {
  Impl& s = *impl_;
  COSHARD_CO_TRY_ASSIGN(auto micro, split_micro_batches(*s.ctx, rows, 1));
  co_return co_await s.engine->evaluate(*s.loss, micro.front());
}

// Checkpoints and export: the engine's (see zero/checkpoint.hpp), with this run's identity.

async::Task<Result<void>> Trainer::save_checkpoint(const std::filesystem::path& dir) {
  co_return co_await impl_->engine->save_checkpoint(dir, impl_->checkpoint_options());
}

async::Task<Result<void>> Trainer::finish_checkpoint() { co_return co_await impl_->engine->finish_checkpoint(); }

async::Task<Result<void>> Trainer::load_checkpoint(const std::filesystem::path& dir) {
  co_return co_await impl_->engine->load_checkpoint(dir, impl_->checkpoint_options());
}

async::Task<Result<void>> Trainer::export_safetensors(const std::filesystem::path& path) {
  co_return co_await impl_->engine->export_safetensors(path);
}

async::Task<Result<void>> Trainer::load_safetensors(const std::filesystem::path& path) {
  co_return co_await impl_->engine->load_safetensors(path);
}

TrainerBuilder& TrainerBuilder::set(std::string_view name, std::string_view value) {
  if (error_) return *this;  // the first one is the one named
  const Setting* setting = setting_named(name);
  if (!setting) {
    std::string names;
    for (const auto& s : settings()) names += (names.empty() ? "" : ", ") + std::string(s.name);
    error_ = Error(ErrorCode::invalid_argument,
                   "TrainerBuilder::set(\"" + async::bounded_echo(name) + "\"): no such setting (expected one of " + names + ")");
  } else if (auto ok = setting->set(c_, value); !ok) {
    error_ = std::move(ok).error().with_context("TrainerBuilder::set");
  }
  return *this;
}

async::Task<Result<Trainer>> TrainerBuilder::build(modules::Module& model) const {
  if (error_) co_return fail(*error_);
  if (!comm_)
    co_return fail(ErrorCode::invalid_argument, "TrainerBuilder: no communicator (call .communicator(comm))");
  COSHARD_CO_TRY(c_.validate());
  const int tensor = mesh_ ? mesh_->tensor_size() : 1;
  if (tensor != c_.tensor_parallel_size)
    co_return fail(ErrorCode::invalid_argument, "tensor_parallel_size=", c_.tensor_parallel_size, ": ",
                   mesh_ ? "the mesh splits over " + std::to_string(tensor) + " tensor ranks"
                         : std::string("no mesh (call .mesh(mesh) with a collectives::Mesh of that tensor size)"));
  const int experts = mesh_ ? mesh_->expert_size() : 1;
  if (experts != c_.expert_parallel_size)
    co_return fail(ErrorCode::invalid_argument, "expert_parallel_size=", c_.expert_parallel_size, ": ",
                   mesh_ ? "the mesh's expert groups have " + std::to_string(experts) + " ranks"
                         : std::string("no mesh (call .mesh(mesh) with a collectives::Mesh of that expert size)"));
  auto impl = std::make_unique<Trainer::Impl>();
  impl->config = c_;
  impl->comm = comm_;
  if (tensor > 1) impl->tensor = &mesh_->tensor();
  impl->world_rank = mesh_ ? mesh_->world().rank() : comm_->rank();
  impl->model = &model;
  if (loss_) {
    impl->loss = loss_;
  } else if (tensor > 1) {
    impl->own_split_loss = std::make_unique<modules::VocabParallelCrossEntropyLoss>(mesh_->tensor());
    impl->loss = impl->own_split_loss.get();
  }
  impl->validation = validation_;
  const async::Device device = comm_->stream().device();
  async::StreamOptions stream_options;
  stream_options.name = "compute" + std::to_string(comm_->rank());
  COSHARD_CO_TRY_ASSIGN(auto stream, async::Stream::create(device, stream_options));
  impl->stream = std::make_unique<async::Stream>(std::move(stream));
  COSHARD_CO_TRY_ASSIGN(impl->allocator, async::CachingAllocator::create(device));
  const modules::ContextOptions context_options{.attention = c_.attention};
  COSHARD_CO_TRY_ASSIGN(auto ctx, modules::Context::create(*impl->stream, *impl->allocator, context_options));
  impl->ctx = std::make_unique<modules::Context>(std::move(ctx));

  const modules::StepControlOptions control = c_.step_control();
  if (c_.optimizer == OptimizerKind::adamw) {
    modules::AdamWOptions a;
    a.beta1 = c_.beta1;
    a.beta2 = c_.beta2;
    a.eps = c_.eps;
    a.weight_decay = c_.weight_decay.value_or(a.weight_decay);
    COSHARD_CO_TRY_ASSIGN(impl->optimizer, modules::Optimizer::adamw(a, control));
  } else {
    modules::SgdOptions o;
    o.momentum = c_.momentum;
    o.nesterov = c_.nesterov;
    o.weight_decay = c_.weight_decay.value_or(o.weight_decay);
    COSHARD_CO_TRY_ASSIGN(impl->optimizer, modules::Optimizer::sgd(o, control));
  }
  // LoRA's adapters first: apply_lora freezes the rest of the model, then --freeze may freeze more.
  COSHARD_CO_TRY_ASSIGN(const auto adapters, apply_lora(c_, model, mesh_ ? &mesh_->tensor() : nullptr));
  if (!adapters.empty()) {
    std::int64_t trained = 0;
    for (const auto& a : adapters) trained += a.adapter->a().numel() + a.adapter->b().numel();
    COSHARD_LOG_INFO(trainer, "LoRA rank {} alpha {}: {} adapters, {} trained parameters of {}", c_.lora_rank,
                     c_.lora_alpha, adapters.size(), trained, model.parameter_count());
  }
  if (c_.activation_checkpointing.enabled()) {
    auto* sequential = dynamic_cast<modules::Sequential*>(&model);
    if (!sequential)
      co_return fail(ErrorCode::invalid_argument, "activation checkpointing (", c_.activation_checkpointing.to_string(),
                     "): the model is a ", model.type_name(),
                     ", expected a Sequential of blocks (or wrap your blocks in modules::Checkpointed yourself)");
    if (modules::apply_activation_checkpointing(*sequential, c_.activation_checkpointing) == 0)
      COSHARD_LOG_WARN(trainer, "activation checkpointing ({}): the model has no block to checkpoint",
                       c_.activation_checkpointing.to_string());
  }
  std::vector<modules::ParameterGroup> groups;
  if (c_.no_decay_for_vectors) groups.push_back(modules::ParameterGroup::no_decay_for_vectors());
  groups.insert(groups.end(), c_.parameter_groups.begin(), c_.parameter_groups.end());
  COSHARD_CO_TRY(impl->optimizer->set_parameter_groups(std::move(groups)));
  for (const auto& pattern : c_.freeze) {
    // (expert parallelism: a pattern of one expert would freeze it on one run of ranks alone)
    COSHARD_CO_TRY(modules::check_same_on_every_expert_rank(model, pattern, "freeze"));
    auto frozen = model.set_trainable_matching(pattern, false);
    if (!frozen) co_return fail(std::move(frozen).error().with_context("freeze"));
    COSHARD_LOG_INFO(trainer, "freeze '{}': {} parameters frozen", pattern, *frozen);
  }
  COSHARD_CO_TRY(impl->choose_loss(model, loss_ != nullptr, tensor));
  impl->add_router_aux_loss(model);
  // Before the engine's first collective: every rank with the same model and settings.
  // (over the whole mesh: the tensor ranks of one data group must agree too)
  COSHARD_CO_TRY(co_await detail::check_ranks_agree(*impl->ctx, mesh_ ? mesh_->world() : *comm_,
                                                    detail::agreement_fields(c_, model)));
  COSHARD_CO_TRY_ASSIGN(const zero::EngineOptions engine_options, c_.engine_options_for(model, comm_->size()));
  if (mesh_) {
    COSHARD_CO_TRY_ASSIGN(impl->engine, zero::Engine::create(*impl->ctx, *mesh_, model, *impl->optimizer, engine_options));
  } else {
    COSHARD_CO_TRY_ASSIGN(impl->engine, zero::Engine::create(*impl->ctx, *comm_, model, *impl->optimizer, engine_options));
  }
  impl->blocking_waits_at_start = async::blocking_waits();
  COSHARD_CO_TRY(co_await impl->engine->initialize(c_.seed));
  if (!c_.tensorboard_dir.empty() && impl->world_rank == 0) {
    COSHARD_CO_TRY_ASSIGN(auto writer, TensorBoardWriter::create(c_.tensorboard_dir));
    impl->tensorboard.emplace(std::move(writer));
  }
  co_return Trainer(std::move(impl));
}

}  // namespace coshard::trainer
