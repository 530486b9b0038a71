// A reference for collectives, written independently of any backend: deterministic inputs per
// rank and element, and what each collective must give (reductions in rank order).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "coshard/collectives/dtype.hpp"

namespace coshard::collectives::reference {

using Bytes = std::vector<std::byte>;

// Deterministic value of element j on rank r, as bytes of `dtype`.
inline void put_value(DataType dtype, std::byte* at, int rank, std::size_t j) {
  const long k = static_cast<long>((static_cast<unsigned long>(rank) * 7919u + j * 104729u) % 2001u) - 1000;
  const double v = static_cast<double>(k) / 64.0;
  switch (dtype) {
    case DataType::f32: { float f = static_cast<float>(v); std::memcpy(at, &f, 4); break; }
    case DataType::f64: std::memcpy(at, &v, 8); break;
    case DataType::f16: { auto h = float_to_f16(static_cast<float>(v)); std::memcpy(at, &h, 2); break; }
    case DataType::bf16: { auto h = float_to_bf16(static_cast<float>(v)); std::memcpy(at, &h, 2); break; }
    case DataType::i32: { auto i = static_cast<std::int32_t>(k * 1000003); std::memcpy(at, &i, 4); break; }
    case DataType::u8: { auto u = static_cast<std::uint8_t>(k); std::memcpy(at, &u, 1); break; }
  }
}

inline Bytes values(DataType dtype, int rank, std::size_t begin, std::size_t count) {
  Bytes b(count * size_of(dtype));
  for (std::size_t j = 0; j < count; ++j) put_value(dtype, b.data() + j * size_of(dtype), rank, begin + j);
  return b;
}

// What all_gather of `values(t, q, 0, n)` from every rank q gives: the blocks in rank order.
inline Bytes gathered(DataType t, int world, std::size_t n) {
  Bytes out;
  for (int q = 0; q < world; ++q) {
    Bytes b = values(t, q, 0, n);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

// What all_to_all of `values(t, q, 0, world * n)` from every rank q gives rank r: block q is rank
// q's block r.
inline Bytes exchanged(DataType t, int world, int r, std::size_t n) {
  Bytes out;
  for (int q = 0; q < world; ++q) {
    Bytes b = values(t, q, static_cast<std::size_t>(r) * n, n);
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}

// all_to_allv's counts: what rank p sends rank q (zero for some pairs, uneven for the others).
inline std::size_t v_count(int p, int q, std::size_t n) {
  return static_cast<std::size_t>((p * 7 + q * 3) % 5) * n / 2;
}
inline std::vector<std::size_t> v_send_counts(int world, int p, std::size_t n) {
  std::vector<std::size_t> c;
  for (int q = 0; q < world; ++q) c.push_back(v_count(p, q, n));
  return c;
}
inline std::vector<std::size_t> v_recv_counts(int world, int r, std::size_t n) {
  std::vector<std::size_t> c;
  for (int q = 0; q < world; ++q) c.push_back(v_count(q, r, n));
  return c;
}
// Rank r's receive: from each rank q, q's block for r (values(t, q, ...) laid end to end).
inline Bytes exchanged_v(DataType t, int world, int r, std::size_t n) {
  Bytes out;
  for (int q = 0; q < world; ++q) {
    std::size_t from = 0;
    for (int s = 0; s < r; ++s) from += v_count(q, s, n);
    Bytes b = values(t, q, from, v_count(q, r, n));
    out.insert(out.end(), b.begin(), b.end());
  }
  return out;
}
// Rank p's send for all_to_allv.
inline Bytes v_send(DataType t, int world, int p, std::size_t n) {
  std::size_t total = 0;
  for (int q = 0; q < world; ++q) total += v_count(p, q, n);
  return values(t, p, 0, total);
}

template <class Acc>
Acc combine(ReduceOp op, Acc a, Acc b) {
  switch (op) {
    case ReduceOp::sum:
    case ReduceOp::avg: return static_cast<Acc>(a + b);
    case ReduceOp::max: return a < b ? b : a;
    case ReduceOp::min: return b < a ? b : a;
  }
  return a;
}

// Element j of the reduction over ranks 0..world-1 of element (begin + j), in rank order.
inline Bytes reduced(DataType dtype, ReduceOp op, int world, std::size_t begin, std::size_t count) {
  std::vector<Bytes> in;
  for (int q = 0; q < world; ++q) in.push_back(values(dtype, q, begin, count));
  Bytes out(count * size_of(dtype));
  auto fold = [&]<class T, class Acc>(auto load, auto store) {
    for (std::size_t j = 0; j < count; ++j) {
      T t;
      std::memcpy(&t, in[0].data() + j * sizeof(T), sizeof(T));
      Acc acc = load(t);
      for (int q = 1; q < world; ++q) {
        std::memcpy(&t, in[static_cast<std::size_t>(q)].data() + j * sizeof(T), sizeof(T));
        acc = combine<Acc>(op, acc, load(t));
      }
      if (op == ReduceOp::avg) acc = static_cast<Acc>(acc / static_cast<Acc>(world));
      T o = store(acc);
      std::memcpy(out.data() + j * sizeof(T), &o, sizeof(T));
    }
  };
  auto same = [](auto v) { return v; };
  switch (dtype) {
    case DataType::f32: fold.template operator()<float, float>(same, same); break;
    case DataType::f64: fold.template operator()<double, double>(same, same); break;
    case DataType::f16: fold.template operator()<std::uint16_t, float>(f16_to_float, float_to_f16); break;
    case DataType::bf16: fold.template operator()<std::uint16_t, float>(bf16_to_float, float_to_bf16); break;
    case DataType::i32:
      fold.template operator()<std::int32_t, std::int64_t>([](std::int32_t v) { return std::int64_t{v}; },
                                                          [](std::int64_t v) { return static_cast<std::int32_t>(static_cast<std::uint32_t>(v)); });
      break;
    case DataType::u8:
      fold.template operator()<std::uint8_t, std::uint32_t>([](std::uint8_t v) { return std::uint32_t{v}; },
                                                           [](std::uint32_t v) { return static_cast<std::uint8_t>(v); });
      break;
  }
  return out;
}

inline constexpr DataType kTypes[] = {DataType::f32, DataType::f64, DataType::f16, DataType::bf16, DataType::i32, DataType::u8};
inline constexpr ReduceOp kOps[] = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};
inline constexpr std::size_t kCounts[] = {0, 1, 7, 1003};

}  // namespace coshard::collectives::reference
