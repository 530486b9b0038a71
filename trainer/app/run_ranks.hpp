// coshard-train's ranks: started as threads of this process (the Local backend) or as this
// process's one rank (under a launcher, or NCCL/MPI), each running rank_run; a rank that fails,
// even to start, aborts its communicator so the others stop naming it; then the outcome is said
// (the errors, or the stop signal's step).
#pragma once

#include "command_line.hpp"

namespace coshard::train_app {

// The run of `o`, checked and prepared; its exit status (0, 1 a failure, 2 a refusal, 128 + the
// stop signal).
int run_ranks(const Options& o);

// The ranks on this machine: this process's threads, or the launcher's local processes.
int ranks_on_this_machine(const Options& o);

// Each rank's CPU math threads: --blas-threads, else the machine's cores divided by its ranks
// (this process's threads, or the launcher's local processes).
int rank_math_threads(const Options& o);

}  // namespace coshard::train_app
