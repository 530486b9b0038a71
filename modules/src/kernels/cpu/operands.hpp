// The CPU kernels' operands (private): bf16 and f16 tensors widened into f32 copies for the
// kernel (outputs it wholly writes not widened) and rounded back once when it is done; f32 and f64 tensors used in place; and single
// elements of any of the four dtypes read and written through f64 (load, store).
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels/cpu/parallel.hpp"
#include "kernels/half_convert.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {

inline bool is_half(DataType dt) noexcept { return dt == DataType::bf16 || dt == DataType::f16; }

// The dtypes the CPU kernels serve, and the error that names another.
inline bool cpu_serves(DataType dt) noexcept { return dt == DataType::f32 || dt == DataType::f64 || is_half(dt); }
inline Result<void> check_cpu_dtype(DataType dt) {
  if (cpu_serves(dt)) return {};
  return fail(ErrorCode::unsupported, "dtype ", async::to_string(dt), ": the CPU kernels serve f32, f64, bf16 and f16");
}

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

// The f32 buffers of the copies: each thread keeps the ones its kernels gave back, up to
// kKeptCopyBytes, so that a step's many same-sized copies reuse memory instead of mapping fresh
// pages each time (which the kernel zeroes: a fifth of a bf16 step's CPU time on copies went to
// page faults). Larger ones (a vocabulary's logits) are freed as before.
inline constexpr std::size_t kKeptCopyBytes = std::size_t{64} << 20;

class CopyBuffers {
 public:
  struct Buffer {
    std::unique_ptr<float[]> values;
    std::size_t capacity = 0;
  };
  static CopyBuffers& mine() {
    thread_local CopyBuffers buffers;
    return buffers;
  }
  // At least n floats, not zeroed (every copy is widened into or wholly written).
  Buffer take(std::size_t n) {
    std::size_t best = kept_.size();
    for (std::size_t i = 0; i < kept_.size(); ++i)
      if (kept_[i].capacity >= n && kept_[i].capacity <= 2 * n + 1024 &&
          (best == kept_.size() || kept_[i].capacity < kept_[best].capacity))
        best = i;
    if (best < kept_.size()) {
      Buffer b = std::move(kept_[best]);
      kept_.erase(kept_.begin() + static_cast<std::ptrdiff_t>(best));
      bytes_ -= b.capacity * sizeof(float);
      return b;
    }
    return {std::make_unique_for_overwrite<float[]>(std::max<std::size_t>(n, 1)), std::max<std::size_t>(n, 1)};
  }
  void give(Buffer b) noexcept {
    const std::size_t bytes = b.capacity * sizeof(float);
    if (bytes > kKeptCopyBytes) return;
    try {
      kept_.push_back(std::move(b));
    } catch (const std::bad_alloc&) {
      return;  // freed
    }
    bytes_ += bytes;
    while (bytes_ > kKeptCopyBytes) {  // the oldest go first
      bytes_ -= kept_.front().capacity * sizeof(float);
      kept_.erase(kept_.begin());
    }
  }

 private:
  std::vector<Buffer> kept_;
  std::size_t bytes_ = 0;
};

// The operands of one kernel in the type it computes in. f32 and f64 kernels work on the
// tensors themselves; bf16 and f16 ones on f32 copies, whose outputs are rounded back once (to
// nearest even) when the kernel is done, as the CUDA kernels round their f32 results. Stats
// (LayerNorm mean/rstd, the loss and its seed) are f32 for bf16/f16 and need no copy. The
// conversions split across the rank's math threads (element by element: the same bits).
template <class T>
class Operands {
 public:
  explicit Operands(DataType dt) noexcept : dt_(dt) {}
  Operands(const Operands&) = delete;
  Operands& operator=(const Operands&) = delete;
  ~Operands() {
    for (Copy& c : copies_) {
      if (c.written) {
        const float* from = c.buffer.values.get();
        auto* to = static_cast<std::uint16_t*>(c.to);
        const DataType dt = dt_;
        try {
          parallel_rows(c.count, 1, [from, to, dt](std::int64_t begin, std::int64_t end) {
            narrow_half(dt, from + begin, to + begin, static_cast<std::size_t>(end - begin));
          });
        } catch (const std::bad_alloc&) {
          narrow_half(dt, from, to, static_cast<std::size_t>(c.count));  // (no memory to split: one loop)
        }
      }
      CopyBuffers::mine().give(std::move(c.buffer));
    }
  }

  const T* in(const void* p, std::int64_t n) { return copy(const_cast<void*>(p), n, true, false); }
  // Read and written (accumulated into, written in part).
  T* inout(void* p, std::int64_t n) { return copy(p, n, true, true); }
  // Wholly written, never read before (a product with beta 0, a layer's output): not widened.
  T* out(void* p, std::int64_t n) { return copy(p, n, false, true); }
  T* stat(void* p) const noexcept { return static_cast<T*>(p); }
  const T* stat(const void* p) const noexcept { return static_cast<const T*>(p); }

 private:
  struct Copy {
    void* to;
    CopyBuffers::Buffer buffer;
    std::int64_t count;
    bool written;
  };
  bool half() const noexcept {
    if constexpr (std::is_same_v<T, float>)
      return is_half(dt_);
    else
      return false;
  }
  T* copy(void* p, std::int64_t n, bool read, bool written) {
    if (!half()) return static_cast<T*>(p);
    n = std::max<std::int64_t>(n, 0);
    copies_.reserve(copies_.size() + 1);  // (so that the push below cannot fail with the buffer taken)
    CopyBuffers::Buffer buffer = CopyBuffers::mine().take(static_cast<std::size_t>(n));
    float* values = buffer.values.get();
    if (read) {
      const auto* from = static_cast<const std::uint16_t*>(p);
      const DataType dt = dt_;
      parallel_rows(n, 1, [from, values, dt](std::int64_t begin, std::int64_t end) {
        widen_half(dt, from + begin, values + begin, static_cast<std::size_t>(end - begin));
      });
    }
    copies_.push_back({p, std::move(buffer), n, written});
    return reinterpret_cast<T*>(values);
  }

  DataType dt_;
  std::vector<Copy> copies_;
};

}  // namespace coshard::modules::detail
