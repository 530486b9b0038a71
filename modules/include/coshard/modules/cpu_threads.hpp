// The CPU kernels' math threads: one setting for the whole process that bounds all three kinds of
// work a rank splits across cores: OpenBLAS's matrix products, oneDNN's bf16/f16 products (its
// OpenMP threads) and the element-wise kernels and optimizer (coshard's pool). With several ranks
// as threads of one process, each rank's products would start OpenBLAS's default threads (one per
// core) on the same cores: the default job ran 2.1x slower on 2 cores that way. So ranks get
// cores / (the machine's ranks) threads each, at least one: the ranks of this process, or the
// launcher's local ranks when each is a process (coshard-train and run_on_ranks).
#pragma once

namespace coshard::modules {

// Math threads for every product and split kernel of this process from now on (at least 1).
void set_cpu_math_threads(int threads) noexcept;
int cpu_math_threads() noexcept;
// The cores of this machine divided by the ranks that run as threads of this process (1 for a
// process per rank), at least 1.
int default_cpu_math_threads(int ranks_in_process) noexcept;

}  // namespace coshard::modules
