// UniqueFunction<R(Args...)>: a move-only callable, the C++20 stand-in for C++23's
// std::move_only_function (public headers stay C++20). A closure of up to six pointers that
// moves without throwing lives inline (a stream launch allocates nothing for it); a larger one
// lives in one heap block owned by the function.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

namespace coshard::async::detail {

template <class Signature>
class UniqueFunction;

template <class R, class... Args>
class UniqueFunction<R(Args...)> {
  static constexpr std::size_t kInlineBytes = 6 * sizeof(void*);

  template <class F>
  static constexpr bool kInline = sizeof(F) <= kInlineBytes && alignof(F) <= alignof(std::max_align_t) &&
                                  std::is_nothrow_move_constructible_v<F>;

  struct Ops {
    R (*call)(void* storage, Args&&... args);
    void (*move)(void* to, void* from) noexcept;  // leaves `from` destroyed
    void (*destroy)(void* storage) noexcept;
  };

  template <class F>
  static F& target(void* storage) noexcept {
    if constexpr (kInline<F>) return *std::launder(static_cast<F*>(storage));
    else return **static_cast<F**>(storage);
  }

  template <class F>
  static constexpr Ops kOps = {
      [](void* storage, Args&&... args) -> R { return std::invoke(target<F>(storage), std::forward<Args>(args)...); },
      [](void* to, void* from) noexcept {
        if constexpr (kInline<F>) {
          ::new (to) F(std::move(target<F>(from)));
          target<F>(from).~F();
        } else {
          *static_cast<F**>(to) = *static_cast<F**>(from);
        }
      },
      [](void* storage) noexcept {
        if constexpr (kInline<F>) target<F>(storage).~F();
        else std::unique_ptr<F>(*static_cast<F**>(storage)).reset();
      },
  };

 public:
  UniqueFunction() noexcept = default;
  UniqueFunction(std::nullptr_t) noexcept {}
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, UniqueFunction> && std::is_invocable_r_v<R, std::decay_t<F>&, Args...>)
  UniqueFunction(F&& f) {  // NOLINT(google-explicit-constructor): converts like std::function
    using Fn = std::decay_t<F>;
    if constexpr (kInline<Fn>) ::new (static_cast<void*>(storage_)) Fn(std::forward<F>(f));
    else *reinterpret_cast<Fn**>(storage_) = std::make_unique<Fn>(std::forward<F>(f)).release();
    ops_ = &kOps<Fn>;
  }
  UniqueFunction(UniqueFunction&& other) noexcept { take(other); }
  UniqueFunction& operator=(UniqueFunction&& other) noexcept {
    if (this != &other) {
      reset();
      take(other);
    }
    return *this;
  }
  UniqueFunction(const UniqueFunction&) = delete;
  UniqueFunction& operator=(const UniqueFunction&) = delete;
  ~UniqueFunction() { reset(); }

  explicit operator bool() const noexcept { return ops_ != nullptr; }
  R operator()(Args... args) { return ops_->call(storage_, std::forward<Args>(args)...); }

 private:
  void take(UniqueFunction& other) noexcept {
    if (other.ops_) {
      other.ops_->move(storage_, other.storage_);
      ops_ = std::exchange(other.ops_, nullptr);
    }
  }
  void reset() noexcept {
    if (ops_) std::exchange(ops_, nullptr)->destroy(storage_);
  }

  alignas(std::max_align_t) std::byte storage_[kInlineBytes];
  const Ops* ops_ = nullptr;
};

}  // namespace coshard::async::detail
