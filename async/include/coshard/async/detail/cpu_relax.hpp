// A pause hint for spin loops (lets the sibling hyper-thread run, saves power).
#pragma once

namespace coshard::async::detail {
inline void cpu_relax() noexcept {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield" ::: "memory");
#endif
}
}  // namespace coshard::async::detail
