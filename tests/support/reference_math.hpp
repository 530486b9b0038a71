// Arithmetic the tests share for comparisons against references (nothing of coshard's, so the
// emulated-kernel tests use it too): fixed random inputs and the normwise error.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

namespace coshard::testing {

// Uniform values in [-scale, scale], the same for a given seed.
inline std::vector<double> random_values(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> d(-scale, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

// ||got - want|| / ||want|| (infinite when the sizes differ): how a tensor is compared with its
// reference within a dtype's tolerance.
inline double normwise_error(const std::vector<double>& got, const std::vector<double>& want) {
  if (got.size() != want.size()) return INFINITY;
  double diff = 0, ref = 0;
  for (std::size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    ref += want[i] * want[i];
  }
  return std::sqrt(diff) / std::max(std::sqrt(ref), 1e-30);
}

}  // namespace coshard::testing
