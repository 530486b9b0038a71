// Parameters, modules, and the Context they run in.
//
// A Module has named parameters and named children. Leaf modules implement explicit `forward`
// and `backward` (no autograd): both enqueue work on the Context's stream and return at once;
// forward keeps what backward needs (saved activations are Tensors, so their memory returns to
// the pool, stream-ordered, when backward drops them). Containers (Sequential, Residual) run
// their children through `Context::forward` / `Context::backward`, which call the Context's
// ModuleHooks around every module: that is where the ZeRO engine awaits a fetch unit before a
// module runs and releases it after. Both passes are coroutines so that a hook can wait (for a
// budget, a gather) without blocking the host.
//
// Parameters do not own memory: a ParameterStore (stage 0) or the engine (sharded stages) binds
// each parameter's value and gradient to views into flat buffers. Gradients accumulate (+=), so
// several micro-batches add up until the owner zeroes them.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/memory.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/async/task.hpp"
#include "coshard/modules/tensor.hpp"

namespace coshard::modules {

// How a parameter starts. Values depend only on (seed, the parameter's full name), never on
// layout, sharding or world size, so every ZeRO stage starts from the same weights.
struct Init {
  enum class Kind : std::uint8_t { zeros, ones, normal, uniform };
  Kind kind = Kind::zeros;
  double a = 0;  // normal: std; uniform: low
  double b = 0;  // uniform: high
  static Init zeros() { return {Kind::zeros, 0, 0}; }
  static Init ones() { return {Kind::ones, 0, 0}; }
  static Init normal(double stddev) { return {Kind::normal, stddev, 0}; }
  static Init uniform(double low, double high) { return {Kind::uniform, low, high}; }
};

// Whether `name` matches the glob `pattern`: `*` matches any run of characters (dots included),
// `?` any one character; everything else matches itself.
bool glob_matches(std::string_view pattern, std::string_view name) noexcept;

// Fills `out` with the initial values of the parameter `full_name` (host memory, any length).
void initial_values(const Init& init, std::string_view full_name, std::uint64_t seed, std::span<double> out);

// How a tensor-parallel parameter is this rank's part of a whole one (Megatron's split): along
// `dim` (0: rows, 1: columns of a matrix), the whole is `segments` runs (their sizes along dim,
// summing to its extent: a fused projection's q | k | v rows, say), each cut into `parts` equal
// pieces; this rank keeps piece `index` of every segment, in order. A parameter without one is
// replicated: every tensor rank holds the whole of it.
struct TensorSplit {
  int dim = 0;
  std::vector<std::int64_t> segments;
  std::int64_t parts = 1;
  std::int64_t index = 0;
  Shape whole;  // the whole parameter's shape

  // The part's shape (the whole's, with dim divided by parts); an error naming what does not
  // divide, or a dim the shape does not have.
  Result<Shape> part_shape() const;
  // The part, row-major, from the whole's values (whole.numel() of them), and back.
  void take_part(std::span<const double> whole_values, std::span<double> part) const;
  void place_part(std::span<const double> part, std::span<double> whole_values) const;
};

class Parameter {
 public:
  Parameter(std::string name, Shape shape, Init init) : name_(std::move(name)), shape_(shape), init_(init) {}

  const std::string& name() const noexcept { return name_; }  // local to its module
  const Shape& shape() const noexcept { return shape_; }
  std::int64_t numel() const noexcept { return shape_.numel(); }
  const Init& init() const noexcept { return init_; }

