// Which sanitizer this test build runs under, the same way with GCC (which defines
// __SANITIZE_ADDRESS__ and __SANITIZE_THREAD__) and clang (which says so through __has_feature
// only): CI's ASan + UBSan build is clang's, beside the libFuzzer targets, and its TSan build GCC's.
#pragma once

#if defined(__SANITIZE_ADDRESS__)
#define COSHARD_TEST_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define COSHARD_TEST_ASAN 1
#endif
#endif

#if defined(__SANITIZE_THREAD__)
#define COSHARD_TEST_TSAN 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define COSHARD_TEST_TSAN 1
#endif
#endif

#if defined(COSHARD_TEST_ASAN) || defined(COSHARD_TEST_TSAN)
#define COSHARD_TEST_SANITIZED 1
#endif

namespace coshard::testing {
// Under a sanitizer, end-to-end runs take a smaller shape (fewer steps, a shorter sequence): the
// sanitizer sees the same code, and the numbers' quality is checked by the normal build's run.
#if defined(COSHARD_TEST_SANITIZED)
inline constexpr bool kSanitized = true;
#else
inline constexpr bool kSanitized = false;
#endif
}  // namespace coshard::testing
