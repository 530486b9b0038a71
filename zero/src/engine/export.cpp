// The model as one safetensors file, out and in: every parameter by name, unpadded (Hugging
// Face's consolidated layout). Out: every rank gathers (one unit at a time at stage 3), rank 0
// writes, and every rank returns rank 0's outcome. In: the file read and checked on the blocking
// pool (float dtypes converted to the engine's, every value finite), then load_parameters, which
// refuses a missing, extra or reshaped name before anything changes.
#include <cmath>
#include <unordered_set>

#include "engine/state.hpp"
#include "formats/parameter_decode.hpp"
#include "expert_parts.hpp"
#include "tensor_parts.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;
namespace fs = std::filesystem;

namespace {

Result<std::vector<GatheredParameter>> read_parameters(const fs::path& path, DataType dtype) {
  COSHARD_TRY_ASSIGN(auto file, SafetensorsFile::load(path));
  std::vector<GatheredParameter> out;
  for (const auto& t : file.tensors()) {
    COSHARD_TRY_ASSIGN(auto p, decode_parameter(path.string(), t.name, t.dtype, t.shape, file.data(t), dtype));
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace

Result<void> detail::check_finite(const std::vector<GatheredParameter>& params, DataType dtype, std::string_view what) {
  std::int64_t bad = 0, total = 0;
  std::string first;
  for (const auto& p : params) {
    const auto values = decode_values(p.bytes, dtype);
    total += static_cast<std::int64_t>(values.size());
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!std::isfinite(values[i]) && bad++ == 0)
        first = p.name + " element " + std::to_string(i) + " is " + std::to_string(values[i]);
  }
  if (bad == 0) return {};
  return fail(ErrorCode::invalid_argument, what, ": ", bad, " of ", total, " weights are not finite (", first,
              "): training diverged (a learning rate or weight decay too large, or non-finite data)");
}

Result<GatheredParameter> detail::decode_parameter(std::string_view source, const std::string& name, SafeDType file_dtype,
                                           const std::vector<std::int64_t>& dims, std::span<const std::byte> data,
                                           DataType dtype) {
  const auto from = float_dtype_of(file_dtype);
  if (!from)
    return fail(ErrorCode::invalid_argument, source, ": tensor ", name, " is ", to_string(file_dtype),
                "; expected a float dtype (F64, F32, BF16, F16)");
  if (dims.size() > 4)
    return fail(ErrorCode::invalid_argument, source, ": tensor ", name, " has ", dims.size(), " dimensions (at most 4)");
  const Shape shape = Shape::from(dims);
  const auto values = decode_values(data, *from);
  // Non-finite initial weights would only skip every step (inf/NaN gradients) and exit 0.
  for (std::size_t i = 0; i < values.size(); ++i)
    if (!std::isfinite(values[i]))
      return fail(ErrorCode::invalid_argument, source, ": tensor ", name, " element ", i, " is ", values[i],
                  "; initial weights must be finite");
  return GatheredParameter{name, shape, encode_values(values, dtype)};
}

async::Task<Result<void>> Engine::export_safetensors(const fs::path& path) {
  COSHARD_CO_TRY(s_->outside_loop("export_safetensors"));
  COSHARD_CO_TRY_ASSIGN(const SafeDType dt, safe_dtype(s_->o.dtype));
  auto write = [path, dt](const std::vector<GatheredParameter>& params) -> Result<void> {
    std::vector<SafeTensorView> views;
    for (const auto& p : params) {
      const auto dims = p.shape.dims();
      views.push_back({p.name, dt, std::vector<std::int64_t>(dims.begin(), dims.end()), p.bytes});
    }
    return save_safetensors(path, views, {{"format", "pt"}, {"producer", "coshard"}});
  };
  co_return co_await export_parameters("export to " + path.string(), std::move(write));
}

async::Task<Result<void>> Engine::check_parameters_finite() {
  COSHARD_CO_TRY(s_->outside_loop("check_parameters_finite"));
  COSHARD_CO_TRY_ASSIGN(auto params, co_await gather_parameters());  // the same values on every rank
  co_return check_finite(params, s_->o.dtype, "Engine");
}

async::Task<Result<void>> Engine::export_parameters(std::string what, ParameterWriter write) {
  State& s = *s_;
  COSHARD_CO_TRY(s.outside_loop(what));
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::invalid_argument, what, ": must be awaited on a coshard Runtime");
  COSHARD_CO_TRY_ASSIGN(auto params, co_await gather_parameters());
  // Expert parallelism: the other runs' experts too (the file holds every expert).
  COSHARD_CO_TRY_ASSIGN(params, co_await with_every_expert(s.ranks_agree, s.rank, *s.model, std::move(params)));
  const bool split = tensor_size(s.o) > 1;  // tensor parallelism: the files hold whole parameters
  if (split) {
    COSHARD_CO_TRY_ASSIGN(params, co_await whole_parameters(s.tensor_agree, s.by_name(), std::move(params), s.o.dtype));
  }
  std::int64_t ok = 1;
  std::string error;
  if (s.rank == 0 && (!split || s.o.tensor_parallel->rank() == 0)) {
    // Weights that are no longer finite are never written: a file --init would refuse anyway.
    auto done = co_await rt->spawn_blocking([&write, &params, &what, dtype = s.o.dtype]() -> Result<void> {
      COSHARD_TRY(check_finite(params, dtype, what + ": nothing written"));
      return write(params);
    });
    if (!done) {
      ok = 0;
      error = done.error().message();
    }
  }
  std::vector<std::int64_t> outcome{ok};  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY_ASSIGN(auto status, co_await s.ranks_agree.all_ranks(std::move(outcome)));
  if (split) {  // (the writer's data group knows; the other tensor ranks' groups learn it from theirs)
    std::vector<std::int64_t> mine{status[0]};
    COSHARD_CO_TRY_ASSIGN(const auto over_tensor, co_await s.tensor_agree.all_ranks(std::move(mine)));
    status[0] = over_tensor[0];
  }
  if (status[0] != 1) co_return fail(ErrorCode::io, what, " failed on rank 0", error.empty() ? "" : ": ", error);
  co_return Result<void>{};
}

async::Task<Result<void>> Engine::load_safetensors(const fs::path& path) {
  COSHARD_CO_TRY(s_->outside_loop("load_safetensors"));
  auto read = [path, dtype = s_->o.dtype]() { return read_parameters(path, dtype); };
  co_return co_await load_parameters_from("load_safetensors " + path.string(), std::move(read));
}

async::Task<Result<void>> Engine::load_parameters_from(std::string what, ParameterReader read) {
  // A LoRA model's base file has no adapters: those it leaves out keep their values (the seed's,
  // or a PEFT folder's).
  // (named: GCC 12 destroys temporaries in co_await twice)
  ParameterFilter kept = [adapters = s_->adapter_parameters()](const Parameter& p) { return adapters.contains(&p); };
  co_return co_await load_parameters_from(std::move(what), std::move(read), std::move(kept));
}

async::Task<Result<void>> Engine::load_parameters_from(std::string what, ParameterReader read, ParameterFilter kept) {
  State& s = *s_;
  COSHARD_CO_TRY(s.outside_loop(what));
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::invalid_argument, what, ": must be awaited on a coshard Runtime");
  // What may be left out keeps its values: gathered first (this rank's parts), on every rank
  // alike, whatever the read gives.
  std::vector<GatheredParameter> kept_values;
  if (s.has_values && kept) {
    bool any = false;
    for (const auto& [p, name] : s.names) any = any || kept(*p);
    if (any) {
      std::function<bool(const Parameter&)> wanted = [&kept](const Parameter& p) { return kept(p); };  // (named: GCC 12)
      auto gathered = co_await s.gather_values(std::move(wanted));
      if (!gathered) co_return fail(std::move(gathered).error().with_context(what + ": the values kept"));
      kept_values = std::move(*gathered);
    }
  }
  auto values = co_await rt->spawn_blocking([&read]() { return read(); });
  // Tensor parallelism: the files hold whole parameters, this rank takes its parts.
  if (values && tensor_size(s.o) > 1) values = parts_of_whole(s.by_name(), std::move(*values), s.o.dtype, what);
  // Expert parallelism: the file holds every expert, this rank takes its own.
  if (values) {
    if (const auto elsewhere = experts_elsewhere(*s.model); !elsewhere.empty())
      std::erase_if(*values, [&](const GatheredParameter& v) { return elsewhere.contains(v.name); });
  }
  if (values && !kept_values.empty()) {
    values->reserve(values->size() + kept_values.size());  // (no reallocation below: `given` views the names)
    std::unordered_set<std::string_view> given;
    for (const auto& v : *values) given.insert(v.name);
    for (auto& v : kept_values)
      if (!given.contains(v.name)) values->push_back(std::move(v));
  }
  Result<void> checked{};
  if (!values) checked = fail(std::move(values).error());
  else checked = s.check_values(*values);
  // Every rank read and checked the file, or none changes anything (the load's gathers would
  // wait for a rank that stopped).
  std::string over_tensor = what + " (over the tensor ranks)";
  auto agreed = co_await s.ranks_agree.every_rank_can_load(checked.has_value(), std::move(what));
  // (every tensor rank exchanges, whatever its data group decided: none waits for one that left)
  if (tensor_size(s.o) > 1) {
    auto tensor_agreed = co_await s.tensor_agree.every_rank_can_load(checked && agreed, std::move(over_tensor));
    if (checked && agreed && !tensor_agreed) co_return fail(std::move(tensor_agreed).error());
  }
  if (!checked) co_return fail(std::move(checked).error());
  COSHARD_CO_TRY(std::move(agreed));
  co_return co_await load_parameters(*values);
}

}  // namespace coshard::zero