  // The values: empty while the parameter is not bound (at stage 3, while its unit is not
  // gathered); an ask then is recorded, so an engine can name the parameter when the module that
  // read it fails (a read of another module's parameter that was not declared).
  const Tensor& value() const noexcept {
    if (!value_) value_missed_ = true;
    return value_;
  }
  // The gradient to add into during backward: empty when the parameter is frozen (skip it).
  // Asked for while the parameter trains but has no gradient bound (another module reads it
  // without declaring it: Module::use_parameters_of), it is empty too, and the ask is recorded:
  // an engine refuses the step naming the parameter, instead of losing the gradient in silence.
  const Tensor& grad() const noexcept {
    if (!grad_ && trainable_ && value_) gradient_missed_ = true;
    return grad_;
  }
  // Whether grad() was asked for without a gradient bound since the last clear (an engine's check).
  bool gradient_missed() const noexcept { return gradient_missed_; }
  // Whether value() was asked for while unbound since the last clear.
  bool value_missed() const noexcept { return value_missed_; }
  void clear_gradient_missed() noexcept {
    gradient_missed_ = false;
    value_missed_ = false;
  }
  bool bound() const noexcept { return static_cast<bool>(value_); }
  // Points the parameter at memory owned elsewhere (shape must match; grad may be empty when
  // only inference runs). A frozen parameter is bound without its gradient whatever is given, so
  // layers never compute it.
  Result<void> bind(Tensor value, Tensor grad);

  // Whether the parameter trains (PyTorch's requires_grad). A frozen one gets no gradient, no
  // reduction and no update (no decay, no moments): it keeps its value bit for bit. Set it before
  // a ParameterStore or engine is built for the model (an engine refuses a step after a change,
  // naming the parameter); refused while the parameter is bound.
  bool trainable() const noexcept { return trainable_; }
  Result<void> set_trainable(bool trainable);
  void unbind() noexcept {
    value_ = {};
    grad_ = {};
  }

  // Tensor parallelism: which part of a whole parameter this one is (null: replicated, or no
  // tensor parallelism). Set by the layer that made it; refused when the part's shape is not this
  // parameter's.
  const TensorSplit* split() const noexcept { return split_.get(); }
  Result<void> set_split(TensorSplit split);
  // The whole parameter's shape: the split's, else this one's.
  const Shape& whole_shape() const noexcept { return split_ ? split_->whole : shape_; }

  // Expert parallelism: the size of the expert-parallel group of which one rank holds this
  // parameter (an expert of a SparseMoe whose experts are partitioned over that many ranks), or 1:
  // every rank of the engine's world holds it. Set by the layer that made it, before an engine.
  int expert_parallel() const noexcept { return expert_parallel_; }
  Result<void> set_expert_parallel(int group_size);

