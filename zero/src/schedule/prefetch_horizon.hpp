// The adaptive prefetch's decision, apart from the engine so it can be tested on given
// measurements (the engine feeds it the ones it measured one step behind).
#pragma once

#include <cstddef>
#include <span>

namespace coshard::zero::detail {

// How far along `trace` (unit indices in fetch order) from position `pos` units should be in
// flight: the end (exclusive) of the positions to gather now. Position i is gathered now when
// waiting for the next fetch would make it late: when the communication queued up to it (the
// gathers of positions pos..i, by unit, from `gather_ms`) times a margin outlasts the compute
// between now and its use (positions pos..i-1 of `compute_ms`, by trace position). Negative
// measurements (not measured yet) count as 0.
std::size_t prefetch_horizon(std::span<const std::size_t> trace, std::size_t pos, std::span<const double> gather_ms,
                             std::span<const double> compute_ms);

// Measurements move from step to step: the queued communication is weighed this much more.
inline constexpr double kPrefetchMargin = 1.5;

}  // namespace coshard::zero::detail
