// Comparing a model trained two ways (tensor and expert parallelism against the unsharded run):
// values by parameter name, how far apart two numbers are, and the largest difference and where.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <map>
#include <string>
#include <vector>

namespace coshard::testing {

using NamedValues = std::map<std::string, std::vector<double>>;

// |a - b| relative to the larger, floored at 1e-2 (a loss or a norm near zero compares absolutely).
inline double relative(double a, double b) { return std::abs(a - b) / std::max({std::abs(a), std::abs(b), 1e-2}); }

struct LargestDifference {
  double most = 0;    // each element's |got - want| / max(|want|, 1)
  std::string where;  // "name[i]"
};

// Over every parameter of `want`; a parameter `got` lacks or holds at another length is a failure
// of its own (`what` names the comparison), and counts as infinitely far.
inline LargestDifference largest_difference(const NamedValues& got, const NamedValues& want, const std::string& what) {
  LargestDifference d;
  EXPECT_EQ(got.size(), want.size()) << what;
  for (const auto& [name, values] : want) {
    const auto it = got.find(name);
    if (it == got.end() || it->second.size() != values.size()) {
      ADD_FAILURE() << what << ": " << name << (it == got.end() ? " is missing" : " has another length");
      return {std::numeric_limits<double>::infinity(), name};
    }
    for (std::size_t i = 0; i < values.size(); ++i) {
      const double e = std::abs(it->second[i] - values[i]) / std::max({std::abs(values[i]), 1.0});
      if (e > d.most) d = {e, name + "[" + std::to_string(i) + "]"};
    }
  }
  return d;
}

}  // namespace coshard::testing