 private:
  std::string name_;
  Shape shape_;
  Init init_;
  bool trainable_ = true;
  mutable bool gradient_missed_ = false;
  mutable bool value_missed_ = false;
  Tensor value_;
  Tensor grad_;
  std::shared_ptr<const TensorSplit> split_;
  int expert_parallel_ = 1;
};

// Fills `out` (parameter.numel()) with the parameter's initial values: initial_values of the
// whole parameter, then this rank's part of them when it is split, so a tensor-parallel model
// starts from the unsplit one's weights.
void initial_values(const Parameter& parameter, std::string_view full_name, std::uint64_t seed, std::span<double> out);

class Module;
class Context;

// Called around every module a container runs. The engine implements these; the default does
// nothing. `before_*` may suspend (waiting for a budget or a gather); `after_*` must not block.
class ModuleHooks {
 public:
  virtual ~ModuleHooks() = default;
  virtual async::Task<Result<void>> before_forward(Context& ctx, Module& module) = 0;
  virtual Result<void> after_forward(Context& ctx, Module& module) = 0;
  virtual async::Task<Result<void>> before_backward(Context& ctx, Module& module) = 0;
  virtual Result<void> after_backward(Context& ctx, Module& module) = 0;
  // `module`'s forward or backward failed with `error`: the hooks may explain it (an engine names
  // a parameter the module read while it was not gathered). The default returns it unchanged.
  virtual Error explain_failure(Module& module, Error error) {
    (void)module;
    return error;
  }
  // The context's stream waits for `done`, the event of a collective a layer enqueued on another
  // stream (tensor parallelism's sums): an engine times the wait as exposed communication. `what`
  // names it and must outlive the step. The default: the stream waits.
  virtual Result<void> wait_for_collective(Context& ctx, const async::Event& done, const std::string& what);
  // The ranks that train the model together agree on a choice a module made from its own data (a
  // mixture-of-experts layer's routed experts: `chosen[i]` nonzero where this rank chose i): on
  // return each flag is set where any rank's was, so every rank runs the same modules in the same
  // order and their collectives match. Every rank calls it at the same point of a pass. `what`
  // names it in errors. The default (one rank, no engine): unchanged.
  virtual async::Task<Result<void>> agree_on_union(Context& ctx, std::span<double> chosen, const std::string& what);
  // `modules` run next, in this order, though the model's past passes do not say so (the experts
  // a mixture-of-experts layer routed to): an engine may gather them ahead. The default: nothing.
  virtual void announce_next(Context& ctx, std::span<Module* const> modules);
};

namespace detail {
class Kernels;
}

// How causal attention runs on CUDA: fused (flash-style kernels that keep one statistic per query
// row, for bf16/f16 and head sizes 32, 64, 96, 128; other cases fall back), materialized (the
// T x T probabilities in device memory, as the CPU always does), or cudnn (NVIDIA's fused
// attention through cuDNN's graph API, opened at run time, for bf16/f16 and head sizes that are
// multiples of 8 up to 128, one statistic a row kept; where cuDNN is absent or has no engine for
// a shape, the fused kernels run, and the run header says which). The CPU ignores it.
enum class AttentionKernels { fused, materialized, cudnn };

struct ContextOptions {
  AttentionKernels attention = AttentionKernels::fused;
};

class Decoding;  // decoding.hpp

// Where modules run: a stream, the allocator activations come from, and the kernels for the
// stream's device. Cheap to pass by reference; not thread-safe (one per compute stream).
class Context {
 public:
  // Fails when the stream's device has no kernels in this build (CUDA without COSHARD_CUDA), or
  // the allocator serves another device. The context keeps pointers to `stream` and `allocator`:
  // they must stay where they are (not moved) and outlive it and every tensor it made, and the
  // stream must have passed its last use before they go (zero::run_on_ranks keeps all three).
  static Result<Context> create(async::Stream& stream, async::CachingAllocator& allocator,
                                ContextOptions options = {});

  async::Stream& stream() const noexcept { return *stream_; }
  async::CachingAllocator& allocator() const noexcept { return *allocator_; }
  async::Device device() const noexcept { return stream_->device(); }
  const detail::Kernels& kernels() const noexcept { return *kernels_; }

  void set_hooks(ModuleHooks* hooks) noexcept { hooks_ = hooks; }
  ModuleHooks* hooks() const noexcept { return hooks_; }

  // Incremental decoding (decoding.hpp): while one is set, forwards continue its sequences with
  // a key/value cache (set it with Decoding::Scope; none: ordinary forwards).
  Decoding* decoding() const noexcept { return decoding_; }
  void set_decoding(Decoding* decoding) noexcept { decoding_ = decoding; }

  // Inside a recompute of activation checkpointing (checkpointing.hpp): forwards run again to
  // rebuild what backward needs; hooks see it (an engine fetches without counting a use).
  bool recomputing() const noexcept { return recompute_depth_ > 0; }
  class RecomputeScope {
   public:
    explicit RecomputeScope(Context& ctx) noexcept : ctx_(&ctx) { ++ctx_->recompute_depth_; }
    ~RecomputeScope() { --ctx_->recompute_depth_; }
    RecomputeScope(const RecomputeScope&) = delete;
    RecomputeScope& operator=(const RecomputeScope&) = delete;

   private:
    Context* ctx_;
  };

