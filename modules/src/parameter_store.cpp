#include "coshard/modules/parameter_store.hpp"

#include <set>

#include "coshard/modules/safetensors.hpp"

namespace coshard::modules {

Result<ParameterStore> ParameterStore::create(Context& ctx, Module& model, DataType dtype) {
  if (dtype != DataType::f32 && dtype != DataType::f64 && dtype != DataType::bf16 && dtype != DataType::f16)
    return fail(ErrorCode::invalid_argument, "ParameterStore: dtype ", async::to_string(dtype),
                ", expected f32, f64, bf16 or f16");
  ParameterStore store;
  std::int64_t total = 0;
  std::set<std::string> names;
  bool duplicate = false;
  std::string duplicate_name;
  model.for_each_parameter([&](const std::string& name, Parameter& p) {
    if (!names.insert(name).second && !duplicate) {
      duplicate = true;
      duplicate_name = name;
    }
    store.entries_.push_back(Entry{name, &p, total});
    total += p.numel();
  });
  if (duplicate)
    return fail(ErrorCode::invalid_argument, "ParameterStore: two parameters are named ", duplicate_name,
                ": give sibling modules distinct names");
  COSHARD_TRY_ASSIGN(store.values_, ctx.empty(Shape{total}, dtype));
  COSHARD_TRY_ASSIGN(store.grads_, ctx.zeros(Shape{total}, dtype));
  for (auto& e : store.entries_) {
    const Shape shape = e.parameter->shape();
    COSHARD_TRY(e.parameter->bind(store.values_.slice(e.offset, shape), store.grads_.slice(e.offset, shape)));
  }
  return store;
}

ParameterStore::~ParameterStore() {
  for (auto& e : entries_)
    if (e.parameter && values_) e.parameter->unbind();
}

async::Task<Result<void>> ParameterStore::initialize(Context& ctx, std::uint64_t seed) {
  std::vector<double> all(static_cast<std::size_t>(numel()));
  for (const auto& e : entries_) {
    auto part = std::span<double>(all).subspan(static_cast<std::size_t>(e.offset),
                                              static_cast<std::size_t>(e.parameter->numel()));
    initial_values(*e.parameter, e.name, seed, part);
  }
  co_return ctx.copy_from_host(values_, encode_values(all, dtype()));
}

Result<void> ParameterStore::zero_grad(Context& ctx) { return ctx.stream().fill(grads_.data(), 0, grads_.bytes()); }

async::Task<Result<void>> ParameterStore::save(Context& ctx, const std::filesystem::path& path,
                                               std::map<std::string, std::string> metadata) {
  const auto safe = safe_dtype_of(dtype());
  COSHARD_CO_TRY_ASSIGN(auto host, co_await ctx.read(values_));
  const auto bytes = encode_values(host, dtype());
  std::vector<SafeTensorView> views;
  views.reserve(entries_.size());
  for (const auto& e : entries_) {
    const auto n = static_cast<std::size_t>(e.parameter->numel()) * size_of(dtype());
    const auto begin = static_cast<std::size_t>(e.offset) * size_of(dtype());
    const auto dims = e.parameter->shape().dims();
    SafeTensorView view{e.name, *safe, std::vector<std::int64_t>(dims.begin(), dims.end()),
                        std::span<const std::byte>(bytes).subspan(begin, n)};
    views.push_back(std::move(view));
  }
  co_return save_safetensors(path, views, metadata);
}

async::Task<Result<void>> ParameterStore::load(Context& ctx, const std::filesystem::path& path) {
  COSHARD_CO_TRY_ASSIGN(auto file, SafetensorsFile::load(path));
  // Check everything before touching a parameter.
  std::vector<double> all(static_cast<std::size_t>(numel()));
  for (const auto& e : entries_) {
    const SafeTensorInfo* t = file.find(e.name);
    if (!t)
      co_return fail(ErrorCode::invalid_argument, path.string(), ": parameter ", e.name, " (",
                     e.parameter->shape().to_string(), ") is missing");
    const auto dims = e.parameter->shape().dims();
    if (!std::equal(t->shape.begin(), t->shape.end(), dims.begin(), dims.end())) {
      co_return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", e.name, " has shape ",
                     Shape::from(t->shape).to_string(), ", the model expects ", e.parameter->shape().to_string());
    }
    const auto dt = float_dtype_of(t->dtype);
    if (!dt)
      co_return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", e.name, " is ", to_string(t->dtype),
                     ", expected F32, F64, BF16 or F16");
    const auto values = decode_values(file.data(*t), *dt);
    std::copy(values.begin(), values.end(), all.begin() + e.offset);
  }
  if (file.tensors().size() != entries_.size()) {
    for (const auto& t : file.tensors()) {
      const bool known = std::any_of(entries_.begin(), entries_.end(), [&](const Entry& e) { return e.name == t.name; });
      if (!known)
        co_return fail(ErrorCode::invalid_argument, path.string(), ": tensor ", t.name,
                       " is not a parameter of this model (strict loading)");
    }
  }
  co_return ctx.copy_from_host(values_, encode_values(all, dtype()));
}

}  // namespace coshard::modules
