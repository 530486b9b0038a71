// The trainer's data draws (private): a portable random stream, and the mix of (seed, step, row)
// that places every row of every batch, so data never depends on the platform or the world size.
#pragma once

#include <cstdint>

#include "coshard/trainer/data.hpp"

namespace coshard::trainer::detail {

// splitmix64: a portable stream from (seed, step, row), so data never depends on the platform's
// std:: distributions.
struct Rng {
  std::uint64_t state;
  explicit Rng(std::uint64_t seed) : state(seed) {}
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  std::uint64_t below(std::uint64_t n) { return next() % n; }
  double unit() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }
};

inline std::uint64_t mix(std::uint64_t a, std::uint64_t b, std::uint64_t c) {
  Rng r(a * 0x9e3779b97f4a7c15ull ^ (b + 0x632be59bd9b4e019ull) * 0xc2b2ae3d27d4eb4full ^ c * 0x165667b19e3779f9ull);
  return r.next();
}

// The batch of `step`: `rows` windows of `seq` tokens and their next tokens, each starting at a
// position of a stream of `count` tokens drawn from (seed, step, row); `at(i)` is token i.
template <class At>
HostBatch window_batch(std::uint64_t seed, std::uint64_t step, std::int64_t rows, std::int64_t seq, std::int64_t count,
                       const At& at) {
  HostBatch b{rows, seq, {}, {}};
  b.tokens.resize(static_cast<std::size_t>(rows * seq));
  b.targets.resize(b.tokens.size());
  const auto windows = static_cast<std::uint64_t>(count - seq);
  for (std::int64_t r = 0; r < rows; ++r) {
    const auto start = static_cast<std::int64_t>(mix(seed, step, static_cast<std::uint64_t>(r)) % windows);
    for (std::int64_t t = 0; t < seq; ++t) {
      b.tokens[static_cast<std::size_t>(r * seq + t)] = at(start + t);
      b.targets[static_cast<std::size_t>(r * seq + t)] = at(start + t + 1);
    }
  }
  return b;
}

}  // namespace coshard::trainer::detail
