// The trainer's data draws (private): a portable random stream, and the mix of (seed, step, row)
// that places every row of every batch, so data never depends on the platform or the world size.
#pragma once

#include <cstdint>

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

}  // namespace coshard::trainer::detail
