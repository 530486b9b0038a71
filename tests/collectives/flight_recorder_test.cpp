// The collective flight recorder on the Local backend: the ring, automatic dumps when a rank is
// held outside a collective (its peers time out, their dumps name it and the last collective it
// completed), when the ranks launch different collectives, and when a rank fails; dumps read
// back, damaged ones refused by name, and the diagnosis in each case; a mesh's groups dumped
// under their own names beside the world's.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <latch>
#include <map>
#include <mutex>
#include <thread>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/flight_recorder.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/collectives/mesh.hpp"

namespace coshard::collectives {
namespace {

namespace fs = std::filesystem;
using Body = std::function<async::Task<Result<void>>(int rank, Communicator& comm)>;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::current_path() / "flight_recorder_test_scratch" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

// Ranks as threads on a Local group with `timeout`, dumps into `dir`; each rank's error ("" when
// it passed).
std::vector<std::string> run_ranks(int world, std::chrono::milliseconds timeout, const fs::path& dir, const Body& body) {
  set_flight_recorder_dir(dir);
  auto comms = make_local_communicators(world, {.timeout = timeout});
  EXPECT_TRUE(comms);
  std::vector<std::string> errors(static_cast<std::size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r)
    threads.emplace_back([&, r] {
      async::Runtime rt;
      auto done = rt.block_on(body(r, *(*comms)[static_cast<std::size_t>(r)]));
      if (!done) errors[static_cast<std::size_t>(r)] = done.error().message();
    });
  for (auto& t : threads) t.join();
  set_flight_recorder_dir({});
  return errors;
}

async::Task<Result<void>> all_reduces(Communicator& comm, std::vector<float>& data, int n) {
  for (int i = 0; i < n; ++i) {
    COSHARD_CO_TRY_ASSIGN(auto done, comm.all_reduce(data.data(), data.data(), data.size(), DataType::f32, ReduceOp::sum));
    COSHARD_CO_TRY(co_await done);
  }
  co_return Result<void>{};
}

TEST(FlightRecorder, TheRingKeepsTheLastCollectivesInOrder) {
  FlightRecorder ring("comm", 4);
  const Coalesced group = Coalesced{}.all_gather(nullptr, nullptr, 8, DataType::bf16);
  const auto ops = std::make_shared<const std::vector<CollectiveOp>>(group.ops().begin(), group.ops().end());
  for (std::uint64_t s = 0; s < 6; ++s) ring.enqueued(s, ops);
  ring.started(4);
  ring.ended(4, true);
  ring.ended(5, false);
  ring.ended(0, true);  // long gone from the ring: ignored
  const auto entries = ring.snapshot();
  ASSERT_EQ(entries.size(), 4u);
  EXPECT_EQ(ring.launched(), 6u);
  for (std::size_t i = 0; i < entries.size(); ++i) EXPECT_EQ(entries[i].seq, i + 2);
  EXPECT_EQ(entries[0].ops, "[all_gather(count=8, bf16)]");
  EXPECT_EQ(entries[0].stream, "comm");
  EXPECT_EQ(entries[1].state, CollectiveState::enqueued);
  EXPECT_EQ(entries[2].state, CollectiveState::completed);
  EXPECT_GE(entries[2].started_us, entries[2].enqueued_us);
  EXPECT_GE(entries[2].ended_us, entries[2].started_us);
  EXPECT_EQ(entries[3].state, CollectiveState::failed);
  EXPECT_EQ(entries[3].started_us, -1);
  ring.fail_open();
  EXPECT_EQ(ring.snapshot()[1].state, CollectiveState::failed);
}

// Rank 1 is held outside any collective after three all-reduces; ranks 0 and 2 go on into a
// fourth. They time out, naming it, and their dumps say where it is.
TEST(FlightRecorder, AHeldRankIsNamedByItsPeersDumpsWithItsLastCompletedCollective) {
  const fs::path dir = scratch("held");
  std::latch release(1);
  const auto start = std::chrono::steady_clock::now();
  // 2 s: far beyond any scheduling delay of the first three, even under a sanitizer and load.
  const auto errors = run_ranks(3, std::chrono::milliseconds(2000), dir, [&](int rank, Communicator& comm) -> async::Task<Result<void>> {
    std::vector<float> data(4, 1.0f);
    auto first = co_await all_reduces(comm, data, 3);
    if (rank == 1) {
      if (first) release.wait();  // held: never launches #3
      co_return first;
    }
    Result<void> fourth = std::move(first);
    if (fourth) fourth = co_await all_reduces(comm, data, 1);  // (no co_await in a ?: under GCC 12)
    if (rank == 0) release.count_down();  // on every path: rank 1 is never left held
    co_return fourth;
  });
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(60)) << "the run did not end";
  EXPECT_EQ(errors[1], "");
  for (int r : {0, 2}) {
    EXPECT_NE(errors[static_cast<std::size_t>(r)].find("timed out after 2000 ms waiting for ranks [1]"), std::string::npos)
        << errors[static_cast<std::size_t>(r)];
  }
  EXPECT_TRUE(fs::exists(dir / "rank0-of3.json"));
  EXPECT_TRUE(fs::exists(dir / "rank2-of3.json"));
  EXPECT_FALSE(fs::exists(dir / "rank1-of3.json")) << "the held rank had nothing fail";

