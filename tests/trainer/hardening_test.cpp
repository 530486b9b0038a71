// coshard-train against a hostile or careless user (docs/reliability.md): every refusal names the
// value and what was expected, exits 2 for a bad command line, and leaves every file the user did
// not name as an output as it was.
#include <gtest/gtest.h>

#include "support/sanitizers.hpp"

#include <chrono>
#include <cstring>
#include <filesystem>
#include <limits>
#include <fstream>
#include <string>
#include <thread>

#include "binary_harness.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

const std::vector<std::string> kQuick = with(kTiny, {"--steps", "2", "--quiet"});

::testing::AssertionResult refused(const Exit& r, int code, const std::string& expect) {
  if (r.code != code)
    return ::testing::AssertionFailure() << "exit " << r.code << ", expected " << code << ": " << r.output;
  if (r.output.find(expect) == std::string::npos)
    return ::testing::AssertionFailure() << "the output lacks '" << expect << "': " << r.output;
  return ::testing::AssertionSuccess();
}

// Item 1: an output path that is a device (or a folder, or a fifo) is refused up front; nothing
// replaces it. (A device node of our own under the scratch folder when we may make one; /dev/null
// is only ever inspected.)
TEST(Hardening, OutputsNeverReplaceADeviceOrAFolder) {
  const fs::path dir = scratch("hard_device");
  for (const char* flag : {"--export", "--trace", "--metrics"}) {
    SCOPED_TRACE(flag);
    EXPECT_TRUE(refused(run(with(kQuick, {flag, "/dev/null"}), dir), 2, std::string(flag) + " /dev/null: is a character device"));
    EXPECT_TRUE(fs::is_character_file("/dev/null"));
    fs::create_directories(dir / "folder");
    EXPECT_TRUE(refused(run(with(kQuick, {flag, (dir / "folder").string()}), dir), 2, "is a folder"));
    EXPECT_TRUE(fs::is_directory(dir / "folder"));
  }
  ASSERT_EQ(::mkfifo((dir / "fifo").c_str(), 0600), 0);
  EXPECT_TRUE(refused(run(with(kQuick, {"--export", (dir / "fifo").string()}), dir), 2, "is a fifo"));
  EXPECT_TRUE(fs::is_fifo(dir / "fifo"));
}

// Item 3: a fresh run in a folder of checkpoints is refused and changes nothing there; --resume
// continues; --start-over removes only coshard's checkpoints (not the user's other files).
TEST(Hardening, AFreshRunNeverOverwritesCheckpoints) {
  const fs::path dir = scratch("hard_ck");
  const fs::path ck = dir / "ck";
  const auto base = with(kTiny, {"--quiet", "--checkpoint-dir", ck.string(), "--checkpoint-every", "1"});
  ASSERT_EQ(run(with(base, {"--steps", "3"}), dir).code, 0);
  ASSERT_EQ(latest_step(ck), 3);
  std::ofstream(ck / "notes.txt") << "mine";
  const auto before = slurp(ck / "step-00000003" / "rank-00000.safetensors");
  EXPECT_TRUE(refused(run(with(base, {"--steps", "2"}), dir), 2, "holds 3 checkpoint(s) (newest step-00000003)"));
  EXPECT_EQ(latest_step(ck), 3);
  EXPECT_EQ(slurp(ck / "step-00000003" / "rank-00000.safetensors"), before);
  EXPECT_TRUE(refused(run(with(base, {"--steps", "2", "--start-over", "--resume"}), dir), 2, "excludes"));
  const auto over = run(with(base, {"--steps", "2", "--start-over"}), dir);
  ASSERT_EQ(over.code, 0) << over.output;
  EXPECT_EQ(latest_step(ck), 2);
  EXPECT_FALSE(fs::exists(ck / "step-00000003"));
  EXPECT_EQ(slurp(ck / "notes.txt"), "mine");
}

