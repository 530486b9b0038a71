// Counts constructions and destructions (cppcoro's helper): a test that ends with
// LifetimeCounter::alive() == 0 proves every object it made was destroyed exactly once.
#pragma once

#include <atomic>

namespace coshard::testing {

class LifetimeCounter {
 public:
  LifetimeCounter() { live().fetch_add(1); }
  LifetimeCounter(const LifetimeCounter&) { live().fetch_add(1); }
  LifetimeCounter(LifetimeCounter&&) noexcept { live().fetch_add(1); }
  LifetimeCounter& operator=(const LifetimeCounter&) = default;
  LifetimeCounter& operator=(LifetimeCounter&&) noexcept = default;
  ~LifetimeCounter() { live().fetch_sub(1); }

  static long alive() { return live().load(); }
  static void reset() { live().store(0); }

 private:
  static std::atomic<long>& live() {
    static std::atomic<long> count{0};
    return count;
  }
};

}  // namespace coshard::testing