  auto records = read_flight_records(dir);
  ASSERT_TRUE(records) << records.error().message();
  ASSERT_EQ(records->size(), 2u);
  for (const auto& r : *records) {
    EXPECT_EQ(r.backend, "local");
    EXPECT_EQ(r.launched, 4u);
    EXPECT_EQ(r.last_completed(), 2);
    ASSERT_NE(r.first_open(), nullptr);
    EXPECT_EQ(r.first_open()->seq, 3u);
    EXPECT_EQ(r.first_open()->state, CollectiveState::failed);
    EXPECT_NE(r.reason.find("waiting for ranks [1]"), std::string::npos) << r.reason;
  }
  const std::string text = diagnose(*records, 3);
  EXPECT_NE(text.find("records from 2 (none from rank 1)"), std::string::npos) << text;
  EXPECT_NE(text.find("rank 1: no record (stopped, killed, or stuck outside a collective); its peers completed #2, "
                      "which every rank takes part in: it completed #2 and never finished #3"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("diagnosis: rank 1 is behind: ranks 0, 2 wait in #3 [all_reduce(count=4, f32, sum)]"),
            std::string::npos)
      << text;
}

TEST(FlightRecorder, DifferentCollectivesAtOneSequenceNumberAreAMismatch) {
  const fs::path dir = scratch("mismatch");
  const auto errors = run_ranks(2, std::chrono::seconds(30), dir, [&](int rank, Communicator& comm) -> async::Task<Result<void>> {
    std::vector<float> data(8, 1.0f);
    COSHARD_CO_TRY(co_await all_reduces(comm, data, 1));
    auto done = rank == 0 ? comm.all_reduce(data.data(), data.data(), 4, DataType::f32, ReduceOp::sum)
                          : comm.broadcast(data.data(), data.data(), 4, DataType::f32, 0);
    if (!done) co_return fail(std::move(done).error());
    co_return co_await *done;
  });
  EXPECT_NE(errors[0], "");
  EXPECT_NE(errors[1], "");
  auto records = read_flight_records(dir);
  ASSERT_TRUE(records) << records.error().message();
  ASSERT_EQ(records->size(), 2u);
  const std::string text = diagnose(*records, 2);
  EXPECT_NE(text.find("diagnosis: mismatch at #1: rank 0 launched [all_reduce(count=4, f32, sum)]; rank 1 launched "
                      "[broadcast(count=4, f32, root=0)];"),
            std::string::npos)
      << text;
}

TEST(FlightRecorder, AFailedRankDumpsItsReasonAndItsPeersTheirs) {
  const fs::path dir = scratch("failed");
  const auto errors = run_ranks(2, std::chrono::seconds(30), dir, [&](int rank, Communicator& comm) -> async::Task<Result<void>> {
    std::vector<float> data(4, 1.0f);
    COSHARD_CO_TRY(co_await all_reduces(comm, data, 2));
    if (rank == 1) {
      comm.abort("out of host memory");
      co_return Result<void>{};
    }
    co_return co_await all_reduces(comm, data, 1);
  });
  EXPECT_NE(errors[0].find("rank 1 of Local group of 2 failed: out of host memory"), std::string::npos) << errors[0];
  auto records = read_flight_records(dir);
  ASSERT_TRUE(records) << records.error().message();
  ASSERT_EQ(records->size(), 2u);
  EXPECT_EQ((*records)[1].reason, "this rank failed: out of host memory");
  EXPECT_EQ((*records)[1].last_completed(), 1);
  EXPECT_EQ((*records)[1].first_open(), nullptr);
  EXPECT_EQ((*records)[0].first_open()->seq, 2u);
  const std::string text = diagnose(*records, 2);
  EXPECT_NE(text.find("diagnosis: rank 1 is behind: rank 0 waits in #2 [all_reduce(count=4, f32, sum)]"), std::string::npos) << text;
}

TEST(FlightRecorder, OnDemandDumpsRoundTripAndDamagedOnesAreRefused) {
  const fs::path dir = scratch("on_demand");
  const auto errors = run_ranks(2, std::chrono::seconds(30), {}, [&](int, Communicator& comm) -> async::Task<Result<void>> {
    std::vector<float> data(4, 1.0f);
    COSHARD_CO_TRY(co_await all_reduces(comm, data, 5));
    auto written = write_flight_record(comm, "SIGUSR1", dir);
    if (!written) co_return fail(std::move(written).error());
    co_return Result<void>{};
  });
  ASSERT_EQ(errors[0], "");
  ASSERT_EQ(errors[1], "");
  auto records = read_flight_records(dir);
  ASSERT_TRUE(records) << records.error().message();
  ASSERT_EQ(records->size(), 2u);
  EXPECT_EQ((*records)[0].reason, "SIGUSR1");
  EXPECT_EQ((*records)[0].entries.size(), 5u);
  EXPECT_EQ((*records)[0].entries[4].stream, "comm rank 0/2");
  EXPECT_NE(diagnose(*records, 2).find("diagnosis: no rank is behind: every rank completed #4, none is in a collective"),
            std::string::npos);
  // Files whose names are not a record's are no records, whatever they hold.
  for (const char* other : {"rank1-of2.json.tmp", "rank-of2.json", "rank1-of.json", "rankA-of2.json", "xrank1-of2.json",
                            "rank1-of2.jsonx", "notes.txt"})
    std::ofstream(dir / other) << "not json";
  auto with_others = read_flight_records(dir);
  ASSERT_TRUE(with_others) << with_others.error().message();
  EXPECT_EQ(with_others->size(), 2u);

  std::ofstream(dir / "rank3-of4.json") << "{\"format\": \"coshard.flight_record\", \"rank\": 3}";
  auto missing_field = read_flight_records(dir);
  ASSERT_FALSE(missing_field);
  EXPECT_NE(missing_field.error().message().find("rank3-of4.json: 'size' is missing"), std::string::npos)
      << missing_field.error().message();
  std::ofstream(dir / "rank3-of4.json") << "not json";
  auto not_json = read_flight_records(dir);
  ASSERT_FALSE(not_json);
  EXPECT_NE(not_json.error().message().find("rank3-of4.json: not JSON"), std::string::npos);
  auto no_folder = read_flight_records(dir / "absent");
  ASSERT_FALSE(no_folder);
  EXPECT_NE(no_folder.error().message().find("absent: not a folder"), std::string::npos);
}

// Records written while the run moves (SIGUSR1 on a healthy run): each rank dumps at its own
// moment, so their last completed collectives differ with none open; that is not a hang.
TEST(FlightRecorder, RanksThatDumpedWhileMovingAreNotCalledBehind) {
  auto record = [](int rank, std::uint64_t last) {
    FlightRecord r{rank, 2, "nccl", "SIGUSR1", 0, last + 1, {}, {}};
    for (std::uint64_t s = last - 2; s <= last; ++s)
      r.entries.push_back({s, "[all_gather(count=8, bf16)]", "comm", 1, -1, 2, CollectiveState::completed});
    return r;
  };
  const std::vector<FlightRecord> moving{record(0, 40), record(1, 57)};
  const std::string text = diagnose(moving, 2);
  EXPECT_NE(text.find("diagnosis: no rank waits in a collective: the run was moving when the ranks wrote their records "
                      "(rank 0 at #40, rank 1 at #57); nothing is stuck"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("behind"), std::string::npos) << text;

  // A record that claims a huge world: the silent ranks are counted, not listed one by one.
  const std::string huge = diagnose(std::span<const FlightRecord>(&moving[0], 1), 1 << 20);
  EXPECT_LT(huge.size(), 4096u) << huge.substr(0, 4096);
  EXPECT_NE(huge.find("(1048576 in all)"), std::string::npos) << huge.substr(0, 4096);
}

// A mesh's groups are labelled apart (data<t>, tensor<d>): data 1 x tensor 4 has a tensor group as
// large as the world, and data 2 x tensor 2 two data groups and two tensor groups of one size;
// none's dump replaces another's or the world's, and each is diagnosed within its own ranks.
TEST(FlightRecorder, AMeshsGroupsDumpUnderTheirOwnNames) {
  const fs::path dir = scratch("mesh");
  const auto errors = run_ranks(4, std::chrono::seconds(30), {}, [&](int, Communicator& world) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto wide, Mesh::create(world, {.tensor = 4}));
    COSHARD_CO_TRY_ASSIGN(auto square, Mesh::create(world, {.tensor = 2}));
    std::vector<float> data(4, 1.0f);
    COSHARD_CO_TRY(co_await all_reduces(world, data, 1));
    COSHARD_CO_TRY(co_await all_reduces(wide.tensor(), data, 2));
    COSHARD_CO_TRY(co_await all_reduces(square.tensor(), data, 3));
    COSHARD_CO_TRY(co_await all_reduces(square.data(), data, 4));
    for (const Communicator* comm : {&world, &wide.tensor(), &square.tensor(), &square.data()}) {
      auto written = write_flight_record(*comm, "SIGUSR1", dir);
      if (!written) co_return fail(std::move(written).error());
    }
    co_return Result<void>{};
  });
  for (const auto& e : errors) ASSERT_EQ(e, "");
  auto records = read_flight_records(dir);
  ASSERT_TRUE(records) << records.error().message();
  ASSERT_EQ(records->size(), 16u) << "four groups' records on each of 4 ranks, none replaced";
  std::map<std::string, std::size_t> entries;  // file label -> entries of its records
  for (const auto& r : *records) entries[r.label] += r.entries.size();
  EXPECT_EQ(entries.at(""), 4u);
  EXPECT_EQ(entries.at("tensor0"), 4u * 2 + 2u * 3);  // (1 x 4's tensor group, and 2 x 2's of data index 0)
  EXPECT_EQ(entries.at("tensor1"), 2u * 3);
  EXPECT_EQ(entries.at("data0"), 2u * 4);
  EXPECT_EQ(entries.at("data1"), 2u * 4);
  EXPECT_TRUE(fs::exists(dir / "rank3-of4.tensor0.json"));
  EXPECT_TRUE(fs::exists(dir / "rank1-of2.data1.json"));
  const std::string text = diagnose(*records, 4);
  EXPECT_EQ(text.find("flight recorder: 4 ranks, records from 4\n"), 0u) << text;
  EXPECT_NE(text.find("diagnosis: no rank is behind: every rank completed #0,"), std::string::npos) << text;
  EXPECT_NE(text.find("communicator tensor0: 4 ranks, records from 4"), std::string::npos) << text;
  EXPECT_NE(text.find("communicator tensor0: 2 ranks, records from 2"), std::string::npos) << text;
  EXPECT_NE(text.find("communicator data1: 2 ranks, records from 2"), std::string::npos) << text;
  EXPECT_NE(text.find("every rank completed #3, none is in a collective"), std::string::npos) << text;
  // A label that is no file-name word is refused by name.
  auto comms = make_local_communicators(1, {});
  ASSERT_TRUE(comms);
  auto bad = (*comms)[0]->set_flight_label("../x");
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.error().message().find("flight recorder label '../x': expected 1 to 64 of a-z"), std::string::npos);
}

}  // namespace
}  // namespace coshard::collectives