// Item 5: an output naming an input, or another output, or a file inside an output folder.
TEST(Hardening, OutputsNeverAliasInputs) {
  const fs::path dir = scratch("hard_alias");
  const std::string corpus = (dir / "corpus.txt").string();
  std::ofstream(corpus) << std::string(4096, 'a');
  const auto text = slurp(corpus);
  EXPECT_TRUE(refused(run(with(kQuick, {"--data", corpus, "--metrics", corpus}), dir), 2,
                      "--metrics " + corpus + " is the same file as --data"));
  fs::create_symlink(corpus, dir / "link.txt");
  EXPECT_TRUE(refused(run(with(kQuick, {"--data", corpus, "--export", (dir / "link.txt").string()}), dir), 2,
                      "is the same file as --data"));
  EXPECT_TRUE(refused(run(with(kQuick, {"--metrics", (dir / "m").string(), "--trace", (dir / "./m").string()}), dir), 2,
                      "name the same file"));
  EXPECT_TRUE(refused(run(with(kQuick, {"--checkpoint-dir", (dir / "ck").string(), "--metrics", (dir / "ck/m").string()}), dir),
                      2, "lies inside --checkpoint-dir"));
  EXPECT_TRUE(refused(run(with(kQuick, {"--checkpoint-dir", (dir / "ck").string(), "--offload-optimizer",
                                        "nvme:" + (dir / "ck").string()}),
                          dir),
                      2, "is the same folder as"));
  EXPECT_EQ(slurp(corpus), text);
}

// Item 6: data must be a regular file; a folder or a device is refused by name, not read.
TEST(Hardening, DataIsARegularFile) {
  const fs::path dir = scratch("hard_data");
  EXPECT_TRUE(refused(run(with(kQuick, {"--data", dir.string()}), dir), 2,
                      "--data " + dir.string() + ": is a folder; expected a regular file"));
  EXPECT_TRUE(refused(run(with(kQuick, {"--data", "/dev/zero"}), dir), 2,
                      "--data /dev/zero: is a character device; expected a regular file"));
  std::ofstream(dir / "small.txt") << "abc";
  EXPECT_TRUE(refused(run(with(without(kQuick, "--vocab"), {"--data", (dir / "small.txt").string()}), dir), 2,
                      "3 bytes; a sequence length of 8 needs at least 9"));
}

// Item 8: a resume with anything that defines the run changed is refused, both values named;
// what may change (lr, batch, world size, offload) resumes.
TEST(Hardening, ResumeRefusesADifferentRun) {
  const fs::path dir = scratch("hard_resume");
  const fs::path ck = dir / "ck";
  const auto base = std::vector<std::string>{"--layers", "1", "--dim", "16", "--seq", "8", "--vocab", "32",
                                             "--quiet", "--checkpoint-dir", ck.string(), "--checkpoint-every", "1"};
  ASSERT_EQ(run(with(base, {"--heads", "2", "--batch", "12", "--steps", "2"}), dir).code, 0);
  const auto resume = with(base, {"--resume", "--steps", "3"});
  EXPECT_TRUE(refused(run(with(resume, {"--heads", "4", "--batch", "12"}), dir), 1, "heads 2 seq 8, this run gpt layers 1 dim 16 heads 4"));
  EXPECT_TRUE(refused(run(with(resume, {"--heads", "2", "--batch", "12", "--seed", "9"}), dir), 1, "seed: saved 1, this run 9"));
  std::ofstream(dir / "corpus.txt") << std::string(1000, 'x');
  EXPECT_TRUE(refused(run(with(without(resume, "--vocab"), {"--heads", "2", "--batch", "12", "--data",
                                                            (dir / "corpus.txt").string()}),
                          dir),
                      1, "data: saved synthetic vocab 32"));
  EXPECT_EQ(latest_step(ck), 2);
  const auto ok = run(with(resume, {"--heads", "2", "--batch", "6", "--world-size", "1", "--lr", "0.001",
                                    "--offload-optimizer", "cpu"}),
                      dir);
  ASSERT_EQ(ok.code, 0) << ok.output;
  EXPECT_EQ(latest_step(ck), 3);
}

// Item 10: fp16 and bf16 both enabled in a DeepSpeed config.
TEST(Hardening, Fp16AndBf16TogetherAreRefused) {
  const fs::path dir = scratch("hard_precision");
  std::ofstream(dir / "ds.json") << R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})";
  EXPECT_TRUE(refused(run(with(kQuick, {"--config", (dir / "ds.json").string()}), dir), 2,
                      "fp16.enabled=true and bf16.enabled=true (expected at most one of them)"));
}

