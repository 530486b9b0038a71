// What a coshard-train run reports as it goes: the metrics file (every key, the loss falling), the
// Chrome trace of every stream of every rank, and an out-of-core run's time split.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>
#include <vector>

#include "binary_harness.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

TEST(CoshardTrain, MetricsHaveEveryKeyAndTheLossFalls) {
  const fs::path dir = scratch("metrics");
  const auto r = run(with(kTiny, {"--steps", "30", "--world-size", "2", "--metrics", (dir / "m.jsonl").string()}), dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("step 30/30"), std::string::npos) << r.output;
  std::ifstream in(dir / "m.jsonl");
  std::string line;
  std::vector<nlohmann::json> rows;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << line;
    rows.push_back(j);
  }
  ASSERT_EQ(rows.size(), 30u);
  for (const char* key : {"step", "loss", "tokens_per_s", "step_ms", "gathered_bytes", "reduce_scattered_bytes",
                          "peak_gathered_bytes", "blocking_waits", "swap_bytes", "prefetch_hit_rate", "exposed_comm_ms",
                          "compute_ms", "compute_idle_ms"})
    EXPECT_TRUE(rows[0].contains(key)) << key;
  for (const char* key : {"optimizer_ms", "nvme_read_bytes", "nvme_busy_ms"})
    EXPECT_FALSE(rows[0].contains(key)) << key << ": nothing offloaded";
  EXPECT_EQ(rows[29]["step"], 30);
  EXPECT_GT(rows[5]["gathered_bytes"].get<double>(), 0);
  EXPECT_GT(rows[5]["prefetch_hit_rate"].get<double>(), 0.5);  // the trace from step 1 is used
  EXPECT_EQ(rows[29]["blocking_waits"], 0);
  EXPECT_LT(rows[29]["loss"].get<double>(), 0.8 * rows[0]["loss"].get<double>());
}

// --trace: valid Chrome-trace JSON with spans on both streams of every rank, from device
// timestamps, and exposed communication in the metrics.
TEST(CoshardTrain, TraceHasSpansOnEveryStreamOfEveryRank) {
  const fs::path dir = scratch("trace");
  const auto r = run(with(kTiny, {"--steps", "4", "--world-size", "3", "--trace", (dir / "t.json").string(),
                                  "--metrics", (dir / "m.jsonl").string()}),
                     dir);
  ASSERT_EQ(r.code, 0) << r.output;
  const auto doc = nlohmann::json::parse(slurp(dir / "t.json"), nullptr, false);
  ASSERT_FALSE(doc.is_discarded());
  ASSERT_TRUE(doc.contains("traceEvents"));
  std::map<std::pair<int, int>, std::set<std::string>> categories;  // (rank, thread) -> span kinds
  std::set<std::string> thread_names;
  for (const auto& ev : doc["traceEvents"]) {
    const auto ph = ev["ph"].get<std::string>();
    if (ph == "M") {
      if (ev["name"] == "thread_name") thread_names.insert(ev["args"]["name"].get<std::string>());
      continue;
    }
    ASSERT_TRUE(ph == "X" || ph == "i") << ev.dump();
    EXPECT_GE(ev["ts"].get<double>(), 0.0);
    if (ph == "X") EXPECT_GE(ev["dur"].get<double>(), 0.0);
    categories[{ev["pid"].get<int>(), ev["tid"].get<int>()}].insert(ev["cat"].get<std::string>());
  }
  EXPECT_EQ(thread_names, (std::set<std::string>{"compute stream", "comm stream"}));
  for (int rank = 0; rank < 3; ++rank) {
    const auto& compute = categories[{rank, 1}];
    const auto& comm = categories[{rank, 2}];
    for (const char* c : {"forward", "backward", "wait", "release", "optimizer"})
      EXPECT_TRUE(compute.contains(c)) << "rank " << rank << " compute lacks " << c;
    for (const char* c : {"fetch", "prefetch", "reduce_scatter"})
      EXPECT_TRUE(comm.contains(c)) << "rank " << rank << " comm lacks " << c;
  }
  std::ifstream in(dir / "m.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    ASSERT_TRUE(j["exposed_comm_ms"].is_number()) << line;
    EXPECT_GE(j["exposed_comm_ms"].get<double>(), 0.0);
    EXPECT_LE(j["exposed_comm_ms"].get<double>(), j["step_ms"].get<double>() * 1.5) << line;
  }
}

// An out-of-core run (optimizer state and parameters on NVMe) says where its steps went: the
// metrics split each step into compute, the host optimizer and the disk's reads and writes (bytes
// and busy time), the progress lines print it, and the trace has the store's transfers on tracks
// of their own, inside the steps' time.
TEST(CoshardTrain, AnOutOfCoreRunShowsWhereItsStepsWent) {
  const fs::path dir = scratch("out_of_core_split");
  fs::create_directories(dir / "swap");
  const auto r = run(with(kTiny, {"--steps", "3", "--world-size", "2", "--offload-optimizer", "nvme:" + (dir / "swap").string(),
                                  "--offload-params", "nvme", "--metrics", (dir / "m.jsonl").string(), "--trace",
                                  (dir / "t.json").string()}),
                     dir);
  ASSERT_EQ(r.code, 0) << r.output;
  EXPECT_NE(r.output.find("nvme read"), std::string::npos) << r.output;
  std::ifstream in(dir / "m.jsonl");
  std::string line;
  int rows = 0;
  while (std::getline(in, line)) {
    const auto j = nlohmann::json::parse(line);
    ++rows;
    for (const char* key : {"compute_ms", "optimizer_ms", "nvme_read_bytes", "nvme_written_bytes", "nvme_read_ms",
                            "nvme_write_ms", "nvme_busy_ms"}) {
      ASSERT_TRUE(j.contains(key) && j[key].is_number()) << key << ": " << line;
      EXPECT_GT(j[key].get<double>(), 0.0) << key << ": " << line;
    }
    EXPECT_LE(j["nvme_busy_ms"].get<double>(), j["nvme_read_ms"].get<double>() + j["nvme_write_ms"].get<double>() + 1e-6);
  }
  EXPECT_EQ(rows, 3);
  const auto doc = nlohmann::json::parse(slurp(dir / "t.json"), nullptr, false);
  ASSERT_FALSE(doc.is_discarded());
  std::set<std::string> thread_names;
  std::map<int, double> compute_end, nvme_end;  // by rank, the last end on each kind of track
  for (const auto& ev : doc["traceEvents"]) {
    if (ev["ph"] == "M") {
      if (ev["name"] == "thread_name") thread_names.insert(ev["args"]["name"].get<std::string>());
      continue;
    }
    if (ev["ph"] != "X") continue;
    const double end = ev["ts"].get<double>() + ev["dur"].get<double>();
    auto& last = ev["tid"].get<int>() >= 3 ? nvme_end[ev["pid"].get<int>()] : compute_end[ev["pid"].get<int>()];
    last = std::max(last, end);
    EXPECT_GE(ev["ts"].get<double>(), 0.0) << ev.dump();
  }
  EXPECT_EQ(thread_names, (std::set<std::string>{"compute stream", "comm stream", "nvme read", "nvme write"}));
  for (const auto& [rank, end] : nvme_end) {
    EXPECT_GT(end, 0.0);
    EXPECT_LE(end, compute_end[rank] * 1.5 + 1000.0) << "rank " << rank << ": transfers placed far past the steps";
  }
}

}  // namespace
