// The optimizer's CPU kernels (private): the step's control (step_begin; the gradients' squared
// norm and overflow check; step_end's skip and dynamic loss scale) and the AdamW and SGD updates
// of f32 masters, with their rounding into the parameters. CpuKernels (cpu_kernels.cpp) checks the
// dtypes and calls these; the rules of each are Kernels' (kernels.hpp).
#pragma once

#include <cstdint>

#include "kernels/kernels.hpp"

namespace coshard::modules::detail::cpu {

Result<void> step_begin(async::Stream& s, StepState* state);
// The norm's f32 partial sums go in blocks of 4096 elements, added up in f64 in block order: the
// same bits on every run and core count.
Result<void> grad_stats(async::Stream& s, DataType gdt, const void* grad, std::int64_t n, StepState* state);
Result<void> adamw(async::Stream& s, float* master, DataType gdt, const void* grad, float* m, float* v, DataType pdt,
                   void* param_out, std::int64_t n, const AdamArgs& a, const StepState* state);
Result<void> sgd(async::Stream& s, float* master, DataType gdt, const void* grad, float* buf, DataType pdt,
                 void* param_out, std::int64_t n, const SgdArgs& a, const StepState* state);
Result<void> step_end(async::Stream& s, StepState* state, const LossScaleArgs& a);

}  // namespace coshard::modules::detail::cpu
