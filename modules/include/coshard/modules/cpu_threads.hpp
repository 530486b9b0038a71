// The CPU kernels' matrix products run on OpenBLAS, whose thread count is one setting for the
// whole process. With several ranks as threads of one process, each rank's products would
// start OpenBLAS's default threads (one per core) on the same cores: the default job ran 2.1x
// slower on 2 cores that way. So ranks get cores / ranks threads each (at least one).
#pragma once

namespace coshard::modules {

// OpenBLAS threads for every matrix product of this process from now on (at least 1).
void set_cpu_math_threads(int threads) noexcept;
int cpu_math_threads() noexcept;
// The cores of this machine divided by the ranks that run as threads of this process (1 for a
// process per rank), at least 1.
int default_cpu_math_threads(int ranks_in_process) noexcept;

}  // namespace coshard::modules
