// Whether this build runs under ThreadSanitizer (private): the CPU kernels then keep the threads
// of uninstrumented libraries (OpenBLAS's workers, oneDNN's OpenMP team) out of their products,
// since TSan cannot see how those hand work back.
#pragma once

namespace coshard::modules::detail {

#if defined(__SANITIZE_THREAD__)
inline constexpr bool kThreadSanitizer = true;
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
inline constexpr bool kThreadSanitizer = true;
#else
inline constexpr bool kThreadSanitizer = false;
#endif
#else
inline constexpr bool kThreadSanitizer = false;
#endif

}  // namespace coshard::modules::detail
