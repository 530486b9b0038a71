// The bf16/f16 cross-entropy's rows (loss.hpp), widened to f32: the exponentials by exp_approx
// (relative error ~2e-7, far under a half logit's own rounding of 2^-9) in one loop, summed in 16
// f32 lanes and those in double. Built for AVX-512, AVX2 and the baseline, the widest the CPU has
// chosen at load (target_clones; not under a sanitizer): libm's scalar exp, and the baseline's
// 4-wide vectors, were most of the half types' cross-entropy. (Only the half types': f32's and
// f64's bits do not depend on the CPU.)
#include <algorithm>
#include <cmath>
#include <cstdint>

#include "kernels/cpu/exp_approx.hpp"
#include "kernels/cpu/loss.hpp"

// The clones' resolver runs while the program is relocated, before a sanitizer's runtime is up:
// instrumented, it crashes every test program at start (CI's ThreadSanitizer build did). Sanitized
// builds take the baseline loop only.
#if defined(__SANITIZE_THREAD__) || defined(__SANITIZE_ADDRESS__)
#define COSHARD_WIDEST_VECTORS
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer) || __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define COSHARD_WIDEST_VECTORS
#endif
#endif
#ifndef COSHARD_WIDEST_VECTORS
#define COSHARD_WIDEST_VECTORS __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

namespace coshard::modules::detail {
namespace {

// In 16 lanes of selects (which vectorise; a NaN logit makes the sum, and so the loss, NaN anyway).
inline float row_max(const float* row, std::int64_t V) {
  constexpr std::int64_t kLanes = 16;
  float lanes[kLanes];
  for (float& l : lanes) l = row[0];
  std::int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes)
    for (std::int64_t l = 0; l < kLanes; ++l) lanes[l] = row[j + l] > lanes[l] ? row[j + l] : lanes[l];
  float mx = row[0];
  for (const float l : lanes) mx = l > mx ? l : mx;
  for (; j < V; ++j) mx = row[j] > mx ? row[j] : mx;
  return mx;
}

// sum_j exp(row[j] - mx), each term in e.
inline double exp_sum(const float* row, float mx, float* e, std::int64_t V) {
  for (std::int64_t j = 0; j < V; ++j) e[j] = exp_approx(row[j] - mx);
  constexpr std::int64_t kLanes = 16;
  float lanes[kLanes] = {};
  std::int64_t j = 0;
  for (; j + kLanes <= V; j += kLanes)
    for (std::int64_t l = 0; l < kLanes; ++l) lanes[l] += e[j + l];
  double sum = 0;
  for (const float l : lanes) sum += l;
  for (; j < V; ++j) sum += e[j];
  return sum;
}

// (multiversioned here, where no declaration precedes them, as clang requires)
COSHARD_WIDEST_VECTORS
double row_term(const float* row, std::int32_t target, float* e, std::int64_t V) {
  const float mx = row_max(row, V);
  return std::log(exp_sum(row, mx, e, V)) + static_cast<double>(mx) - static_cast<double>(row[target]);
}

COSHARD_WIDEST_VECTORS
void row_grad(const float* row, std::int32_t target, float g, float* drow, std::int64_t V) {
  const auto scale = static_cast<float>(static_cast<double>(g) / exp_sum(row, row_max(row, V), drow, V));
  for (std::int64_t j = 0; j < V; ++j) drow[j] *= scale;
  drow[target] -= g;
}

}  // namespace

double cross_entropy_half_row(const float* row, std::int32_t target, float* e, std::int64_t V) noexcept {
  return row_term(row, target, e, V);
}

void cross_entropy_half_row_grad(const float* row, std::int32_t target, float g, float* drow, std::int64_t V) noexcept {
  row_grad(row, target, g, drow, V);
}

}  // namespace coshard::modules::detail
