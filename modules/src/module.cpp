#include "coshard/modules/module.hpp"

#include "coshard/async/json_limits.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <numbers>

#include "kernels/kernels.hpp"
#include "random.hpp"

namespace coshard::modules {

std::string Shape::to_string() const {
  std::string s = "[";
  for (int i = 0; i < rank_; ++i) {
    if (i) s += ", ";
    s += std::to_string(dims_[static_cast<std::size_t>(i)]);
  }
  return s + "]";
}

std::string Tensor::describe() const {
  return std::string(async::to_string(dtype_)) + shape_.to_string() + " on " + device_.to_string();
}

std::vector<std::byte> encode_values(std::span<const double> values, DataType dtype) {
  std::vector<std::byte> out(values.size() * size_of(dtype));
  std::byte* p = out.data();
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double v = values[i];
    switch (dtype) {
      case DataType::f32: reinterpret_cast<float*>(p)[i] = static_cast<float>(v); break;
      case DataType::f64: reinterpret_cast<double*>(p)[i] = v; break;
      case DataType::bf16: reinterpret_cast<std::uint16_t*>(p)[i] = async::float_to_bf16(static_cast<float>(v)); break;
      case DataType::f16: reinterpret_cast<std::uint16_t*>(p)[i] = async::float_to_f16(static_cast<float>(v)); break;
      case DataType::i32: reinterpret_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); break;
      case DataType::u8: p[i] = static_cast<std::byte>(static_cast<std::uint8_t>(v)); break;
    }
  }
  return out;
}

std::vector<double> decode_values(std::span<const std::byte> bytes, DataType dtype) {
  std::vector<double> out(bytes.size() / size_of(dtype));
  const std::byte* p = bytes.data();
  for (std::size_t i = 0; i < out.size(); ++i) {
    switch (dtype) {
      case DataType::f32: out[i] = reinterpret_cast<const float*>(p)[i]; break;
      case DataType::f64: out[i] = reinterpret_cast<const double*>(p)[i]; break;
      case DataType::bf16: out[i] = async::bf16_to_float(reinterpret_cast<const std::uint16_t*>(p)[i]); break;
      case DataType::f16: out[i] = async::f16_to_float(reinterpret_cast<const std::uint16_t*>(p)[i]); break;
      case DataType::i32: out[i] = reinterpret_cast<const std::int32_t*>(p)[i]; break;
      case DataType::u8: out[i] = static_cast<double>(static_cast<std::uint8_t>(p[i])); break;
    }
  }
  return out;
}

using detail::fnv1a;
using detail::SplitMix64;

void initial_values(const Init& init, std::string_view full_name, std::uint64_t seed, std::span<double> out) {
  SplitMix64 rng{fnv1a(full_name) ^ (seed * 0x9E3779B97F4A7C15ull)};
  switch (init.kind) {
    case Init::Kind::zeros:
      for (auto& v : out) v = 0;
      break;
    case Init::Kind::ones:
      for (auto& v : out) v = 1;
      break;
    case Init::Kind::uniform:
      for (auto& v : out) v = init.a + (init.b - init.a) * rng.uniform01();
      break;
    case Init::Kind::normal:
      // Box-Muller, both outputs used.
      for (std::size_t i = 0; i < out.size(); i += 2) {
        const double u1 = 1.0 - rng.uniform01();  // (0, 1]
        const double u2 = rng.uniform01();
        const double r = std::sqrt(-2.0 * std::log(u1)) * init.a;
        out[i] = r * std::cos(2 * std::numbers::pi * u2);
        if (i + 1 < out.size()) out[i + 1] = r * std::sin(2 * std::numbers::pi * u2);
      }
      break;
  }
}

Result<Shape> TensorSplit::part_shape() const {
  if (dim < 0 || dim >= whole.rank())
    return fail(ErrorCode::invalid_argument, "tensor split along dimension ", dim, " of a ", whole.to_string(),
                " tensor (expected 0 to ", whole.rank() - 1, ")");
  if (parts < 1 || index < 0 || index >= parts)
    return fail(ErrorCode::invalid_argument, "tensor split: part ", index, " of ", parts, " (expected 0 <= part < parts)");
  std::int64_t total = 0, kept = 0;
  for (const auto size : segments) {
    if (size < 1 || size % parts != 0)
      return fail(ErrorCode::invalid_argument, "tensor split of ", whole.to_string(), " along dimension ", dim,
                  ": a segment of ", size, " does not divide into ", parts, " parts");
    total += size;
    kept += size / parts;
  }
  if (total != whole[dim])
    return fail(ErrorCode::invalid_argument, "tensor split of ", whole.to_string(), ": segments sum to ", total,
                " along dimension ", dim, ", expected ", whole[dim]);
  std::vector<std::int64_t> dims(whole.dims().begin(), whole.dims().end());
  dims[static_cast<std::size_t>(dim)] = kept;
  return Shape::from(dims);
}

