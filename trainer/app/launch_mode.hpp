// Under a launcher (mpirun, srun, torchrun's variables) every rank learns what the others were
// asked to do before any goes its way: a rank given --print-config or --estimate alone used to
// print and exit 0 before its collectives started, and the others waited for it forever (in
// MPI_Init, or in their first collective). Now each rank joins the others, the ranks all-gather
// their modes, and a difference fails every rank, naming the ranks.
#pragma once

#include <cstdint>
#include <functional>

#include "coshard/async/task.hpp"
#include "coshard/collectives/communicator.hpp"
#include "coshard/collectives/env.hpp"
#include "command_line.hpp"

namespace coshard::train_app {

enum class LaunchMode : std::int32_t { train = 0, print_config = 1, estimate = 2 };

// Whether this process is one rank of several started by a launcher (then the modes are agreed).
bool launched_with_others(const Options& o) noexcept;

// The options run's communicator of this process's rank is made with (--backend, --device, the timeout).
collectives::FromEnvOptions process_communicator_options(const Options& o, collectives::Backend backend);

// One all-gather of every rank's mode over `comm`; an error names the ranks whose mode is not rank 0's.
async::Task<Result<void>> agree_on_launch_mode(collectives::Communicator& comm, LaunchMode mine);

// A rank asked to print (--print-config, --estimate) under a launcher: joins the others, agrees on
// the mode, then `act` (rank 0 prints; every rank returns its exit status). 2 when the ranks differ.
int finish_early_under_launcher(const Options& o, LaunchMode mode, const std::function<int()>& act);

}  // namespace coshard::train_app
