// The CPU kernels' operands (private): bf16 and f16 tensors widened into f32 copies for the
// kernel and rounded back once when it is done; f32 and f64 tensors used in place; and single
// elements of any of the four dtypes read and written through f64 (load, store).
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/half_convert.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

inline bool is_half(DataType dt) noexcept { return dt == DataType::bf16 || dt == DataType::f16; }

// f32/f64/bf16/f16 element access for the optimizer and casts. bf16/f16 round to nearest even,
// as the CUDA conversions do, from the f32 value (a double is rounded to f32 first: the values
// stored this way are f32 masters).
inline double load(DataType dt, const void* p, std::int64_t i) {
  switch (dt) {
    case DataType::f64: return static_cast<const double*>(p)[i];
    case DataType::bf16: return async::bf16_to_float(static_cast<const std::uint16_t*>(p)[i]);
    case DataType::f16: return async::f16_to_float(static_cast<const std::uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}
inline void store(DataType dt, void* p, std::int64_t i, double v) {
  switch (dt) {
    case DataType::f64: static_cast<double*>(p)[i] = v; break;
    case DataType::bf16: static_cast<std::uint16_t*>(p)[i] = async::float_to_bf16(static_cast<float>(v)); break;
    case DataType::f16: static_cast<std::uint16_t*>(p)[i] = async::float_to_f16(static_cast<float>(v)); break;
    default: static_cast<float*>(p)[i] = static_cast<float>(v);
  }
}

// The operands of one kernel in the type it computes in. f32 and f64 kernels work on the
// tensors themselves; bf16 and f16 ones on f32 copies, whose outputs are rounded back once (to
// nearest even) when the kernel is done, as the CUDA kernels round their f32 results. Stats
// (LayerNorm mean/rstd, the loss and its seed) are f32 for bf16/f16 and need no copy.
template <class T>
class Operands {
 public:
  explicit Operands(DataType dt) noexcept : dt_(dt) {}
  Operands(const Operands&) = delete;
  Operands& operator=(const Operands&) = delete;
  ~Operands() {
    for (const Copy& c : copies_)
      if (c.written) narrow_half(dt_, c.values.data(), static_cast<std::uint16_t*>(c.to), c.values.size());
  }

  const T* in(const void* p, std::int64_t n) { return widen(const_cast<void*>(p), n, false); }
  // Read and written (accumulated into, written in part, or wholly overwritten).
  T* inout(void* p, std::int64_t n) { return widen(p, n, true); }
  T* stat(void* p) const noexcept { return static_cast<T*>(p); }
  const T* stat(const void* p) const noexcept { return static_cast<const T*>(p); }

 private:
  struct Copy {
    void* to;
    std::vector<float> values;
    bool written;
  };
  bool half() const noexcept {
    if constexpr (std::is_same_v<T, float>)
      return is_half(dt_);
    else
      return false;
  }
  T* widen(void* p, std::int64_t n, bool written) {
    if (!half()) return static_cast<T*>(p);
    std::vector<float> values(static_cast<std::size_t>(std::max<std::int64_t>(n, 0)));
    widen_half(dt_, static_cast<const std::uint16_t*>(p), values.data(), values.size());
    // (the copies' buffers keep their addresses when the list grows: a vector's move keeps them)
    copies_.push_back({p, std::move(values), written});
    return reinterpret_cast<T*>(copies_.back().values.data());
  }

  DataType dt_;
  std::vector<Copy> copies_;
};

}  // namespace coshard::modules::detail
