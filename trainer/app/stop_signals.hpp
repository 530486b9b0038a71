// coshard-train's stop signals: the first SIGINT/SIGTERM/SIGHUP finishes the step, saves and
// exits; a second stops at once; --stop-timeout bounds the wait for a run stuck where no step
// boundary comes; SIGUSR1 without a flight recorder is named and ignored. The ranks read the
// signal at the top of each step (rank_run.cpp).
#pragma once

namespace coshard::train_app {

// Installs the handlers (a signal ignored on purpose, as under nohup, stays ignored). With
// `note_sigusr1`, SIGUSR1 is answered with a note instead of its default (which ends the run).
void install_stop_handlers(unsigned stop_timeout_s, bool note_sigusr1);
// The signal that asked the run to stop (0: none yet). Lock-free: set inside the handler.
int stop_signal() noexcept;
// The run has saved and exported everything (its closing sample is all that is left): a stop
// signal from now on ends the process at once instead of waiting for the sample.
void nothing_left_to_lose() noexcept;
const char* signal_name(int sig) noexcept;

}  // namespace coshard::train_app
