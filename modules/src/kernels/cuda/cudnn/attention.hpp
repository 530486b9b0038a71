// cuDNN's fused attention for the CUDA backend (AttentionKernels::cudnn): each device's plan
// cache (plans built with a handle made on that device), and a handle per (device, stream) set
// to its stream, as cuBLAS's are (blas.cpp). Both live as long as the process.
#pragma once

#include "kernels/cuda/cudnn/sdpa.hpp"

namespace coshard::modules::detail::cudnn {

struct SdpaPlans {
  const SdpaPlan* forward = nullptr;
  const SdpaPlan* backward = nullptr;
};

// Both passes' plans for the shape on `device`, or why cuDNN does not serve it there (the
// library absent, the shape not taken, no engine for it): the caller then runs its own kernels.
// A shape's answer is decided once.
Result<SdpaPlans> attention_plans(int device, const SdpaShape& shape);

// Runs a plan on the stream (its handle set to it first).
Result<void> attention_forward(async::Stream& s, const SdpaPlan& plan, const void* qkv, void* out, float* stats);
Result<void> attention_backward(async::Stream& s, const SdpaPlan& plan, const void* dout, const void* qkv,
                                const void* out, const float* stats, void* dqkv, void* scratch);

}  // namespace coshard::modules::detail::cudnn