// The schedule and DeepSpeed's batch sizes through the binary: the lr of each step follows the
// warm-up and the cosine decay; a config whose batch sizes disagree with the world is refused.
TEST(Hardening, ScheduleAndBatchSizesFromTheCommandLineAndConfig) {
  const fs::path dir = scratch("hard_schedule");
  const auto r = run({"--layers", "1", "--dim", "16", "--heads", "2", "--seq", "8", "--batch", "4", "--steps", "10", "--quiet",
                      "--lr", "0.01", "--warmup", "2", "--lr-decay", "cosine", "--min-lr", "0.001", "--metrics",
                      (dir / "m.jsonl").string()},
                     dir);
  ASSERT_EQ(r.code, 0) << r.output;
  std::ifstream in(dir / "m.jsonl");
  std::string line;
  std::vector<double> lrs;
  while (std::getline(in, line)) lrs.push_back(nlohmann::json::parse(line)["lr"].get<double>());
  ASSERT_EQ(lrs.size(), 10u);
  EXPECT_NEAR(lrs[0], 0.005, 1e-7);
  EXPECT_NEAR(lrs[1], 0.01, 1e-7);
  EXPECT_NEAR(lrs[6], 0.0055, 1e-7);  // halfway through the decay (steps 2..10)
  EXPECT_LT(lrs[9], lrs[8]);
  std::ofstream(dir / "ds.json") << R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4})";
  EXPECT_TRUE(refused(run(with(kTiny, {"--world-size", "2", "--config", (dir / "ds.json").string()}), dir), 2,
                      "expected train_batch_size = micro batch x accumulation x world = 8"));
}

// Item 11: every output path is checked before the first step, not at the first save or after
// training (the trained model would be lost).
TEST(Hardening, OutputPathsAreCheckedBeforeTraining) {
  const fs::path dir = scratch("hard_early");
  std::ofstream(dir / "file") << "x";
  const std::string under_file = (dir / "file" / "sub").string();
  for (const char* flag : {"--export", "--trace", "--metrics", "--checkpoint-dir"}) {
    SCOPED_TRACE(flag);
    const auto r = run(with(kTiny, {"--steps", "100000", flag, under_file}), dir);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find(std::string(flag) + " " + under_file), std::string::npos) << r.output;
  }
  EXPECT_TRUE(refused(run(with(kQuick, {"--export", (dir / "absent" / "model.safetensors").string()}), dir), 2,
                      "cannot be used (No such file or directory)"));
}

// Item 12: clear messages and exit code 2 for every command-line error.
TEST(Hardening, MessagesNameTheValueAndCommandLineErrorsExit2) {
  const fs::path dir = scratch("hard_messages");
  EXPECT_TRUE(refused(run(with(kQuick, {"--bogus"}), dir), 2, "--bogus"));
  EXPECT_TRUE(refused(run(with(kTiny, {"--steps", "x"}), dir), 2, "--steps"));
  EXPECT_TRUE(refused(run(with(kTiny, {"--dtype", "f8"}), dir), 2, "--dtype"));
  EXPECT_EQ(run({"--help"}, dir).code, 0);
  const fs::path ck = dir / "ck";
  fs::create_directories(ck / "latest");
  EXPECT_TRUE(refused(run(with(kQuick, {"--checkpoint-dir", ck.string(), "--resume"}), dir), 1,
                      "latest: is a folder; expected a regular file"));
  fs::remove_all(ck / "latest");
  std::ofstream(dir / "secret") << "root:x:0:0:root:/root:/bin/bash\nline two\n";
  fs::create_symlink(dir / "secret", ck / "latest");
  const auto echoed = run(with(kQuick, {"--checkpoint-dir", ck.string(), "--resume"}), dir);
  EXPECT_TRUE(refused(echoed, 1, "holds 41 bytes, not a checkpoint folder name"));
  EXPECT_EQ(echoed.output.find("root:x"), std::string::npos) << echoed.output;
  EXPECT_TRUE(refused(run({"--steps", "1", "--batch", "1073741824", "--world-size", "1", "--seq", "8"}, dir), 2,
                      "--batch 1073741824 x --seq 8: the host batches need"));
  ::setenv("WORLD_SIZE", "abc", 1);
  const auto bad_world = run(kQuick, dir);
  ::unsetenv("WORLD_SIZE");
  EXPECT_TRUE(refused(bad_world, 2, "WORLD_SIZE='abc'"));
}

