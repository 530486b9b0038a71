// coshard::Result<T> — the one error type at every boundary of the library.
//
// A Result holds a T or an Error. No exception crosses the public API: an operation that can
// fail returns a Result whose Error names what failed, the value, and what was expected. It is
// coshard's own small type (the subset of std::expected the library uses: operator bool,
// has_value, *, ->, value, error, value_or, emplace), so it is one type with one ABI whether a
// consumer compiles as C++20 or C++23. value() on an error is a bug: it prints the error and
// aborts (it never throws).
//
// No CUDA kernel needs this header: kernels are exposed through plain headers taking pointers,
// sizes and a stream.
#pragma once

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>

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

namespace detail {
// What an Error says when there was not even the memory to keep its own message, and an empty
// one (a moved-from Error); both made before main, so that reporting an error never allocates.
const std::shared_ptr<const std::string>& message_lost_for_memory() noexcept;
const std::string& empty_message() noexcept;
}  // namespace detail

// Copying an Error never allocates (the message is shared, and immutable), and making one never
// throws: a thread that reports an out-of-memory error (a stream's worker) must not die of it.
class Error {
 public:
  Error(ErrorCode code, std::string message) noexcept : code_(code), message_(share(std::move(message))) {}
  // An error whose message could not be built for want of memory: it says so instead.
  static Error message_lost_for_memory(ErrorCode code) noexcept { return Error(code, detail::message_lost_for_memory()); }

  ErrorCode code() const noexcept { return code_; }
  const std::string& message() const noexcept { return message_ ? *message_ : detail::empty_message(); }

  // Prefixes context ("while fetching unit 3: ...") and returns the error, for propagation.
  // Without the memory for the longer message, the message stays as it was.
  Error&& with_context(std::string_view context) && noexcept {
    try {
      std::string longer;
      longer.reserve(context.size() + 2 + message().size());
      longer.append(context).append(": ").append(message());
      message_ = std::make_shared<const std::string>(std::move(longer));
    } catch (...) {
    }
    return std::move(*this);
  }

 private:
  Error(ErrorCode code, std::shared_ptr<const std::string> message) noexcept
      : code_(code), message_(std::move(message)) {}
  static std::shared_ptr<const std::string> share(std::string&& message) noexcept {
    try {
      return std::make_shared<const std::string>(std::move(message));
    } catch (...) {
      return detail::message_lost_for_memory();
    }
  }
  ErrorCode code_;
  std::shared_ptr<const std::string> message_;
};

// The error side of a Result: what fail() returns; converts into any Result<T>.
class Unexpected {
 public:
  explicit Unexpected(Error error) : error_(std::move(error)) {}
  const Error& error() const& noexcept { return error_; }
  Error& error() & noexcept { return error_; }
  Error&& error() && noexcept { return std::move(error_); }

 private:
  Error error_;
};

template <class T>
class Result;

namespace detail {
template <class T>
struct is_result_type : std::false_type {};
template <class T>
struct is_result_type<Result<T>> : std::true_type {};

[[noreturn]] inline void bad_result_access(const char* what, const Error* error) noexcept {
  std::fprintf(stderr, "coshard::Result::%s on %s%s\n", what, error ? "an error: " : "a value",
               error ? error->message().c_str() : "");
  std::abort();
}

// A T may be made from U by a Result's converting constructor (not from Results or errors).
template <class T, class U>
concept result_value_from = std::is_constructible_v<T, U&&> && !is_result_type<std::remove_cvref_t<U>>::value &&
                            !std::is_same_v<std::remove_cvref_t<U>, Unexpected> &&
                            !std::is_same_v<std::remove_cvref_t<U>, std::in_place_t>;
}  // namespace detail

template <class T>
class Result {
  static_assert(std::is_object_v<T> && !std::is_array_v<T>, "Result<T>: T is an object type (or void)");
  static_assert(!std::is_same_v<std::remove_cv_t<T>, Error> && !std::is_same_v<std::remove_cv_t<T>, Unexpected>,
                "Result<T>: T is not the error");

 public:
  using value_type = T;
  using error_type = Error;

