// A communicator whose stream sleeps `delay` before each launched group: a slow link, for tests
// of overlap and adaptive prefetch on the Local backend.
#pragma once

#include <chrono>
#include <thread>

#include "coshard/collectives/communicator.hpp"

namespace coshard::testing {

class DelayedCommunicator final : public collectives::Communicator {
 public:
  DelayedCommunicator(collectives::Communicator& inner, std::chrono::microseconds delay) : inner_(inner), delay_(delay) {}
  int rank() const noexcept override { return inner_.rank(); }
  int size() const noexcept override { return inner_.size(); }
  std::string_view backend() const noexcept override { return inner_.backend(); }
  async::Stream& stream() noexcept override { return inner_.stream(); }
  Result<async::Event> launch(const collectives::Coalesced& group) override {
    if (delay_.count() > 0) COSHARD_TRY(inner_.stream().launch([d = delay_] { std::this_thread::sleep_for(d); }));
    return inner_.launch(group);
  }
  Result<std::unique_ptr<collectives::Communicator>> split(int color, int key) override { return inner_.split(color, key); }
  std::uint64_t launches() const noexcept override { return inner_.launches(); }
  Result<void> status() const override { return inner_.status(); }
  void abort(const std::string& reason) override { inner_.abort(reason); }

 private:
  collectives::Communicator& inner_;
  std::chrono::microseconds delay_;
};

}  // namespace coshard::testing
