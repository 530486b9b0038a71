// The CPU's bf16 and f16 matrix products. Where the CPU has the instructions (AVX512-BF16 or AMX
// for bf16; AVX512-FP16 or AMX for f16, where oneDNN takes them) they run through oneDNN's matmul
// on the half-precision operands with f32 accumulation; elsewhere, or in a build without oneDNN,
// on f32 copies through OpenBLAS, as before. COSHARD_CPU_ISA caps the instructions oneDNN may use
// (as ONEDNN_MAX_CPU_ISA does), e.g. to compare, or to keep a run's bits on another machine.
#pragma once

#include <string>

#include "coshard/async/dtype.hpp"
#include "coshard/async/result.hpp"

namespace coshard::modules {

using async::DataType;

struct CpuHalfProducts {
  bool built = false;  // oneDNN in this build
  std::string isa;     // the instructions oneDNN runs ("avx512_core_bf16", "avx512_core_amx", ...)
  bool amd = false;    // an AMD CPU (cpu_vector_support().amd)
  bool amx = false;    // oneDNN runs AMX here
  bool bf16 = false;   // bf16 products native (through oneDNN): with AMX, on AMD's AVX512-BF16, or where
                       // COSHARD_CPU_ISA asks
  bool f16 = false;    // f16 products native
  std::string cap{};   // COSHARD_CPU_ISA's value where it caps oneDNN's instructions (empty: unset)
  bool native(DataType dt) const noexcept { return (dt == DataType::bf16 && bf16) || (dt == DataType::f16 && f16); }
  // For a run's header: what multiplies `dt` matrices ("oneDNN avx512_core_bf16 bf16 with f32
  // accumulation"), or, for bf16/f16 without them, that f32 copies do and why.
  std::string describe(DataType dt) const;
};

// Once a process: reads COSHARD_CPU_ISA (all, avx2, avx512_core, avx512_core_bf16,
// avx512_core_amx; unset: all), caps oneDNN there and tries a product of each dtype. bf16 native
// by default where oneDNN runs AMX, and on AMD's CPUs with AVX512-BF16 (Zen 4 and later: about
// four times OpenBLAS's f32 rate); on Intel's AVX512-BF16 without AMX (slower there than f32
// through OpenBLAS) when COSHARD_CPU_ISA names avx512_core_bf16 or avx512_core_amx; f16 native
// with AMX or where asked. COSHARD_CPU_ISA=avx512_core keeps the f32 copies anywhere. An unknown
// value is an error naming it and the choices.
Result<CpuHalfProducts> cpu_half_products() noexcept;

// oneDNN's products run on OpenMP threads (libgomp), whose idle threads spin between products by
// default and take the cores the rank's other math threads (element-wise kernels, OpenBLAS) need
// then: OMP_WAIT_POLICY=PASSIVE made the bf16 step of docs/performance.md's Llama 13% faster on 2
// cores. libgomp reads the variable once, when it loads, before main: this restarts the program
// (execv of /proc/self/exe with argv) with OMP_WAIT_POLICY=PASSIVE unless the variable is set
// already or the build has no oneDNN. Returns when there was nothing to do or the restart failed.
// Call it before anything that a restart would repeat or lose (coshard-train: after reading its
// command line, for a run whose products on the CPU are native bf16/f16 on more than one thread).
void restart_with_passive_openmp(char** argv) noexcept;

}  // namespace coshard::modules
