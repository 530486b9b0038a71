// coshard::Result<T> — the one error type at every boundary of the library.
//
// Result<T> is std::expected<T, Error> in C++23 mode, or tl::expected<T, Error> where the build
// found a `tl-expected` CMake package (COSHARD_USE_TL_EXPECTED). No exception crosses the public
// API: an operation that can fail returns a Result whose Error names what failed, the value, and
// what was expected.
//
// This header must stay out of `.cu` files: nvcc has no C++23 mode. CUDA kernels are exposed
// through plain C++20 headers taking pointers, sizes and a stream.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>

#if defined(COSHARD_USE_TL_EXPECTED)
#include <tl/expected.hpp>
#else
#include <expected>
#endif

namespace coshard {

enum class ErrorCode : std::uint8_t {
  invalid_argument,  // a value outside its allowed range
  out_of_range,      // an index or size past a limit
  out_of_memory,     // an allocation failed
  timeout,           // a wait ran past its deadline
  closed,            // the other side of a channel, stream or connection is gone
  shutdown,          // the runtime is stopping or stopped
  strict_sync,       // a host-blocking wait attempted while strict mode is on
  task_failed,       // a task ended with an exception
  device,            // the device backend (CUDA, CPU stream) reported an error
  io,                // a file or socket operation failed
  unsupported,       // a valid request this build or backend cannot serve
  internal,          // a broken invariant inside coshard
};

std::string_view to_string(ErrorCode code) noexcept;

class Error {
 public:
  Error(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  ErrorCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_; }

  // Prefixes context ("while fetching unit 3: ...") and returns the error, for propagation.
  Error&& with_context(std::string_view context) && {
    message_.insert(0, ": ");
    message_.insert(0, context);
    return std::move(*this);
  }

 private:
  ErrorCode code_;
  std::string message_;
};

#if defined(COSHARD_USE_TL_EXPECTED)
template <class T>
using Result = tl::expected<T, Error>;
using Unexpected = tl::unexpected<Error>;
#else
template <class T>
using Result = std::expected<T, Error>;
using Unexpected = std::unexpected<Error>;
#endif

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return std::move(out).str();
}
}  // namespace detail

// fail(ErrorCode::invalid_argument, "max_live_bytes=", n, ": must be at least ", m)
// builds the message from its parts only when an error actually happens.
template <class... Parts>
Unexpected fail(ErrorCode code, const Parts&... parts) {
  return Unexpected(Error(code, detail::concat(parts...)));
}

inline Unexpected fail(Error error) { return Unexpected(std::move(error)); }

template <class T>
struct is_result : std::false_type {};
template <class T>
struct is_result<Result<T>> : std::true_type {};
template <class T>
inline constexpr bool is_result_v = is_result<T>::value;

}  // namespace coshard

#define COSHARD_DETAIL_CONCAT_INNER(a, b) a##b
#define COSHARD_DETAIL_CONCAT(a, b) COSHARD_DETAIL_CONCAT_INNER(a, b)

// COSHARD_TRY(expr): in a function returning Result<U>, returns the error of `expr` if it failed.
#define COSHARD_TRY(expr)                                                        \
  do {                                                                           \
    auto&& coshard_try_result_ = (expr);                                         \
    if (!coshard_try_result_) return ::coshard::fail(std::move(coshard_try_result_).error()); \
  } while (0)

// COSHARD_TRY_ASSIGN(auto x, expr): declares/assigns the value of `expr`, or returns its error.
#define COSHARD_TRY_ASSIGN(lhs, expr)                                            \
  auto&& COSHARD_DETAIL_CONCAT(coshard_try_, __LINE__) = (expr);                 \
  if (!COSHARD_DETAIL_CONCAT(coshard_try_, __LINE__))                            \
    return ::coshard::fail(std::move(COSHARD_DETAIL_CONCAT(coshard_try_, __LINE__)).error()); \
  lhs = std::move(*COSHARD_DETAIL_CONCAT(coshard_try_, __LINE__))

// The same two for coroutines (co_return instead of return).
#define COSHARD_CO_TRY(expr)                                                     \
  do {                                                                           \
    auto&& coshard_try_result_ = (expr);                                         \
    if (!coshard_try_result_) co_return ::coshard::fail(std::move(coshard_try_result_).error()); \
  } while (0)

#define COSHARD_CO_TRY_ASSIGN(lhs, expr)                                         \
  auto&& COSHARD_DETAIL_CONCAT(coshard_try_, __LINE__) = (expr);                 \
  if (!COSHARD_DETAIL_CONCAT(coshard_try_, __LINE__))                            \
    co_return ::coshard::fail(std::move(COSHARD_DETAIL_CONCAT(coshard_try_, __LINE__)).error()); \
  lhs = std::move(*COSHARD_DETAIL_CONCAT(coshard_try_, __LINE__))
