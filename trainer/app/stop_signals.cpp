#include "stop_signals.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <csignal>

namespace coshard::train_app {

namespace {

// The first SIGINT/SIGTERM/SIGHUP (a closed terminal) asks for a graceful stop (recorded here;
// lock-free, so safe in a handler); a second one stops the process at once, the way the signal
// would have.
std::atomic<int> g_stop_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

// --stop-timeout: the first signal also sets an alarm; if the run has not ended when it rings
// (stuck where no step boundary comes: a product that never returns, a peer that never answers),
// the process ends as the signal would have, saying so.
std::atomic<unsigned> g_stop_timeout_s{0};

// Set once the run has saved and exported everything (its closing sample is all that is left): a
// stop signal then ends the process at once instead of waiting for the sample.
std::atomic<bool> g_nothing_to_lose{false};

extern "C" void on_stop_signal(int sig) {
  if (g_nothing_to_lose.load()) {
    static constexpr char kNote[] = "coshard-train: stopped during the closing sample (everything was saved)\n";
    [[maybe_unused]] const ssize_t n = ::write(2, kNote, sizeof kNote - 1);
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    _exit(128 + sig);
  }
  if (g_stop_signal.exchange(sig) != 0) {
    std::signal(sig, SIG_DFL);
    std::raise(sig);
    return;
  }
  if (const unsigned seconds = g_stop_timeout_s.load(); seconds > 0) alarm(seconds);
}

extern "C" void on_stop_timeout(int) {
  static constexpr char kNote[] =
      "coshard-train: the run did not stop within --stop-timeout after the signal; exiting without a final save "
      "(the checkpoints already published are intact)\n";
  [[maybe_unused]] const ssize_t n = ::write(2, kNote, sizeof kNote - 1);
  const int sig = g_stop_signal.load();
  std::signal(sig, SIG_DFL);
  std::raise(sig);
  _exit(128 + sig);  // (if the signal is blocked in this thread)
}

// SIGUSR1 asks for flight records; without --flight-recorder there is nowhere to write them, and
// the signal's default action would end the run unsaved: say so and go on (write(2) is safe here).
extern "C" void on_sigusr1_without_recorder(int) {
  static constexpr char kNote[] = "coshard-train: SIGUSR1 ignored (no --flight-recorder folder to write records to)\n";
  [[maybe_unused]] const ssize_t n = ::write(2, kNote, sizeof kNote - 1);
}

}  // namespace

void install_stop_handlers(unsigned stop_timeout_s, bool note_sigusr1) {
  struct sigaction action{};
  action.sa_handler = on_stop_signal;
  action.sa_flags = SA_RESTART;  // system calls of the other threads go on
  sigemptyset(&action.sa_mask);
  g_stop_timeout_s.store(stop_timeout_s);
  struct sigaction alarm_action{};
  alarm_action.sa_handler = on_stop_timeout;
  sigemptyset(&alarm_action.sa_mask);
  sigaction(SIGALRM, &alarm_action, nullptr);
  for (const int sig : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction before{};
    sigaction(sig, nullptr, &before);
    if (before.sa_handler != SIG_IGN) sigaction(sig, &action, nullptr);  // ignored on purpose (nohup): stays so
  }
  if (note_sigusr1) {
    struct sigaction usr1{};
    usr1.sa_handler = on_sigusr1_without_recorder;
    usr1.sa_flags = SA_RESTART;
    sigemptyset(&usr1.sa_mask);
    sigaction(SIGUSR1, &usr1, nullptr);
  }
}

int stop_signal() noexcept { return g_stop_signal.load(); }

void nothing_left_to_lose() noexcept { g_nothing_to_lose.store(true); }

const char* signal_name(int sig) noexcept { return sig == SIGINT ? "SIGINT" : sig == SIGHUP ? "SIGHUP" : "SIGTERM"; }

}  // namespace coshard::train_app