// Item 7: a failure on one rank (here rank 0's metrics write on a full disk) stops every other
// rank at once, each naming the rank that failed and why, instead of waiting out the collective
// timeout (60 s) for a rank that will never arrive.
TEST(Hardening, AFailedRankStopsTheOthersAtOnce) {
  const fs::path dir = scratch("hard_abort");
  for (const int world : {2, 4}) {
    SCOPED_TRACE(world);
    const auto begin = std::chrono::steady_clock::now();
    const auto r = run_with_file_limit(with(kTiny, {"--steps", "100000", "--quiet", "--world-size", std::to_string(world),
                                                    "--metrics", (dir / "m.jsonl").string()}),
                                       dir, 8192);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
    EXPECT_EQ(r.code, 1) << r.output;
    EXPECT_NE(r.output.find("rank 0: --metrics"), std::string::npos) << r.output;
    for (int rank = 1; rank < world; ++rank)
      EXPECT_NE(r.output.find("rank " + std::to_string(rank) + ": "), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("rank 0 of Local group of " + std::to_string(world) + " failed: --metrics"), std::string::npos)
        << r.output;
    EXPECT_EQ(r.output.find("timed out"), std::string::npos) << r.output;
    EXPECT_LT(seconds, 30.0) << "half the collective timeout";
    std::printf("world %d: stopped %.2f s after the start\n", world, seconds);
  }
}

// Item 9: non-finite initial weights are refused by name; a run whose every step is skipped
// (a learning rate that blew up) stops after --max-skipped-steps in a row.
TEST(Hardening, NonFiniteWeightsAndEndlessSkipsStopTheRun) {
  const fs::path dir = scratch("hard_finite");
  const fs::path model = dir / "model.safetensors";
  ASSERT_EQ(run(with(kQuick, {"--export", model.string()}), dir).code, 0);
  // The first element of the first tensor becomes NaN (f32 after the 8-byte length and header).
  std::string bytes = slurp(model);
  std::uint64_t header = 0;
  for (int i = 0; i < 8; ++i) header |= static_cast<std::uint64_t>(static_cast<unsigned char>(bytes[i])) << (8 * i);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::memcpy(bytes.data() + 8 + header, &nan, sizeof nan);
  std::ofstream(dir / "nan.safetensors", std::ios::binary) << bytes;
  EXPECT_TRUE(refused(run(with(kQuick, {"--init", (dir / "nan.safetensors").string()}), dir), 1,
                      "element 0 is nan; initial weights must be finite"));
  const auto blown = run({"--layers", "1", "--dim", "16", "--heads", "2", "--seq", "8", "--batch", "12", "--steps", "100",
                          "--quiet", "--lr", "1e30", "--max-skipped-steps", "3", "--metrics", (dir / "m.jsonl").string()},
                         dir);
  EXPECT_TRUE(refused(blown, 1, "3 steps in a row skipped for inf/NaN gradients"));
  EXPECT_TRUE(refused(blown, 1, "max_skipped_steps=3"));
  std::ifstream metrics(dir / "m.jsonl");
  std::string line;
  int steps = 0;
  while (std::getline(metrics, line)) ++steps;
  EXPECT_LT(steps, 10);
}

// Item 2 (and 14's swap files): a second run on an NVMe folder in use is refused, naming the
// holder; a clean exit leaves no swap files behind.
TEST(Hardening, TwoRunsNeverShareAnOffloadFolder) {
  const fs::path dir = scratch("hard_nvme");
  const fs::path swap = dir / "swap";
  const auto nvme = with(kTiny, {"--quiet", "--world-size", "2", "--offload-optimizer", "nvme:" + swap.string()});
  const pid_t first = start(with(nvme, {"--steps", "1000000"}), dir / "first.txt");
  ASSERT_GT(first, 0);
  for (int i = 0; i < 3000 && !(fs::exists(swap / "rank0-of-2" / ".coshard-lock") &&
                                fs::exists(swap / "rank1-of-2" / ".coshard-lock") && fs::exists(swap / "rank1-of-2" / "unit0"));
       ++i)
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  const auto second = run(with(nvme, {"--steps", "2"}), dir);
  ::kill(first, SIGKILL);
  ::waitpid(first, nullptr, 0);
  EXPECT_TRUE(refused(second, 1, "is in use by coshard rank"));
  EXPECT_TRUE(refused(second, 1, "(pid " + std::to_string(first) + " on "));
  // The killed run's lock died with it; a clean run then removes its swap files.
  const auto clean = run(with(nvme, {"--steps", "2"}), dir);
  ASSERT_EQ(clean.code, 0) << clean.output;
  EXPECT_FALSE(fs::exists(swap / "rank0-of-2"));
  EXPECT_FALSE(fs::exists(swap / "rank1-of-2"));
  EXPECT_TRUE(fs::is_directory(swap));
}

