#include "coshard/modules/cpu_blas_kernels.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>

#include "kernels/cpu/restart_self.hpp"

extern "C" char* openblas_get_corename(void);

namespace coshard::modules {

namespace {

// The environment variable that marks a restart by choose_blas_kernels_and_restart: the kernels
// OpenBLAS had chosen (and never a second restart).
constexpr const char* kReplaced = "COSHARD_BLAS_REPLACED";

enum class Tier : int { sse = 0, avx = 1, avx2 = 2, avx512 = 3 };

Tier tier_of(std::string_view core) {
  std::string c(core);
  std::transform(c.begin(), c.end(), c.begin(), [](unsigned char ch) { return static_cast<char>(std::tolower(ch)); });
  for (const char* name : {"skylakex", "cooperlake", "sapphirerapids"})
    if (c == name) return Tier::avx512;
  for (const char* name : {"haswell", "zen"})
    if (c == name) return Tier::avx2;
  for (const char* name : {"sandybridge", "bulldozer", "piledriver", "steamroller", "excavator"})
    if (c == name) return Tier::avx;
  return Tier::sse;  // Prescott (the generic fallback), Core2, Nehalem, Atom, Barcelona, ...
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? std::string(v) : std::string();
}

}  // namespace

CpuVectorSupport cpu_vector_support() noexcept {
  CpuVectorSupport s;
#if defined(__x86_64__) || defined(__i386__)
  __builtin_cpu_init();
  s.amd = __builtin_cpu_is("amd");
  s.avx = __builtin_cpu_supports("avx");
  s.avx2_fma = s.avx && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  s.avx512 = s.avx2_fma && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512cd") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
             __builtin_cpu_supports("avx512vl");
#endif
  return s;
}

std::string better_blas_core(std::string_view running, const CpuVectorSupport& cpu) {
  // AMD's AVX-512 (Zen 4) stays on the Zen kernels OpenBLAS picks for it: its 512-bit units are
  // two 256-bit halves, and the Zen kernels are what OpenBLAS's maintainers tuned there.
  Tier best = Tier::sse;
  std::string core;
  if (cpu.avx512 && !cpu.amd) {
    best = Tier::avx512;
    core = "SkylakeX";
  } else if (cpu.avx2_fma) {
    best = Tier::avx2;
    core = cpu.amd ? "Zen" : "Haswell";
  } else if (cpu.avx) {
    best = Tier::avx;
    core = "Sandybridge";
  }
  if (core.empty() || static_cast<int>(tier_of(running)) >= static_cast<int>(best)) return {};
  return core;
}

CpuBlasKernels cpu_blas_kernels() {
  CpuBlasKernels k;
  const char* name = openblas_get_corename();
  k.running = name ? name : "unknown";
  k.better = better_blas_core(k.running, cpu_vector_support());
  k.replaced = env(kReplaced);
  k.user_choice = k.replaced.empty() ? env("OPENBLAS_CORETYPE") : std::string();
  return k;
}

std::string CpuBlasKernels::describe() const {
  std::string out = "OpenBLAS " + running + " kernels";
  if (!replaced.empty()) out += " (OpenBLAS chose " + replaced + " for this CPU; coshard set OPENBLAS_CORETYPE=" + running + ")";
  else if (!user_choice.empty()) out += " (OPENBLAS_CORETYPE=" + user_choice.substr(0, 64) + ")";
  return out;
}

std::string CpuBlasKernels::warning() const {
  if (better.empty()) return {};
  std::string out = "OpenBLAS runs its " + running + " kernels on this CPU, which runs its " + better +
                    " kernels (matrix products on the CPU 3-5x faster): ";
  if (!user_choice.empty())
    return out + "OPENBLAS_CORETYPE=" + user_choice.substr(0, 64) + " asks for them; unset it, or set OPENBLAS_CORETYPE=" +
           better + " before the process starts";
  return out + "set OPENBLAS_CORETYPE=" + better + " before the process starts (OpenBLAS reads it when it loads)";
}

void choose_blas_kernels_and_restart(char** argv) noexcept {
  if (argv == nullptr || argv[0] == nullptr) return;
  if (std::getenv("OPENBLAS_CORETYPE") != nullptr || std::getenv(kReplaced) != nullptr) return;
  const char* name = openblas_get_corename();
  if (name == nullptr) return;
  const std::string better = better_blas_core(name, cpu_vector_support());
  if (better.empty()) return;
  // (where the restart fails: on as OpenBLAS chose, and the warning says so)
  detail::restart_self_with(argv, {{kReplaced, name}, {"OPENBLAS_CORETYPE", better.c_str()}});
}

}  // namespace coshard::modules
