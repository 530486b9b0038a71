// A pause hint for spin loops (lets the sibling hyper-thread run, saves power), and the spin loop.
#pragma once

#include <chrono>

namespace coshard::async::detail {
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}

// Spins until `ready()` holds or `budget` has passed (checking the clock every 64 pauses);
// true if ready. The spin half of every spin-then-park wait: a hand-off by spinning costs
// ~0.1 µs on these VMs, one by futex ~25 µs.
template <class Ready>
bool spin_until(Ready ready, std::chrono::nanoseconds budget) noexcept {
  const auto deadline = std::chrono::steady_clock::now() + budget;
  do {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      cpu_relax();
    }
  } while (std::chrono::steady_clock::now() < deadline);
  return false;
}

}  // namespace coshard::async::detail
