// A restart of this program with variables its libraries read only when they load (OpenBLAS's
// OPENBLAS_CORETYPE, libgomp's OMP_WAIT_POLICY). Private: not installed.
#pragma once

#include <unistd.h>

#include <cstddef>
#include <cstdlib>
#include <initializer_list>
#include <utility>

namespace coshard::modules::detail {

// execv of /proc/self/exe with argv and `vars` set in the environment. Where a variable cannot be
// set or the restart fails, the ones set are unset again and it returns.
inline void restart_self_with(char** argv, std::initializer_list<std::pair<const char*, const char*>> vars) noexcept {
  if (argv == nullptr || argv[0] == nullptr) return;
  std::size_t set = 0;
  for (const auto& [name, value] : vars) {
    if (::setenv(name, value, 1) != 0) break;
    ++set;
  }
  if (set == vars.size()) ::execv("/proc/self/exe", argv);
  for (auto it = vars.begin(); set > 0; ++it, --set) ::unsetenv(it->first);
}

}  // namespace coshard::modules::detail