  // The bytes of the tensors this context made (empty, zeros, upload: activations, their
  // gradients, the modules' temporaries) still held, and the most held at once since the last
  // reset_activation_peak. Counted in program order as tensors are made and dropped (what was
  // asked for, whichever cached block served it), so one program gives one peak.
  struct ActivationMemory {
    std::size_t live_bytes = 0;
    std::size_t peak_bytes = 0;
  };
  ActivationMemory activation_memory() const noexcept;
  struct ActivationMeter;  // (module.cpp)
  void reset_activation_peak() noexcept;

  // A new tensor from the allocator, for use on this stream. Contents undefined.
  Result<Tensor> empty(Shape shape, DataType dtype);
  Result<Tensor> zeros(Shape shape, DataType dtype);
  // A new tensor holding a copy of `host` (exactly shape.numel() * size_of(dtype) bytes). The
  // copy runs in stream order from a staging copy, so `host` may go at once.
  Result<Tensor> upload(std::span<const std::byte> host, Shape shape, DataType dtype);
  // Copies `host` (exactly dst.bytes()) into an existing tensor, in stream order, from a staging
  // copy (so `host` may go at once).
  Result<void> copy_from_host(const Tensor& dst, std::span<const std::byte> host);
  // The tensor's bytes, once the stream has produced them: copies into pinned memory and awaits
  // the copy's event (the host does not block).
  async::Task<Result<std::vector<std::byte>>> read_bytes(Tensor tensor);
  // The same, as doubles (f32/f64/bf16/f16/i32).
  async::Task<Result<std::vector<double>>> read(Tensor tensor);

  // Runs `module` with the hooks around it. Containers call these for their children.
  async::Task<Result<Tensor>> forward(Module& module, Tensor input);
  async::Task<Result<Tensor>> backward(Module& module, Tensor grad_output);

 private:
  Context(async::Stream& stream, async::CachingAllocator& allocator, const detail::Kernels& kernels);
  async::Stream* stream_;
  async::CachingAllocator* allocator_;
  const detail::Kernels* kernels_;
  ModuleHooks* hooks_ = nullptr;
  Decoding* decoding_ = nullptr;
  int recompute_depth_ = 0;
  std::shared_ptr<ActivationMeter> meter_;  // shared with the tensors it counts, which may outlive it
};

// What a layer keeps from a forward for its backward, one entry per call: forward pushes, backward
// takes the last one (a pass's backward undoes the uses in reverse order), so one instance may run
// several times in a pass (weight sharing across positions, a block applied twice), each backward
// with its own forward's activations.
template <class Saved>
class SavedPerCall {
 public:
  void push(Saved saved) { calls_.push_back(std::move(saved)); }
  // The last call's, removed; an error naming `layer` when no forward is left to undo.
  Result<Saved> pop(std::string_view layer) {
    if (calls_.empty())
      return fail(ErrorCode::invalid_argument, layer, ": backward without a forward (nothing saved)");
    Saved saved = std::move(calls_.back());
    calls_.pop_back();
    return saved;
  }
  void clear() noexcept { calls_.clear(); }
  std::size_t size() const noexcept { return calls_.size(); }

 private:
  std::vector<Saved> calls_;
};

class Module {
 public:
  struct Child {
    std::string name;
    std::unique_ptr<Module> module;
  };

  Module() = default;
  Module(const Module&) = delete;
  Module& operator=(const Module&) = delete;
  virtual ~Module() = default;

