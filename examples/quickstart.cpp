// The README's example: a coroutine overlaps two streams of work and awaits their events.
// Built and run as a test (examples are never allowed to rot).
#include <coshard/coshard.hpp>

#include <cstdio>
#include <numeric>
#include <vector>

using namespace coshard::async;

// "Fetch" a buffer on the copy stream while the compute stream works, then compute on it once
// the copy's event has passed — ordered on the device, with the host never blocking.
Task<coshard::Result<double>> pipeline(Stream& copy, Stream& compute) {
  std::vector<float> source(1 << 20, 0.5f), fetched(source.size()), squares(source.size());
  COSHARD_CO_TRY(copy.copy(fetched.data(), source.data(), source.size() * sizeof(float)));
  COSHARD_CO_TRY_ASSIGN(Event fetched_event, copy.record());

  COSHARD_CO_TRY(compute.wait(fetched_event));  // device-side order: no host wait
  COSHARD_CO_TRY(compute.launch([&] {
    for (std::size_t i = 0; i < fetched.size(); ++i) squares[i] = fetched[i] * fetched[i];
  }));
  COSHARD_CO_TRY_ASSIGN(Event computed, compute.record());
  COSHARD_CO_TRY(co_await computed);  // this coroutine suspends; the reactor runs others
  co_return std::accumulate(squares.begin(), squares.end(), 0.0);
}

int main() {
  Runtime runtime;
  auto copy = Stream::create(Device::cpu(), {.name = "copy"});
  auto compute = Stream::create(Device::cpu(), {.name = "compute"});
  if (!copy || !compute) return 1;

  const auto syncs_before = blocking_waits();
  auto sum = runtime.block_on(pipeline(*copy, *compute));
  if (!sum) {
    std::fprintf(stderr, "pipeline failed: %s\n", sum.error().message().c_str());
    return 1;
  }
  std::printf("sum of squares = %.1f, host-blocking waits = %llu\n", *sum,
              static_cast<unsigned long long>(blocking_waits() - syncs_before));
  return *sum == 0.25 * (1 << 20) ? 0 : 1;
}
