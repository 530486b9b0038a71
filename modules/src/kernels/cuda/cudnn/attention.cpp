#include "kernels/cuda/cudnn/attention.hpp"

#include <cuda_runtime.h>

#include <map>
#include <memory>
#include <mutex>

#include "kernels/cuda/on_device.hpp"

namespace coshard::modules::detail::cudnn {
namespace {

struct StreamHandle {
  cudnnHandle_t handle = nullptr;
  std::mutex mutex;  // one stream's calls from two threads apart
};

class State {
 public:
  Result<SdpaPlanCache*> plans(const Library& lib, int device) {
    std::lock_guard lock(mutex_);
    auto& cache = plans_[device];  // its plans are built with a handle made on the device
    if (!cache) {
      COSHARD_TRY_ASSIGN(cudnnHandle_t h, make_handle(lib, device));
      cache = std::make_unique<SdpaPlanCache>(PlanTarget{.handle = h});
    }
    return cache.get();
  }

  template <class Fn>
  Result<void> with_handle(const Library& lib, async::Stream& s, Fn&& fn) {
    StreamHandle* entry = nullptr;
    {
      std::lock_guard lock(mutex_);
      auto& slot = handles_[{s.device().index(), s.native_handle()}];
      if (!slot) {
        COSHARD_TRY_ASSIGN(cudnnHandle_t h, make_handle(lib, s.device().index()));
        slot = std::make_unique<StreamHandle>();
        slot->handle = h;
      }
      entry = slot.get();
    }
    std::lock_guard lock(entry->mutex);
    if (const cudnnStatus_t st = lib.set_stream(entry->handle, static_cast<cudaStream_t>(s.native_handle()));
        st != CUDNN_STATUS_SUCCESS)
      return fail(ErrorCode::device, "cudnnSetStream on stream '", s.name(), "': ", lib.describe(st));
    return fn(entry->handle);
  }

 private:
  static Result<cudnnHandle_t> make_handle(const Library& lib, int device) {
    cudnnHandle_t h = nullptr;
    const cudnnStatus_t st = on_device(device, [&] { return lib.create(&h); });
    if (st != CUDNN_STATUS_SUCCESS) return fail(ErrorCode::device, "cudnnCreate on cuda:", device, ": ", lib.describe(st));
    return h;
  }

  std::mutex mutex_;
  std::map<int, std::unique_ptr<SdpaPlanCache>> plans_;
  std::map<std::pair<int, void*>, std::unique_ptr<StreamHandle>> handles_;
};

State& state() {
  static State s;
  return s;
}

}  // namespace

Result<SdpaPlans> attention_plans(int device, const SdpaShape& shape) {
  if (std::string why = sdpa_unsupported(shape); !why.empty()) return fail(ErrorCode::unsupported, why);
  COSHARD_TRY_ASSIGN(const Library* lib, library());
  COSHARD_TRY_ASSIGN(SdpaPlanCache * cache, state().plans(*lib, device));
  COSHARD_TRY_ASSIGN(const SdpaPlan* forward, cache->get(*lib, shape, SdpaPass::forward));
  COSHARD_TRY_ASSIGN(const SdpaPlan* backward, cache->get(*lib, shape, SdpaPass::backward));
  return SdpaPlans{forward, backward};
}

Result<void> attention_forward(async::Stream& s, const SdpaPlan& plan, const void* qkv, void* out, float* stats) {
  COSHARD_TRY_ASSIGN(const Library* lib, library());
  return state().with_handle(*lib, s, [&](cudnnHandle_t h) { return plan.forward(h, s.native_handle(), qkv, out, stats); });
}

Result<void> attention_backward(async::Stream& s, const SdpaPlan& plan, const void* dout, const void* qkv,
                                const void* out, const float* stats, void* dqkv, void* scratch) {
  COSHARD_TRY_ASSIGN(const Library* lib, library());
  return state().with_handle(*lib, s, [&](cudnnHandle_t h) {
    return plan.backward(h, s.native_handle(), dout, qkv, out, stats, dqkv, scratch);
  });
}

}  // namespace coshard::modules::detail::cudnn