// Item 4: running out of memory while setting up (every offload mode) is a clear error naming the
// bytes asked for, and the teardown after it is safe (it was a segfault in ~Optimizer with the
// optimizer offloaded, and in the model's ~Tensor with the parameters on NVMe).
TEST(Hardening, OutOfMemoryAtSetupIsAnErrorNotACrash) {
#if defined(COSHARD_TEST_ASAN) || defined(COSHARD_TEST_TSAN)
  GTEST_SKIP() << "the sanitizers reserve more address space than the limit this test sets";
#else
  const fs::path dir = scratch("hard_oom");
  // Past the memory estimate (which would refuse these limits up front): the allocations fail.
  // One BLAS thread a rank: by default a rank takes its share of the cores, and on a machine of
  // many the threads' buffers alone exhaust these limits (on 16 cores the runtime's own thread
  // could not start); that message is checked below too.
  // One step: every buffer a run holds is made by the end of its first step, and the twelve runs
  // at two steps took most of the suite's 120 s under a CPU hog.
  const std::vector<std::string> big = {"--dim", "1024", "--layers", "16", "--heads", "8", "--steps", "1", "--quiet",
                                        "--skip-memory-check", "--blas-threads", "1"};
  const std::vector<std::vector<std::string>> modes = {
      {},
      {"--offload-optimizer", "cpu"},
      {"--offload-optimizer", "nvme:" + (dir / "swap").string()},
      {"--offload-optimizer", "cpu", "--offload-params", "cpu"},
      {"--offload-optimizer", "nvme:" + (dir / "swap").string(), "--offload-params", "nvme"},
      {"--zero-stage", "1"}};
  int out_of_memory = 0;
  for (const auto& mode : modes) {
    for (const rlim_t limit : {rlim_t{2} << 30, rlim_t{5} << 29}) {
      SCOPED_TRACE(::testing::PrintToString(mode) + " limit " + std::to_string(limit));
      const auto r = run_with_limit(with(big, mode), dir, RLIMIT_AS, limit);
      EXPECT_TRUE(r.code == 0 || r.code == 1) << "exit " << r.code << ": " << r.output;  // never a signal
      if (r.code == 1) {
        EXPECT_NE(r.output.find("out of host memory"), std::string::npos) << r.output;  // a thread's stack too
        ++out_of_memory;
      }
    }
  }
  EXPECT_GT(out_of_memory, 0) << "no limit was tight enough to test anything";
#endif
}

