// The element types the CPU's element-wise kernels read and write in place (private): f32 and f64
// as themselves, bf16 and f16 as their 2-byte storage, each value widened to f32 where it is read
// and rounded (to nearest even) where it is written, so a kernel's math is f32 whatever it stores
// and no f32 copy of a tensor is made. For f32 and f64, widen and narrow are the identity: the
// kernels' f32 and f64 bits are those of the plain loops.
#pragma once

#include <cstdint>

#include "coshard/async/dtype.hpp"

namespace coshard::modules::detail {

struct Bf16 {
  std::uint16_t bits;
};
struct F16 {
  std::uint16_t bits;
};

// The type a kernel computes an element of S in (and keeps its statistics in: LayerNorm's mean
// and rstd, a loss).
template <class S>
struct ComputeOf {
  using type = S;
};
template <>
struct ComputeOf<Bf16> {
  using type = float;
};
template <>
struct ComputeOf<F16> {
  using type = float;
};
template <class S>
using compute_t = typename ComputeOf<S>::type;

inline float widen(float v) noexcept { return v; }
inline double widen(double v) noexcept { return v; }
inline float widen(Bf16 v) noexcept { return async::bf16_to_float(v.bits); }
inline float widen(F16 v) noexcept { return async::f16_to_float(v.bits); }

template <class S>
inline S narrow(compute_t<S> v) noexcept {
  if constexpr (std::is_same_v<S, Bf16>)
    return Bf16{async::float_to_bf16(v)};
  else if constexpr (std::is_same_v<S, F16>)
    return F16{async::float_to_f16(v)};
  else
    return v;
}

// The operands of a kernel on the tensors themselves, in their storage type S (Operands'
// interface, operands.hpp, without its copies): statistics in compute_t<S>.
template <class S>
class Direct {
 public:
  using Compute = compute_t<S>;
  const S* in(const void* p, std::int64_t /*n*/) const noexcept { return static_cast<const S*>(p); }
  S* inout(void* p, std::int64_t /*n*/) const noexcept { return static_cast<S*>(p); }
  S* out(void* p, std::int64_t /*n*/) const noexcept { return static_cast<S*>(p); }
  Compute* stat(void* p) const noexcept { return static_cast<Compute*>(p); }
  const Compute* stat(const void* p) const noexcept { return static_cast<const Compute*>(p); }
};

}  // namespace coshard::modules::detail