namespace {
// Calls copy(whole_offset, part_offset, n) for each contiguous run of the part, in order.
template <class Copy>
void for_each_part_run(const TensorSplit& split, Copy copy) {
  std::int64_t outer = 1, inner = 1;
  for (int i = 0; i < split.dim; ++i) outer *= split.whole[i];
  for (int i = split.dim + 1; i < split.whole.rank(); ++i) inner *= split.whole[i];
  const std::int64_t extent = split.whole[split.dim];
  std::int64_t part_at = 0;
  for (std::int64_t o = 0; o < outer; ++o) {
    std::int64_t segment_start = 0;
    for (const auto size : split.segments) {
      const std::int64_t piece = size / split.parts;
      const std::int64_t first = (o * extent + segment_start + split.index * piece) * inner;
      copy(static_cast<std::size_t>(first), static_cast<std::size_t>(part_at), static_cast<std::size_t>(piece * inner));
      part_at += piece * inner;
      segment_start += size;
    }
  }
}
}  // namespace

void TensorSplit::take_part(std::span<const double> whole_values, std::span<double> part) const {
  for_each_part_run(*this, [&](std::size_t w, std::size_t p, std::size_t n) {
    std::copy_n(whole_values.begin() + static_cast<std::ptrdiff_t>(w), n, part.begin() + static_cast<std::ptrdiff_t>(p));
  });
}

void TensorSplit::place_part(std::span<const double> part, std::span<double> whole_values) const {
  for_each_part_run(*this, [&](std::size_t w, std::size_t p, std::size_t n) {
    std::copy_n(part.begin() + static_cast<std::ptrdiff_t>(p), n, whole_values.begin() + static_cast<std::ptrdiff_t>(w));
  });
}

Result<void> Parameter::set_split(TensorSplit split) {
  COSHARD_TRY_ASSIGN(const Shape part, split.part_shape());
  if (!(part == shape_))
    return fail(ErrorCode::invalid_argument, "parameter ", name_, ": a tensor split giving ", part.to_string(),
                " of ", split.whole.to_string(), ", expected this parameter's ", shape_.to_string());
  if (bound())
    return fail(ErrorCode::invalid_argument, "parameter ", name_, ": set_split while bound (split before a "
                "ParameterStore or engine is made)");
  split_ = split.parts > 1 ? std::make_shared<const TensorSplit>(std::move(split)) : nullptr;
  return {};
}

Result<void> Parameter::set_expert_parallel(int group_size) {
  if (group_size < 1)
    return fail(ErrorCode::invalid_argument, "parameter ", name_, ": expert-parallel size ", group_size, ", expected >= 1");
  if (bound())
    return fail(ErrorCode::invalid_argument, "parameter ", name_, ": set_expert_parallel while bound (set it before a "
                "ParameterStore or engine is made)");
  expert_parallel_ = group_size;
  return {};
}

void initial_values(const Parameter& parameter, std::string_view full_name, std::uint64_t seed, std::span<double> out) {
  const TensorSplit* split = parameter.split();
  if (!split) return initial_values(parameter.init(), full_name, seed, out);
  std::vector<double> whole(static_cast<std::size_t>(split->whole.numel()));
  initial_values(parameter.init(), full_name, seed, whole);
  split->take_part(whole, out);
}

Result<void> ModuleHooks::wait_for_collective(Context& ctx, const async::Event& done, const std::string&) {
  return ctx.stream().wait(done);
}

async::Task<Result<void>> ModuleHooks::agree_on_union(Context&, std::span<double>, const std::string&) {
  co_return Result<void>{};
}

void ModuleHooks::announce_next(Context&, std::span<Module* const>) {}

Result<void> Parameter::bind(Tensor value, Tensor grad) {
  if (!(value.shape() == shape_))
    return fail(ErrorCode::invalid_argument, "parameter ", name_, ": value shape ", value.shape().to_string(),
                ", expected ", shape_.to_string());
  if (grad && !(grad.shape() == shape_))
    return fail(ErrorCode::invalid_argument, "parameter ", name_, ": grad shape ", grad.shape().to_string(),
                ", expected ", shape_.to_string());
  value_ = std::move(value);
  grad_ = trainable_ ? std::move(grad) : Tensor{};
  return {};
}

