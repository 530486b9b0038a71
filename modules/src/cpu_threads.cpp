#include "coshard/modules/cpu_threads.hpp"

#include <cblas.h>

#include <algorithm>
#include <thread>

namespace coshard::modules {

void set_cpu_math_threads(int threads) noexcept { openblas_set_num_threads(std::max(1, threads)); }

int cpu_math_threads() noexcept { return openblas_get_num_threads(); }

int default_cpu_math_threads(int ranks_in_process) noexcept {
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  return std::max(1, cores / std::max(1, ranks_in_process));
}

}  // namespace coshard::modules
