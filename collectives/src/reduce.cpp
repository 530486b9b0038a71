#include "reduce.hpp"

#include <algorithm>
#include <type_traits>
#include <cstdint>
#include <cstring>

namespace coshard::collectives::detail {
namespace {

template <class Acc>
inline Acc combine(ReduceOp op, Acc a, Acc b) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return static_cast<Acc>(a + b);
    case ReduceOp::max: return a < b ? b : a;
    case ReduceOp::min: return b < a ? b : a;
  }
  return a;
}

// One pass per pair of inputs at the start (inputs 0 and 1 together), then one per further
// input, over blocks that stay in L1; `op` is a template argument so every loop is a plain,
// vectorisable one.
template <class T, class Acc, ReduceOp Op, class Load, class Store>
void reduce_blocks(void* out_raw, std::span<const void* const> inputs, std::size_t n, int world, Load load, Store store) {
  constexpr std::size_t kBlock = 2048;
  if constexpr (std::is_same_v<T, Acc>) {
    // Same type: `out` (which aliases no input) is the accumulator; no copy at the end.
    T* __restrict out = static_cast<T*>(out_raw);
    for (std::size_t base = 0; base < n; base += kBlock) {
      const std::size_t len = std::min(kBlock, n - base);
      T* __restrict o = out + base;
      const T* __restrict a = static_cast<const T*>(inputs[0]) + base;
      if (inputs.size() >= 2) {
        const T* __restrict b = static_cast<const T*>(inputs[1]) + base;
        for (std::size_t j = 0; j < len; ++j) o[j] = combine<T>(Op, a[j], b[j]);
      } else {
        for (std::size_t j = 0; j < len; ++j) o[j] = a[j];
      }
      for (std::size_t q = 2; q < inputs.size(); ++q) {
        const T* __restrict in = static_cast<const T*>(inputs[q]) + base;
        for (std::size_t j = 0; j < len; ++j) o[j] = combine<T>(Op, o[j], in[j]);
      }
      if constexpr (Op == ReduceOp::avg) {
        for (std::size_t j = 0; j < len; ++j) o[j] = static_cast<T>(o[j] / static_cast<T>(world));
      }
    }
    (void)load;
    (void)store;
    return;
  }
  alignas(64) Acc acc[kBlock];
  T* __restrict out = static_cast<T*>(out_raw);
  for (std::size_t base = 0; base < n; base += kBlock) {
    const std::size_t len = std::min(kBlock, n - base);
    const T* __restrict a = static_cast<const T*>(inputs[0]) + base;
    if (inputs.size() >= 2) {
      const T* __restrict b = static_cast<const T*>(inputs[1]) + base;
      for (std::size_t j = 0; j < len; ++j) acc[j] = combine<Acc>(Op, load(a[j]), load(b[j]));
    } else {
      for (std::size_t j = 0; j < len; ++j) acc[j] = load(a[j]);
    }
    for (std::size_t q = 2; q < inputs.size(); ++q) {
      const T* __restrict in = static_cast<const T*>(inputs[q]) + base;
      for (std::size_t j = 0; j < len; ++j) acc[j] = combine<Acc>(Op, acc[j], load(in[j]));
    }
    if constexpr (Op == ReduceOp::avg) {
      for (std::size_t j = 0; j < len; ++j) acc[j] = static_cast<Acc>(acc[j] / static_cast<Acc>(world));
    }
    for (std::size_t j = 0; j < len; ++j) out[base + j] = store(acc[j]);
  }
}

template <class T, class Acc, class Load, class Store>
void reduce_typed(ReduceOp op, void* out, std::span<const void* const> inputs, std::size_t n, int world, Load load,
                  Store store) {
  switch (op) {
    case ReduceOp::sum: return reduce_blocks<T, Acc, ReduceOp::sum>(out, inputs, n, world, load, store);
    case ReduceOp::avg: return reduce_blocks<T, Acc, ReduceOp::avg>(out, inputs, n, world, load, store);
    case ReduceOp::max: return reduce_blocks<T, Acc, ReduceOp::max>(out, inputs, n, world, load, store);
    case ReduceOp::min: return reduce_blocks<T, Acc, ReduceOp::min>(out, inputs, n, world, load, store);
  }
}

}  // namespace

void reduce(DataType dtype, ReduceOp op, void* out, std::span<const void* const> inputs, std::size_t n, int world) {
  if (n == 0 || inputs.empty()) return;
  // Loads and stores are lambdas, one type each, so they inline and the loops vectorise (as
  // function pointers, f16 and bf16 shared one pointer type and every element paid a call).
  const auto same = [](auto v) { return v; };
  switch (dtype) {
    case DataType::f32:
      return reduce_typed<float, float>(op, out, inputs, n, world, same, same);
    case DataType::f64:
      return reduce_typed<double, double>(op, out, inputs, n, world, same, same);
    case DataType::f16:
      return reduce_typed<std::uint16_t, float>(
          op, out, inputs, n, world, [](std::uint16_t h) { return f16_to_float(h); },
          [](float f) { return float_to_f16(f); });
    case DataType::bf16:
      return reduce_typed<std::uint16_t, float>(
          op, out, inputs, n, world, [](std::uint16_t h) { return bf16_to_float(h); },
          [](float f) { return float_to_bf16(f); });
    case DataType::i32:
      // Sums wrap (two's complement) as in NCCL: accumulate in int64, store the low 32 bits.
      return reduce_typed<std::int32_t, std::int64_t>(
          op, out, inputs, n, world, [](std::int32_t v) { return static_cast<std::int64_t>(v); },
          [](std::int64_t v) { return static_cast<std::int32_t>(static_cast<std::uint32_t>(v)); });
    case DataType::u8:
      return reduce_typed<std::uint8_t, std::uint32_t>(
          op, out, inputs, n, world, [](std::uint8_t v) { return static_cast<std::uint32_t>(v); },
          [](std::uint32_t v) { return static_cast<std::uint8_t>(v); });
  }
}

}  // namespace coshard::collectives::detail