Result<void> Parameter::set_trainable(bool trainable) {
  if (trainable == trainable_) return {};
  if (bound())
    return fail(ErrorCode::invalid_argument, "parameter ", name_, ": set_trainable(", trainable ? "true" : "false",
                ") while bound to a ParameterStore or an engine (freeze before building them)");
  trainable_ = trainable;
  return {};
}

bool glob_matches(std::string_view pattern, std::string_view name) noexcept {
  // Iterative, with one back-track point (the last '*'): linear in practice, never recursive.
  std::size_t p = 0, n = 0, star = std::string_view::npos, resume = 0;
  while (n < name.size()) {
    if (p < pattern.size() && (pattern[p] == '?' || pattern[p] == name[n])) {
      ++p;
      ++n;
    } else if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      resume = n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++resume;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

Result<Context> Context::create(async::Stream& stream, async::CachingAllocator& allocator, ContextOptions options) {
  if (!(allocator.device() == stream.device()))
    return fail(ErrorCode::invalid_argument, "Context: allocator serves ", allocator.device().to_string(),
                ", stream ", stream.name(), " runs on ", stream.device().to_string());
  if (stream.device().is_cpu()) return Context(stream, allocator, detail::cpu_kernels());
  const detail::Kernels* k = options.attention == AttentionKernels::fused    ? detail::cuda_kernels()
                             : options.attention == AttentionKernels::cudnn ? detail::cuda_kernels_cudnn_attention()
                                                                            : detail::cuda_kernels_materialized_attention();
  if (!k)
    return fail(ErrorCode::unsupported, "Context: stream ", stream.name(), " is on ", stream.device().to_string(),
                " but this build has no CUDA kernels (configure with COSHARD_CUDA=ON)");
  return Context(stream, allocator, *k);
}

// Atomic: tensors may be dropped on another thread than the one that made them.
struct Context::ActivationMeter {
  std::atomic<std::size_t> live{0};
  std::atomic<std::size_t> peak{0};
  void add(std::size_t bytes) noexcept {
    const std::size_t now = live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
    std::size_t seen = peak.load(std::memory_order_relaxed);
    while (now > seen && !peak.compare_exchange_weak(seen, now, std::memory_order_relaxed)) {
    }
  }
};

namespace {
// A tensor's memory, counted in its context's meter while it lives.
struct CountedBlock {
  CountedBlock(async::Block b, std::size_t n, std::shared_ptr<Context::ActivationMeter> m)
      : block(std::move(b)), bytes(n), meter(std::move(m)) {
    meter->add(bytes);
  }
  CountedBlock(const CountedBlock&) = delete;
  CountedBlock& operator=(const CountedBlock&) = delete;
  ~CountedBlock() { meter->live.fetch_sub(bytes, std::memory_order_relaxed); }
  async::Block block;
  std::size_t bytes;
  std::shared_ptr<Context::ActivationMeter> meter;
};
}  // namespace

Context::Context(async::Stream& stream, async::CachingAllocator& allocator, const detail::Kernels& kernels)
    : stream_(&stream), allocator_(&allocator), kernels_(&kernels), meter_(std::make_shared<ActivationMeter>()) {}

Context::ActivationMemory Context::activation_memory() const noexcept {
  return {meter_->live.load(std::memory_order_relaxed), meter_->peak.load(std::memory_order_relaxed)};
}

void Context::reset_activation_peak() noexcept {
  meter_->peak.store(meter_->live.load(std::memory_order_relaxed), std::memory_order_relaxed);
}

Result<Tensor> Context::empty(Shape shape, DataType dtype) {
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * size_of(dtype);
  COSHARD_TRY_ASSIGN(auto block, allocator_->allocate(bytes == 0 ? 1 : bytes, *stream_));
  auto owner = std::make_shared<CountedBlock>(std::move(block), bytes, meter_);
  void* data = owner->block.data();
  return Tensor(std::shared_ptr<void>(std::move(owner)), data, shape, dtype, device());
}

Result<Tensor> Context::zeros(Shape shape, DataType dtype) {
  COSHARD_TRY_ASSIGN(auto t, empty(shape, dtype));
  COSHARD_TRY(stream_->fill(t.data(), 0, t.bytes()));
  return t;
}

Result<Tensor> Context::upload(std::span<const std::byte> host, Shape shape, DataType dtype) {
  const std::size_t bytes = static_cast<std::size_t>(shape.numel()) * size_of(dtype);
  if (host.size() != bytes)
    return fail(ErrorCode::invalid_argument, "upload: ", host.size(), " bytes given for ",
                async::to_string(dtype), shape.to_string(), " (", bytes, " bytes)");
  COSHARD_TRY_ASSIGN(Tensor t, empty(shape, dtype));
  COSHARD_TRY(copy_from_host(t, host));
  return t;
}

Result<void> Context::copy_from_host(const Tensor& dst, std::span<const std::byte> host) {
  if (host.size() != dst.bytes())
    return fail(ErrorCode::invalid_argument, "copy_from_host: ", host.size(), " bytes given for ", dst.describe(),
                " (", dst.bytes(), " bytes)");
  if (host.empty()) return {};
  auto staging = std::make_shared<std::vector<std::byte>>(host.begin(), host.end());
  COSHARD_TRY(stream_->copy(dst.data(), staging->data(), host.size()));
  // The staging copy goes once the stream has passed the copy.
  return stream_->launch([staging = std::move(staging)] {});
}

async::Task<Result<std::vector<std::byte>>> Context::read_bytes(Tensor tensor) {
  COSHARD_CO_TRY_ASSIGN(auto pinned, async::PinnedBuffer::allocate(tensor.bytes() == 0 ? 1 : tensor.bytes()));
  COSHARD_CO_TRY(stream_->copy(pinned.data(), tensor.data(), tensor.bytes()));
  COSHARD_CO_TRY_ASSIGN(auto done, stream_->record());
  COSHARD_CO_TRY(co_await done);
  const auto bytes = pinned.bytes().first(tensor.bytes());
  co_return std::vector<std::byte>(bytes.begin(), bytes.end());
}

async::Task<Result<std::vector<double>>> Context::read(Tensor tensor) {
  const DataType dtype = tensor.dtype();
  COSHARD_CO_TRY_ASSIGN(auto bytes, co_await read_bytes(std::move(tensor)));
  co_return decode_values(bytes, dtype);
}

async::Task<Result<Tensor>> Context::forward(Module& module, Tensor input) {
  if (hooks_) COSHARD_CO_TRY(co_await hooks_->before_forward(*this, module));
  auto out = co_await module.forward(*this, std::move(input));
  if (!out && hooks_) co_return fail(hooks_->explain_failure(module, std::move(out).error()));
  if (!out) co_return out;
  if (hooks_) COSHARD_CO_TRY(hooks_->after_forward(*this, module));
  co_return out;
}

async::Task<Result<Tensor>> Context::backward(Module& module, Tensor grad_output) {
  if (hooks_) COSHARD_CO_TRY(co_await hooks_->before_backward(*this, module));
  auto out = co_await module.backward(*this, std::move(grad_output));
  if (!out && hooks_) co_return fail(hooks_->explain_failure(module, std::move(out).error()));
  if (!out) co_return out;
  if (hooks_) COSHARD_CO_TRY(hooks_->after_backward(*this, module));
  co_return out;
}

Parameter& Module::register_parameter(std::string name, Shape shape, Init init) {
  parameters_.push_back(std::make_unique<Parameter>(std::move(name), shape, init));
  return *parameters_.back();
}

void Module::for_each_parameter(const std::function<void(const std::string&, Parameter&)>& fn,
                                const std::string& prefix) {
  for (auto& p : parameters_) fn(prefix + p->name(), *p);
  // An unnamed child (a Residual's inner module) adds nothing to the path.
  for (auto& c : children_) c.module->for_each_parameter(fn, c.name.empty() ? prefix : prefix + c.name + ".");
}

void Module::for_each_module(const std::function<void(const std::string&, Module&)>& fn, const std::string& prefix) {
  fn(prefix, *this);
  for (auto& c : children_) {
    const std::string path = c.name.empty() ? prefix : prefix.empty() ? c.name : prefix + "." + c.name;
    c.module->for_each_module(fn, path);
  }
}

std::int64_t Module::parameter_count() {
  std::int64_t n = 0;
  for_each_parameter([&](const std::string&, Parameter& p) { n += p.numel(); });
  return n;
}

Result<void> Module::use_parameters_of(Module& owner) {
  if (&owner == this)
    return fail(ErrorCode::invalid_argument, type_name(), ": use_parameters_of itself (its own parameters are its own)");
  if (owner.parameters().empty())
    return fail(ErrorCode::invalid_argument, type_name(), ": use_parameters_of a ", owner.type_name(),
                " that has no parameters of its own");
  if (std::find(borrowed_.begin(), borrowed_.end(), &owner) != borrowed_.end())
    return fail(ErrorCode::invalid_argument, type_name(), ": use_parameters_of the same ", owner.type_name(), " twice");
  borrowed_.push_back(&owner);
  return {};
}

namespace {

// A parameter's error named by its full name in the model (fc1.weight), not its own (weight).
Result<void> renamed(Error e, const Parameter& p, const std::string& full_name) {
  std::string message = e.message();
  const std::string own = "parameter " + std::string(p.name()) + ":";
  if (message.starts_with(own)) message = "parameter " + full_name + ":" + message.substr(own.size());
  return fail(Error(e.code(), std::move(message)));
}

}  // namespace

Result<void> Module::set_trainable(bool trainable) {
  Result<void> outcome;
  for_each_parameter([&](const std::string& name, Parameter& p) {
    if (auto r = p.set_trainable(trainable); !r && outcome) outcome = renamed(std::move(r).error(), p, name);
  });
  return outcome;
}

Result<std::size_t> Module::set_trainable_matching(std::string_view pattern, bool trainable) {
  std::size_t matched = 0, seen = 0;
  std::string examples;  // this model's first names, for the message
  Result<void> outcome;
  for_each_parameter([&](const std::string& name, Parameter& p) {
    if (++seen <= 3) examples += (examples.empty() ? "" : ", ") + name;
    if (!glob_matches(pattern, name)) return;
    ++matched;
    if (auto r = p.set_trainable(trainable); !r && outcome) outcome = renamed(std::move(r).error(), p, name);
  });
  if (!outcome) return fail(std::move(outcome).error());
  if (matched == 0)
    return fail(ErrorCode::invalid_argument, "parameter pattern '", async::bounded_echo(pattern, 256),
                "' matches no parameter of the model (its names are dotted paths: ", examples,
                seen > 3 ? ", ..." : "", ")");
  return matched;
}

void Module::clear_saved_recursive() {
  clear_saved();
  for (auto& c : children_) c.module->clear_saved_recursive();
}

void Sequential::wrap_child(std::size_t index,
                            const std::function<std::unique_ptr<Module>(std::unique_ptr<Module>)>& wrapper) {
  auto& child = mutable_children().at(index);
  child.module = wrapper(std::move(child.module));
}

async::Task<Result<Tensor>> Sequential::forward(Context& ctx, Tensor input) {
  Tensor x = std::move(input);
  for (const auto& child : children()) {
    COSHARD_CO_TRY_ASSIGN(x, co_await ctx.forward(*child.module, std::move(x)));
  }
  co_return x;
}

async::Task<Result<Tensor>> Sequential::backward(Context& ctx, Tensor grad_output) {
  Tensor g = std::move(grad_output);
  const auto kids = children();
  for (auto it = kids.rbegin(); it != kids.rend(); ++it) {
    COSHARD_CO_TRY_ASSIGN(g, co_await ctx.backward(*it->module, std::move(g)));
  }
  co_return g;
}

Residual::Residual(std::unique_ptr<Module> inner) { register_child("", std::move(inner)); }

async::Task<Result<Tensor>> Residual::forward(Context& ctx, Tensor input) {
  COSHARD_CO_TRY_ASSIGN(Tensor y, co_await ctx.forward(inner(), input));
  if (!(y.shape() == input.shape()) || y.dtype() != input.dtype())
    co_return fail(ErrorCode::invalid_argument, "Residual: inner ", inner().type_name(), " returned ", y.describe(),
                   ", expected the input's ", input.describe());
  COSHARD_CO_TRY_ASSIGN(Tensor out, ctx.empty(input.shape(), input.dtype()));
  COSHARD_CO_TRY(ctx.kernels().add(ctx.stream(), input.dtype(), input.data(), y.data(), out.data(), out.numel()));
  co_return out;
}

async::Task<Result<Tensor>> Residual::backward(Context& ctx, Tensor grad_output) {
  COSHARD_CO_TRY_ASSIGN(Tensor g_inner, co_await ctx.backward(inner(), grad_output));
  COSHARD_CO_TRY_ASSIGN(Tensor dx, ctx.empty(grad_output.shape(), grad_output.dtype()));
  COSHARD_CO_TRY(ctx.kernels().add(ctx.stream(), dx.dtype(), grad_output.data(), g_inner.data(), dx.data(),
                                   dx.numel()));
  co_return dx;
}

}  // namespace coshard::modules
