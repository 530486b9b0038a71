// Which OpenBLAS kernels run the CPU's matrix products, and whether this CPU could run better ones.
// OpenBLAS picks its kernels once, when it loads, from the CPU's model: a model newer than the
// library (Sapphire Rapids-class Xeons under Debian 12's 0.3.21) gets its generic Prescott
// kernels, a third of the speed, without a word. OPENBLAS_CORETYPE, read at load, overrides it.
#pragma once

#include <string>
#include <string_view>

namespace coshard::modules {

// The vector instructions this CPU runs (and the OS saves the registers of), by kernel tier.
struct CpuVectorSupport {
  bool amd = false;
  bool avx = false;
  bool avx2_fma = false;
  bool avx512 = false;  // F, CD, BW, DQ and VL: what OpenBLAS's SkylakeX kernels use
};
CpuVectorSupport cpu_vector_support() noexcept;

// The OpenBLAS core (an OPENBLAS_CORETYPE value) whose kernels `cpu` runs best, when its tier is
// above `running`'s (OpenBLAS's core name); else empty. Never a core whose instructions the CPU
// lacks: SkylakeX needs AVX-512, Haswell (Zen on AMD) AVX2 and FMA, Sandybridge AVX.
std::string better_blas_core(std::string_view running, const CpuVectorSupport& cpu);

struct CpuBlasKernels {
  std::string running;      // openblas_get_corename()
  std::string better;       // better_blas_core(running, this CPU): empty when the best already run
  std::string user_choice;  // OPENBLAS_CORETYPE as the process found it (empty: not set)
  std::string replaced;     // the kernels OpenBLAS chose before choose_blas_kernels_and_restart set better ones
  // For a run's header: "OpenBLAS Haswell kernels", with who chose them.
  std::string describe() const;
  // Empty when the best kernels this CPU runs are running; else what runs, what could, and the fix.
  std::string warning() const;
};
CpuBlasKernels cpu_blas_kernels();

// First thing in a program's main, before any thread starts: when OpenBLAS runs a lower tier of
// kernels than this CPU supports and OPENBLAS_CORETYPE is not set, sets it to the better core and
// executes the program again with the same arguments (OpenBLAS reads it only when it loads;
// cpu_blas_kernels().replaced then names the kernels it replaced). Returns when there was nothing
// to do, or the restart failed (the weaker kernels run, and warning() says so).
void choose_blas_kernels_and_restart(char** argv) noexcept;

}  // namespace coshard::modules