// Waits until the metrics file of a running coshard-train has `lines` lines (training is under
// way, the signal handlers are in place); false if it does not within a minute.
bool wait_for_metrics(const fs::path& metrics, int lines) {
  for (int i = 0; i < 6000; ++i) {
    std::ifstream in(metrics);
    std::string line;
    int n = 0;
    while (std::getline(in, line)) ++n;
    if (n >= lines) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return false;
}

Exit finish(pid_t pid, const fs::path& output) {
  int status = 0;
  ::waitpid(pid, &status, 0);
  return {WIFEXITED(status) ? WEXITSTATUS(status) : (WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1), slurp(output)};
}

// Item 14: the first SIGTERM/SIGINT finishes the step, saves it, publishes, and exits 128+signal
// with a line saying so; a resume continues from exactly there. Leftovers of failed saves are
// cleaned, --keep-checkpoints rotates, and a second signal stops at once.
TEST(Hardening, SignalsStopGracefullyOnceAndAtOnceTwice) {
  const fs::path dir = scratch("hard_signals");
  const fs::path ck = dir / "ck";
  fs::create_directories(ck / "step-00000077.partial");
  std::ofstream(ck / "step-00000077.partial" / "rank-00000.safetensors.tmp") << "half a save";
  for (const int world : {1, 2}) {
    SCOPED_TRACE(world);
    const fs::path metrics = dir / ("m" + std::to_string(world) + ".jsonl");
    // At least three saves before the signal, so that --keep-checkpoints 2 prunes one (half the
    // steps under a sanitizer, where a step of this tiny model takes a good part of a second).
    const auto args = with(kTiny, {"--steps", "1000000", "--quiet", "--world-size", std::to_string(world), "--checkpoint-dir",
                                   ck.string(), "--checkpoint-every", kSanitized ? "2" : "5", "--keep-checkpoints", "2",
                                   "--start-over", "--metrics", metrics.string()});
    const pid_t pid = start(args, dir / "out.txt");
    ASSERT_GT(pid, 0);
    ASSERT_TRUE(wait_for_metrics(metrics, kSanitized ? 6 : 12));
    ::kill(pid, SIGTERM);
    const auto r = finish(pid, dir / "out.txt");
    EXPECT_EQ(r.code, 128 + SIGTERM) << r.output;
    EXPECT_NE(r.output.find("stopped by SIGTERM after step"), std::string::npos) << r.output;
    const auto steps = losses_in(metrics).size();
    EXPECT_EQ(latest_step(ck), static_cast<std::int64_t>(steps)) << "the last step is saved";
    std::size_t published = 0;
    for (const auto& e : fs::directory_iterator(ck)) {
      const auto name = e.path().filename().string();
      EXPECT_FALSE(name.ends_with(".partial") || name.ends_with(".replaced")) << name;
      published += name.starts_with("step-") ? 1 : 0;
    }
    EXPECT_EQ(published, 2u) << "--keep-checkpoints 2";
    // It resumes from there.
    const auto resumed = run(with(kTiny, {"--steps", std::to_string(steps + 1), "--quiet", "--world-size", std::to_string(world),
                                          "--checkpoint-dir", ck.string(), "--resume"}),
                             dir);
    EXPECT_EQ(resumed.code, 0) << resumed.output;
  }
  // A second signal while the first is being honoured stops the process at once.
  const fs::path metrics = dir / "twice.jsonl";
  // Steps of a second or more: the first signal's graceful stop is still finishing its step when
  // the second comes (a gap, so that the two are not merged into one pending signal).
  const pid_t pid = start({"--dim", "384", "--layers", "4", "--heads", "4", "--seq", "128", "--batch", "16", "--steps",
                           "1000000", "--quiet", "--metrics", metrics.string()},
                          dir / "twice.txt");
  ASSERT_GT(pid, 0);
  ASSERT_TRUE(wait_for_metrics(metrics, 1));
  ::kill(pid, SIGINT);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  ::kill(pid, SIGINT);
  const auto twice = finish(pid, dir / "twice.txt");
  EXPECT_EQ(twice.code, 128 + SIGINT) << twice.output;
  EXPECT_EQ(twice.output.find("stopped by"), std::string::npos) << "killed by the second signal, not stopped gracefully";
}

}  // namespace

// Item 13: --estimate prints what each rank will hold, item by item, against this machine; a run
// that cannot fit is refused up front with the numbers (it grew to 12 GB before the system
// stopped it), creating nothing.
TEST(Hardening, MemoryEstimatePrintedAndARunThatCannotFitRefused) {
  const fs::path dir = scratch("hard_estimate");
  const auto plain = run({"--estimate"}, dir);  // the default run
  EXPECT_EQ(plain.code, 0) << plain.output;
  for (const char* line : {"per rank:", "parameter shards (f32)", "gathered parameters (max_live_bytes)",
                           "optimizer state (2 tensors)", "activations (one micro-batch)", "this process (2 ranks): device",
                           "machine: host", "\nfits\n"})
    EXPECT_NE(plain.output.find(line), std::string::npos) << line << " in " << plain.output;

  const fs::path swap = dir / "swap", ck = dir / "ck";
  const auto nvme = run({"--estimate", "--dim", "256", "--dtype", "bf16", "--offload-optimizer", "nvme:" + swap.string(),
                         "--checkpoint-dir", ck.string()},
                        dir);
  EXPECT_EQ(nvme.code, 0) << nvme.output;
  for (const char* line : {"fp32 masters and 2 state tensors (swap files)", "gradient shards and swap buffers",
                           "checkpoint staging", "free at "})
    EXPECT_NE(nvme.output.find(line), std::string::npos) << line << " in " << nvme.output;
  EXPECT_FALSE(fs::exists(swap)) << "an estimate creates nothing";
  EXPECT_FALSE(fs::exists(ck));

  const std::vector<std::string> huge = {"--dim", "8192", "--layers", "64", "--heads", "64", "--max-live", "4GiB",
                                         "--metrics", (dir / "metrics.jsonl").string()};
  EXPECT_TRUE(refused(run(with(huge, {"--estimate"}), dir), 1,
                      "does not fit: memory estimate: 2 ranks of this process need"));
  const auto r = run(huge, dir);
  EXPECT_TRUE(refused(r, 2, "of host memory (the device is the CPU: its memory counted too), and this process may take"));
  EXPECT_NE(r.output.find("--estimate shows each item"), std::string::npos) << r.output;
  EXPECT_FALSE(fs::exists(dir / "metrics.jsonl")) << "refused before anything was written";
}