  virtual std::string_view type_name() const = 0;
  // Enqueue the pass on ctx.stream(); keep what backward needs. Leaf modules must not suspend
  // except through ctx.forward/backward of children.
  virtual async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) = 0;
  // Returns the gradient of the input (empty for inputs without one, such as token ids) and
  // adds the gradients of this module's parameters into their bound grad tensors.
  virtual async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) = 0;
  // Drops activations saved for backward (after backward, or when a pass is abandoned).
  virtual void clear_saved() {}
  // A module that runs more than once in a pass (a table shared by the input embedding and the
  // output layer, a layer applied at several positions, a block applied twice) says so: an engine
  // then fetches it for each use, as a unit of its own (a leaf) or as units that never reach
  // outside it (a container), and reduces its gradient after each backward. Every built-in layer
  // keeps what each call's backward needs (SavedPerCall), so the gradients are the sum over the
  // uses. Undeclared, such a module fails by name where its parameters are not there for the
  // second use (stages 0, 2, 3; stage 1 needs no declaration).
  virtual bool runs_more_than_once_per_pass() const noexcept { return runs_more_than_once_; }
  // Declares it for this instance; before an engine is built for the model.
  void set_runs_more_than_once_per_pass(bool runs = true) noexcept { runs_more_than_once_ = runs; }

  // This module also reads the parameters of `owner`, another module of the same model (an output
  // layer of one's own tied to the embedding's table, say): an engine gathers owner's unit
  // whenever this module runs (stage 3) and adds this module's gradient into owner's before it is
  // reduced, so the numbers are the unsharded model's at every stage. Reading another module's
  // parameter without declaring it loses that gradient at stages 0, 2 and 3 (an engine then
  // refuses the step, naming the parameter: Parameter::grad). Not itself, not twice.
  Result<void> use_parameters_of(Module& owner);
  std::span<Module* const> borrowed() const noexcept { return borrowed_; }

  std::span<const std::unique_ptr<Parameter>> parameters() const noexcept { return parameters_; }
  std::span<const Child> children() const noexcept { return children_; }

  // Depth first, parents before children; names are dotted paths ("blocks.0.attn.qkv.weight").
  void for_each_parameter(const std::function<void(const std::string& full_name, Parameter&)>& fn,
                          const std::string& prefix = "");
  void for_each_module(const std::function<void(const std::string& path, Module&)>& fn,
                       const std::string& prefix = "");
  std::int64_t parameter_count();  // recursive
  // Freezes (false) or unfreezes (true) every parameter of this module and its children, for
  // fine-tuning; the first refusal (a bound parameter) is returned.
  Result<void> set_trainable(bool trainable);
  // The same for the parameters whose full name (as for_each_parameter gives it) matches the glob
  // `pattern` (`*` any run of characters, dots included; `?` one character): how many matched.
  // A pattern that matches nothing is an error naming it (a typo must not freeze nothing).
  Result<std::size_t> set_trainable_matching(std::string_view pattern, bool trainable);
  // Drops saved activations of this module and everything under it.
  void clear_saved_recursive();

 protected:
  Parameter& register_parameter(std::string name, Shape shape, Init init);
  std::vector<Child>& mutable_children() noexcept { return children_; }
  template <class M>
  M& register_child(std::string name, std::unique_ptr<M> module) {
    M& ref = *module;
    children_.push_back(Child{std::move(name), std::move(module)});
    return ref;
  }

 private:
  std::vector<std::unique_ptr<Parameter>> parameters_;
  std::vector<Child> children_;
  std::vector<Module*> borrowed_;
  bool runs_more_than_once_ = false;
};

// Runs its children in order (backward in reverse).
class Sequential final : public Module {
 public:
  Sequential() = default;
  template <class M>
  M& add(std::string name, std::unique_ptr<M> module) {
    return register_child(std::move(name), std::move(module));
  }
  std::string_view type_name() const override { return "Sequential"; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
  // Replaces child `index` by wrapper(child), under the same name (activation checkpointing
  // wraps blocks this way). Before any ParameterStore or engine is made for the model.
  void wrap_child(std::size_t index, const std::function<std::unique_ptr<Module>(std::unique_ptr<Module>)>& wrapper);
};

// y = x + inner(x).
class Residual final : public Module {
 public:
  explicit Residual(std::unique_ptr<Module> inner);
  std::string_view type_name() const override { return "Residual"; }
  Module& inner() const noexcept { return *children().front().module; }
  async::Task<Result<Tensor>> forward(Context& ctx, Tensor input) override;
  async::Task<Result<Tensor>> backward(Context& ctx, Tensor grad_output) override;
};

}  // namespace coshard::modules
