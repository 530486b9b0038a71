// The adaptive prefetch's decision on given measurements: how far ahead it gathers follows the
// link (slow gathers: far ahead; fast ones: only what the compute before each use cannot hide),
// whatever the machine's load (the end-to-end timing is bench/engine_bench.cpp's).
#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "schedule/prefetch_horizon.hpp"

namespace coshard::zero::detail {
namespace {

std::vector<std::size_t> in_order(std::size_t n) {
  std::vector<std::size_t> trace(n);
  std::iota(trace.begin(), trace.end(), 0);
  return trace;
}

TEST(PrefetchHorizon, AFastLinkGathersOnlyTheNextUnitsAndASlowOneGathersFarAhead) {
  const auto trace = in_order(10);
  const std::vector<double> compute(10, 2.0);  // 2 ms of compute per unit
  // Position i is gathered now while 1.5 x (gathers of 0..i) >= compute of 0..i-1.
  // 0.5 ms a gather: i = 1 has 1.5 x 1.0 < 2: only the next unit.
  EXPECT_EQ(prefetch_horizon(trace, 0, std::vector<double>(10, 0.5), compute), 1u);
  // 1 ms a gather: 1.5(i + 1) >= 2i through i = 3 (6 >= 6), not at i = 4 (7.5 < 8).
  EXPECT_EQ(prefetch_horizon(trace, 0, std::vector<double>(10, 1.0), compute), 4u);
  // 1.5 ms a gather (2.25 ms queued per 2 ms of compute): the whole trace.
  EXPECT_EQ(prefetch_horizon(trace, 0, std::vector<double>(10, 1.5), compute), 10u);
  EXPECT_EQ(prefetch_horizon(trace, 0, std::vector<double>(10, 10.0), compute), 10u);
}

TEST(PrefetchHorizon, DeeperForASlowerLinkAndFromAnyPosition) {
  const auto trace = in_order(12);
  const std::vector<double> compute(12, 1.0);
  std::size_t previous = 0;
  for (const double gather : {0.1, 0.3, 0.5, 0.6, 2.0}) {
    const std::size_t depth = prefetch_horizon(trace, 0, std::vector<double>(12, gather), compute);
    EXPECT_GE(depth, previous) << gather << " ms a gather";
    previous = depth;
  }
  EXPECT_EQ(previous, 12u);
  // From position 7 with 0.5 ms gathers: the same distance ahead as from 0 (4 positions).
  EXPECT_EQ(prefetch_horizon(trace, 7, std::vector<double>(12, 0.5), compute) - 7,
            prefetch_horizon(trace, 0, std::vector<double>(12, 0.5), compute));
  EXPECT_EQ(prefetch_horizon(trace, 12, std::vector<double>(12, 0.5), compute), 12u);  // at the end
}

TEST(PrefetchHorizon, UnitsByIndexComputeByPositionAndUnmeasuredCountsAsNothing) {
  // The trace revisits unit 0 (a shared table) at position 3; its gather is slow, the others free.
  const std::vector<std::size_t> trace = {0, 1, 2, 0, 1};
  const std::vector<double> gather = {4.0, 0.0, 0.0};
  const std::vector<double> compute = {1.0, 1.0, 1.0, 1.0, 1.0};
  // From position 1: units 1 and 2 queue nothing (0 < 1 ms of compute at position 2: ends there).
  EXPECT_EQ(prefetch_horizon(trace, 1, gather, compute), 2u);
  // From 0: 6 ms queued (x 1.5 = 9) outlasts the 1-4 ms of compute before every position: all.
  EXPECT_EQ(prefetch_horizon(trace, 0, gather, compute), 5u);
  // Not measured yet (< 0) is no time: the first position is always gathered.
  EXPECT_EQ(prefetch_horizon(trace, 0, std::vector<double>(3, -1.0), compute), 1u);
}

}  // namespace
}  // namespace coshard::zero::detail
