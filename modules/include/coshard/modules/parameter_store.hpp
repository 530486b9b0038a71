// ParameterStore: the unsharded (ZeRO stage 0) home of a model's parameters.
//
// Every parameter of the model is bound to a view into one flat value buffer and one flat
// gradient buffer (depth-first order, no padding), so zeroing the gradients is one fill and an
// optimizer steps one flat span. Initial values depend only on (seed, parameter name): a sharded
// engine started from the same seed holds the same weights.
//
// save/load move weights to and from safetensors, the format PyTorch and Hugging Face use.
// Loading is strict, like PyTorch's load_state_dict(strict=True): every parameter must be in
// the file with its shape, and the file may hold nothing else; dtypes are converted
// (F32/F64/BF16/F16). Nothing is written to the parameters unless the whole file checks out.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "coshard/modules/module.hpp"

namespace coshard::modules {

class ParameterStore {
 public:
  struct Entry {
    std::string name;  // full dotted name
    Parameter* parameter = nullptr;
    std::int64_t offset = 0;  // elements into the flat buffers
  };

  // Allocates the flat buffers on ctx's device and binds every parameter of `model` (which must
  // outlive the store). Gradients start at zero; values are undefined until initialize or load.
  static Result<ParameterStore> create(Context& ctx, Module& model, DataType dtype);

  ParameterStore(ParameterStore&&) noexcept = default;
  ParameterStore& operator=(ParameterStore&&) noexcept = default;
  ~ParameterStore();  // unbinds the parameters

  async::Task<Result<void>> initialize(Context& ctx, std::uint64_t seed);
  Result<void> zero_grad(Context& ctx);
  async::Task<Result<void>> save(Context& ctx, const std::filesystem::path& path,
                                 std::map<std::string, std::string> metadata);
  // No metadata. (Not a default argument: GCC 12 miscompiles a coroutine whose class-type
  // parameter comes from one.)
  async::Task<Result<void>> save(Context& ctx, const std::filesystem::path& path) {
    const std::map<std::string, std::string> none;
    return save(ctx, path, none);
  }
  async::Task<Result<void>> load(Context& ctx, const std::filesystem::path& path);

  const Tensor& values() const noexcept { return values_; }
  const Tensor& grads() const noexcept { return grads_; }
  const std::vector<Entry>& entries() const noexcept { return entries_; }
  DataType dtype() const noexcept { return values_.dtype(); }
  std::int64_t numel() const noexcept { return values_.numel(); }

 private:
  ParameterStore() = default;
  std::vector<Entry> entries_;
  Tensor values_;
  Tensor grads_;
};

}  // namespace coshard::modules
