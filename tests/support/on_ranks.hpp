// Runs a body on `world` Local ranks as threads, each with its own Runtime: the shape of every
// multi-rank test on the CPU.
#pragma once

#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/local.hpp"

namespace coshard::testing {

using RankBody = std::function<async::Task<Result<void>>(int rank, collectives::Communicator& comm)>;

// `body(rank, comm)` on every rank; the errors, each prefixed with its rank (empty: all passed).
// `device`: where the Local backend's collectives run (CUDA: ranks sharing one GPU).
inline std::vector<std::string> on_ranks(int world, const RankBody& body, async::Device device = async::Device::cpu()) {
  auto comms = collectives::make_local_communicators(world, {.device = device});
  if (!comms) return {comms.error().message()};
  std::mutex mutex;
  std::vector<std::string> errors;
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      async::Runtime rt;
      auto done = rt.block_on(body(r, *(*comms)[static_cast<std::size_t>(r)]));
      if (!done) {
        std::lock_guard lock(mutex);
        errors.push_back("rank " + std::to_string(r) + ": " + done.error().message());
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

}  // namespace coshard::testing
