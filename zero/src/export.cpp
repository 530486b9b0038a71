// The model as one safetensors file, out and in: every parameter by name, unpadded (Hugging
// Face's consolidated layout). Out: every rank gathers (one unit at a time at stage 3), rank 0
// writes, and every rank returns rank 0's outcome. In: the file read and checked on the blocking
// pool (float dtypes converted to the engine's, every value finite), then load_parameters, which
// refuses a missing, extra or reshaped name before anything changes.
#include <cmath>

#include "engine_state.hpp"

namespace coshard::zero {

using namespace modules;
using namespace detail;
namespace fs = std::filesystem;

namespace {

Result<std::vector<GatheredParameter>> read_parameters(const fs::path& path, DataType dtype) {
  COSHARD_TRY_ASSIGN(auto file, SafetensorsFile::load(path));
  std::vector<GatheredParameter> out;
  for (const auto& t : file.tensors()) {
    const auto from = float_dtype_of(t.dtype);
    if (!from)
      return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name, " is ", to_string(t.dtype),
                  "; expected a float dtype (F64, F32, BF16, F16)");
    if (t.shape.size() > 4)
      return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name, " has ", t.shape.size(),
                  " dimensions (at most 4)");
    const Shape shape = Shape::from(t.shape);
    const auto values = decode_values(file.data(t), *from);
    // Non-finite initial weights would only skip every step (inf/NaN gradients) and exit 0.
    for (std::size_t i = 0; i < values.size(); ++i)
      if (!std::isfinite(values[i]))
        return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name, " element ", i, " is ", values[i],
                    "; initial weights must be finite");
    out.push_back({t.name, shape, encode_values(values, dtype)});
  }
  return out;
}

}  // namespace

async::Task<Result<void>> Engine::export_safetensors(const fs::path& path) {
  State& s = *s_;
  COSHARD_CO_TRY(s.outside_loop("export_safetensors"));
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::invalid_argument, "export_safetensors: must be awaited on a coshard Runtime");
  COSHARD_CO_TRY_ASSIGN(auto params, co_await gather_parameters());
  std::int64_t ok = 1;
  std::string error;
  if (s.rank == 0) {
    COSHARD_CO_TRY_ASSIGN(const SafeDType dt, safe_dtype(s.o.dtype));
    auto write = [&]() -> Result<void> {
      std::vector<SafeTensorView> views;
      for (const auto& p : params) {
        const auto dims = p.shape.dims();
        views.push_back({p.name, dt, std::vector<std::int64_t>(dims.begin(), dims.end()), p.bytes});
      }
      return save_safetensors(path, views, {{"format", "pt"}, {"producer", "coshard"}});
    };
    auto done = co_await rt->spawn_blocking(std::move(write));
    if (!done) {
      ok = 0;
      error = done.error().message();
    }
  }
  std::vector<std::int64_t> outcome{ok};  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY_ASSIGN(auto status, co_await s.all_ranks(std::move(outcome)));
  if (status[0] != 1)
    co_return fail(ErrorCode::io, "export to ", path.string(), " failed on rank 0", error.empty() ? "" : ": ", error);
  co_return Result<void>{};
}

async::Task<Result<void>> Engine::load_safetensors(const fs::path& path) {
  State& s = *s_;
  COSHARD_CO_TRY(s.outside_loop("load_safetensors"));
  async::Runtime* rt = async::Runtime::current();
  if (!rt) co_return fail(ErrorCode::invalid_argument, "load_safetensors: must be awaited on a coshard Runtime");
  auto read = [&path, dtype = s.o.dtype]() { return read_parameters(path, dtype); };
  auto values = co_await rt->spawn_blocking(std::move(read));
  Result<void> checked{};
  if (!values) checked = fail(std::move(values).error());
  else checked = s.check_values(*values);
  // Every rank read and checked the file, or none changes anything (the load's gathers would
  // wait for a rank that stopped).
  std::string what = "load_safetensors " + path.string();  // named: GCC 12 destroys temporaries in co_await twice
  auto agreed = co_await s.every_rank_can_load(checked.has_value(), std::move(what));
  if (!checked) co_return fail(std::move(checked).error());
  COSHARD_CO_TRY(std::move(agreed));
  co_return co_await load_parameters(*values);
}

}  // namespace coshard::zero