  Result() requires std::is_default_constructible_v<T> : v_(std::in_place_index<0>) {}
  template <class U = T>
    requires detail::result_value_from<T, U>
  explicit(!std::is_convertible_v<U&&, T>) Result(U&& value) : v_(std::in_place_index<0>, std::forward<U>(value)) {}
  template <class... Args>
  explicit Result(std::in_place_t, Args&&... args) : v_(std::in_place_index<0>, std::forward<Args>(args)...) {}
  Result(Unexpected error) : v_(std::in_place_index<1>, std::move(error).error()) {}
  // From a Result of another value type whose value converts (unique_ptr<Derived> to <Base>).
  template <class U>
    requires(!std::is_same_v<U, T> && std::is_constructible_v<T, U &&>)
  Result(Result<U>&& other)
      : v_(other ? std::variant<T, Error>(std::in_place_index<0>, std::move(*other))
                 : std::variant<T, Error>(std::in_place_index<1>, std::move(other).error())) {}

  bool has_value() const noexcept { return v_.index() == 0; }
  explicit operator bool() const noexcept { return has_value(); }

  T& operator*() & noexcept { return *std::get_if<0>(&v_); }
  const T& operator*() const& noexcept { return *std::get_if<0>(&v_); }
  T&& operator*() && noexcept { return std::move(*std::get_if<0>(&v_)); }
  T* operator->() noexcept { return std::get_if<0>(&v_); }
  const T* operator->() const noexcept { return std::get_if<0>(&v_); }

  T& value() & { return checked(), **this; }
  const T& value() const& { return checked(), **this; }
  T&& value() && { return checked(), std::move(**this); }

  Error& error() & noexcept { return unchecked_error(); }
  const Error& error() const& noexcept { return const_cast<Result*>(this)->unchecked_error(); }
  Error&& error() && noexcept { return std::move(unchecked_error()); }

  template <class U>
  T value_or(U&& fallback) const& {
    return has_value() ? **this : static_cast<T>(std::forward<U>(fallback));
  }
  template <class U>
  T value_or(U&& fallback) && {
    return has_value() ? std::move(**this) : static_cast<T>(std::forward<U>(fallback));
  }
  template <class... Args>
  T& emplace(Args&&... args) {
    return v_.template emplace<0>(std::forward<Args>(args)...);
  }

 private:
  void checked() const noexcept {
    if (!has_value()) detail::bad_result_access("value()", std::get_if<1>(&v_));
  }
  Error& unchecked_error() noexcept {
    if (has_value()) detail::bad_result_access("error()", nullptr);
    return *std::get_if<1>(&v_);
  }
  std::variant<T, Error> v_;
};

template <>
class Result<void> {
 public:
  using value_type = void;
  using error_type = Error;

  Result() noexcept = default;
  explicit Result(std::in_place_t) noexcept {}
  Result(Unexpected error) : error_(std::move(error).error()) {}

  bool has_value() const noexcept { return !error_.has_value(); }
  explicit operator bool() const noexcept { return has_value(); }
  void operator*() const noexcept {}
  void value() const {
    if (error_) detail::bad_result_access("value()", &*error_);
  }
  void emplace() noexcept { error_.reset(); }

  Error& error() & noexcept { return checked_error(); }
  const Error& error() const& noexcept { return const_cast<Result*>(this)->checked_error(); }
  Error&& error() && noexcept { return std::move(checked_error()); }

 private:
  Error& checked_error() noexcept {
    if (!error_) detail::bad_result_access("error()", nullptr);
    return *error_;
  }
  std::optional<Error> error_;
};

namespace detail {
template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  if (!out) return *message_lost_for_memory();  // a cut message would name nothing (see fail())
  return std::move(out).str();
}
}  // namespace detail

// fail(ErrorCode::invalid_argument, "max_live_bytes=", n, ": must be at least ", m)
// builds the message from its parts only when an error actually happens.
// A stream that runs out of memory mid-message stops writing without a word (its bad_alloc is
// caught), which would leave a cut message that names nothing: that error says memory ran out.
template <class... Parts>
Unexpected fail(ErrorCode code, const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  if (!out) return Unexpected(Error::message_lost_for_memory(code));
  return Unexpected(Error(code, std::move(out).str()));
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
