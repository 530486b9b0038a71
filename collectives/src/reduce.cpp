#include "reduce.hpp"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace coshard::collectives::detail {
namespace {

template <class T, class Acc, class Load, class Store>
void reduce_typed(ReduceOp op, void* out_raw, std::span<const void* const> inputs, std::size_t n, int world,
                  Load load, Store store) {
  constexpr std::size_t kBlock = 1024;
  Acc acc[kBlock];
  auto* out = static_cast<T*>(out_raw);
  for (std::size_t base = 0; base < n; base += kBlock) {
    const std::size_t len = std::min(kBlock, n - base);
    const T* first = static_cast<const T*>(inputs[0]) + base;
    for (std::size_t j = 0; j < len; ++j) acc[j] = load(first[j]);
    for (std::size_t q = 1; q < inputs.size(); ++q) {
      const T* in = static_cast<const T*>(inputs[q]) + base;
      switch (op) {
        case ReduceOp::sum:
        case ReduceOp::avg:
          for (std::size_t j = 0; j < len; ++j) acc[j] = static_cast<Acc>(acc[j] + load(in[j]));
          break;
        case ReduceOp::max:
          for (std::size_t j = 0; j < len; ++j) {
            const Acc v = load(in[j]);
            acc[j] = acc[j] < v ? v : acc[j];
          }
          break;
        case ReduceOp::min:
          for (std::size_t j = 0; j < len; ++j) {
            const Acc v = load(in[j]);
            acc[j] = v < acc[j] ? v : acc[j];
          }
          break;
      }
    }
    if (op == ReduceOp::avg) {
      for (std::size_t j = 0; j < len; ++j) acc[j] = static_cast<Acc>(acc[j] / static_cast<Acc>(world));
    }
    for (std::size_t j = 0; j < len; ++j) out[base + j] = store(acc[j]);
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
