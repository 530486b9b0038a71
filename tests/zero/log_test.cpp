// The engine's debug lines: two ranks as threads at stage 3 with the optimizer and parameters on
// NVMe, two steps and a checkpoint, everything at debug. Each rank's fetch, prefetch and release
// decisions (with bytes and budget), its collectives (with sequence numbers), its swaps (file and
// offset) and the checkpoint's phases are written, each line naming its rank.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <mutex>
#include <regex>

#include "coshard/async/log.hpp"
#include "../support/on_ranks.hpp"
#include "../support/rank_engine.hpp"

namespace coshard::zero {
namespace {

namespace fs = std::filesystem;

TEST(EngineLog, DebugLinesNameTheRankTheUnitTheBudgetAndTheSequence) {
  std::mutex mutex;
  std::vector<std::string> lines;
  log::set_sink([&](log::Level, std::string_view line) {
    std::lock_guard lock(mutex);
    lines.emplace_back(line);
  });
  ASSERT_TRUE(log::configure("warn,zero=debug,collectives=debug,offload=debug"));
  const fs::path dir = fs::current_path() / "zero_log_test_scratch";
  fs::remove_all(dir);
  fs::create_directories(dir);
  const testing::Plan plan{2, 3, OffloadTarget::nvme, OffloadTarget::nvme, 2 << 10};
  const auto errors = testing::on_ranks(2, [&](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto e, testing::RankEngine::make(comm, plan, dir / "swap"));
    COSHARD_CO_TRY(co_await e.engine->initialize(7));
    COSHARD_CO_TRY(co_await e.train(0, 2));
    COSHARD_CO_TRY(co_await e.engine->save_checkpoint(dir / "checkpoints"));
    COSHARD_CO_TRY(co_await e.engine->finish_checkpoint());
    co_return Result<void>{};
  });
  log::set_sink({});
  ASSERT_TRUE(log::configure(""));
  fs::remove_all(dir);
  ASSERT_TRUE(errors.empty()) << errors.front();

  auto has = [&](const std::string& pattern) {
    const std::regex re(pattern);
    return std::any_of(lines.begin(), lines.end(), [&](const std::string& l) { return std::regex_search(l, re); });
  };
  for (const std::string rank : {"0", "1"}) {
    const std::string who = "\\[rank " + rank + " reactor\\] ";
    EXPECT_TRUE(has(" I zero " + who + "engine: stage 3, " + rank + " of 2 ranks on cpu")) << rank;
    EXPECT_TRUE(has(" D zero " + who + "fetch unit [0-9]+ \\(.*\\) in train: not resident, gathering now")) << rank;
    EXPECT_TRUE(has(" D zero " + who + "fetch unit [0-9]+ \\(.*\\): gather of [0-9]+ bytes issued on .*; live [0-9]+ of max_live_bytes 4096"))
        << rank;
    EXPECT_TRUE(has(" D zero " + who + "prefetch unit [0-9]+ \\(.*\\): gather of [0-9]+ bytes issued")) << rank;
    EXPECT_TRUE(has(" D zero " + who + "release unit [0-9]+ \\(.*\\): [0-9]+ bytes back once .* passes its last use")) << rank;
    EXPECT_TRUE(has(" D collectives " + who + "launch #0 on .* \\(local, rank " + rank + " of 2\\): \\[")) << rank;
    EXPECT_TRUE(has(" D collectives " + who + "launch #[1-9][0-9]* on .*all_gather\\(count=")) << rank;
    EXPECT_TRUE(has(" D offload \\[rank " + rank + " .*\\] swap out: [0-9]+ bytes to .*swap.* at offset [0-9]+")) << rank;
    EXPECT_TRUE(has(" D offload \\[rank " + rank + " .*\\] swap in: [0-9]+ bytes from .* at offset [0-9]+")) << rank;
    EXPECT_TRUE(has(" D zero " + who + "checkpoint step-[0-9]+: [0-9]+ bytes staged; writing .*rank" )) << rank;
  }
  EXPECT_TRUE(has(" I zero \\[rank 0 reactor\\] checkpoint step-[0-9]+ published in "));
  EXPECT_FALSE(has(" D trainer ")) << "a component left at warn wrote a debug line";
}

}  // namespace
}  // namespace coshard::zero
