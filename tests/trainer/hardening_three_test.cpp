// coshard-train against a hostile user, round three (issue 33): each case as the report gave it,
// asserting the named error, an exit status below 128, the inputs unchanged, and a time bound.
#include <gtest/gtest.h>

#include "support/sanitizers.hpp"

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <string>
#include <thread>

#include "binary_harness.hpp"

namespace {

namespace fs = std::filesystem;
using namespace coshard::testing;

const std::vector<std::string> kQuick = with(kTiny, {"--steps", "2", "--quiet"});
const std::vector<std::string> kLlama = {"--preset", "llama-tiny", "--layers", "1", "--dim", "32", "--heads", "4",
                                         "--seq", "16", "--batch", "4", "--steps", "2", "--quiet"};

// Item 2: a link planted under the name the export's temporary once had is not written through,
// and a fifo of that name does not block the export.
TEST(HardeningThree, ExportNeverWritesThroughAPlantedTemporary) {
  const fs::path dir = scratch("h3_planted");
  const fs::path out = dir / "ex";
  fs::create_directories(out);
  std::ofstream(dir / "victim") << "precious";
  fs::create_symlink(dir / "victim", out / "config.json.tmp");
  ASSERT_EQ(::mkfifo((out / "model.safetensors.tmp").c_str(), 0644), 0);
  const auto start = std::chrono::steady_clock::now();
  const auto r = run(with(kLlama, {"--export", out.string()}), dir);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(r.code, 0) << r.output;
  EXPECT_LT(seconds, 60.0);
  EXPECT_EQ(slurp(dir / "victim"), "precious");
  EXPECT_TRUE(fs::is_symlink(out / "config.json.tmp"));
  EXPECT_TRUE(fs::is_fifo(out / "model.safetensors.tmp"));
  EXPECT_NE(slurp(out / "config.json").find("hidden_size"), std::string::npos);
}

// Item 3, as reported: a DeepSpeed config of depth 200,000 ended the run with SIGSEGV.
TEST(HardeningThree, ADeeplyNestedConfigIsRefusedNotACrash) {
  const fs::path dir = scratch("h3_deep");
  std::ofstream(dir / "d.json") << "{\"gradient_clipping\": " << std::string(200000, '[') << std::string(200000, ']') << "}";
  const auto r = run(with(kQuick, {"--config", (dir / "d.json").string()}), dir);
  EXPECT_GT(r.code, 0) << r.output.substr(0, 500);
  EXPECT_LT(r.code, 128) << r.output.substr(0, 500);
  EXPECT_NE(r.output.find("JSON nested deeper than 64 levels"), std::string::npos) << r.output.substr(0, 500);
  EXPECT_LT(r.output.size(), 2000u);
}

// Waits (up to two minutes) until a run publishes its first checkpoint.
bool first_checkpoint_published(const fs::path& ck) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (!fs::exists(ck / "latest") && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  return fs::exists(ck / "latest");
}

// Item 6: SIGUSR1 without --flight-recorder is harmless (noted, the run goes on), and SIGHUP
// (a closed terminal) ends a run as SIGTERM does: the step finished, a checkpoint saved.
TEST(HardeningThree, SighupSavesLikeSigtermAndSigusr1WithoutARecorderIsHarmless) {
  const fs::path dir = scratch("h3_signals");
  const fs::path ck = dir / "ck";
  const pid_t pid = start(with(kTiny, {"--steps", "100000", "--quiet", "--checkpoint-dir", ck.string(),
                                       "--checkpoint-every", "1000000", "--metrics", (dir / "m.jsonl").string()}),
                          dir / "out.txt");
  ASSERT_GT(pid, 0);
  // Under way (its handlers installed) once a step is in the metrics.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
  while (slurp(dir / "m.jsonl").empty() && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ::kill(pid, SIGUSR1);
  while (slurp(dir / "out.txt").find("SIGUSR1 ignored") == std::string::npos && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ::kill(pid, SIGHUP);
  int status = 0;
  ::waitpid(pid, &status, 0);
  const std::string out = slurp(dir / "out.txt");
  ASSERT_TRUE(WIFEXITED(status)) << "ended by a signal: " << out;
  EXPECT_EQ(WEXITSTATUS(status), 129) << out;
  EXPECT_NE(out.find("SIGUSR1 ignored (no --flight-recorder folder"), std::string::npos) << out;
  EXPECT_NE(out.find("stopped by SIGHUP after step"), std::string::npos) << out;
  EXPECT_NE(out.find("its checkpoint is published"), std::string::npos) << out;
  EXPECT_TRUE(fs::exists(ck / "latest"));
}

// Item 1: a second run on a live run's --checkpoint-dir (--start-over, or a second --resume) is
// refused naming the holder; the first run's checkpoints stay, and it goes on and saves.
TEST(HardeningThree, ASecondRunOnALiveCheckpointFolderIsRefused) {
  const fs::path dir = scratch("h3_lock");
  const fs::path ck = dir / "ck";
  const pid_t first = start(with(kTiny, {"--steps", "100000", "--quiet", "--checkpoint-dir", ck.string(),
                                         "--checkpoint-every", "1"}),
                            dir / "first.txt");
  ASSERT_GT(first, 0);
  ASSERT_TRUE(first_checkpoint_published(ck)) << slurp(dir / "first.txt");
  // It holds its lock for all of its 100,000 steps: nothing here depends on how far it gets. (Not
  // stopped with SIGSTOP: under ThreadSanitizer a SIGTERM after SIGCONT was sometimes held by a
  // thread parked in a futex wait and never handled, about one run in five.)
  for (const char* mode : {"--start-over", "--resume"}) {
    SCOPED_TRACE(mode);
    const auto r = run(with(kTiny, {"--steps", "3", "--quiet", "--checkpoint-dir", ck.string(), mode}), dir);
    EXPECT_EQ(r.code, 2) << r.output;
    EXPECT_NE(r.output.find("--checkpoint-dir " + ck.string() + " is in use by coshard-train rank 0 (pid " +
                            std::to_string(first)),
              std::string::npos)
        << r.output;
    EXPECT_TRUE(fs::exists(ck / "latest"));
  }
  ::kill(first, SIGTERM);  // finishes its step, saves, exits 143
  int status = 0;
  ::waitpid(first, &status, 0);
  ASSERT_TRUE(WIFEXITED(status)) << slurp(dir / "first.txt");
  EXPECT_EQ(WEXITSTATUS(status), 143) << slurp(dir / "first.txt");
  // Its checkpoints are whole: a resume from the last one runs a step more.
  std::string latest = slurp(ck / "latest");
  ASSERT_GT(latest.size(), 5u);
  const long long saved = std::stoll(latest.substr(5));
  const auto resumed = run(with(kTiny, {"--steps", std::to_string(saved + 1), "--quiet", "--checkpoint-dir", ck.string(),
                                        "--resume"}),
                           dir);
  EXPECT_EQ(resumed.code, 0) << resumed.output;
}

// Item 10: weights that are no longer finite stop the run at the step that shows it, named, and
// are never exported; a run that ends on losses that are not finite (finite weights whose outputs
// overflow) is an error too, with nothing exported.
TEST(HardeningThree, NonFiniteWeightsStopTheRunAndAreNeverExported) {
  const fs::path dir = scratch("h3_nonfinite");
  const auto decayed = run(with(kTiny, {"--steps", "4", "--quiet", "--weight-decay", "inf", "--export",
                                        (dir / "decayed.safetensors").string()}),
                           dir);
  EXPECT_GT(decayed.code, 0) << decayed.output;
  EXPECT_LT(decayed.code, 128) << decayed.output;
  EXPECT_NE(decayed.output.find("step 2: the loss is"), std::string::npos) << decayed.output;
  EXPECT_NE(decayed.output.find("weights are not finite"), std::string::npos) << decayed.output;
  EXPECT_FALSE(fs::exists(dir / "decayed.safetensors"));

  std::vector<std::string> tiny_huge_lr = kTiny;
  ASSERT_EQ(tiny_huge_lr[tiny_huge_lr.size() - 2], "--lr");
  tiny_huge_lr.back() = "1e30";
  const auto huge_lr = run(with(tiny_huge_lr, {"--steps", "6", "--quiet", "--export", (dir / "huge.safetensors").string()}),
                           dir);
  EXPECT_GT(huge_lr.code, 0) << huge_lr.output;
  EXPECT_LT(huge_lr.code, 128) << huge_lr.output;
  EXPECT_TRUE(huge_lr.output.find("the loss has not been finite since step") != std::string::npos ||
              huge_lr.output.find("weights are not finite") != std::string::npos)
      << huge_lr.output;
  EXPECT_FALSE(fs::exists(dir / "huge.safetensors"));

  // A sound run still exports.
  const auto sound = run(with(kTiny, {"--steps", "2", "--quiet", "--export", (dir / "sound.safetensors").string()}), dir);
  EXPECT_EQ(sound.code, 0) << sound.output;
  EXPECT_TRUE(fs::exists(dir / "sound.safetensors"));
}

// Item 13: --estimate works for every preset on its defaults (the gather budget follows the model
// where 1 GiB cannot hold its largest unit: Llama-3.1-8B's head is 2 GiB in f32); a budget the user
// names is exact, and refused by name when too small.
// #33 item 7: under an address-space limit OpenBLAS could not map its buffer and retried
// forever inside cblas_sgemm (SIGTERM unheard). Now every limit ends the run: trained (0) or a
// named error (1), never a hang or a signal; some limits fail on OpenBLAS's buffers by name.
TEST(HardeningThree, AnAddressSpaceLimitEndsTheRunWithANamedErrorNeverAHang) {
#if defined(COSHARD_TEST_ASAN) || defined(COSHARD_TEST_TSAN)
  GTEST_SKIP() << "the sanitizers reserve more address space than the limits this test sets";
#else
  const fs::path dir = scratch("hard3_address_limit");
  int blas_named = 0;
  for (rlim_t mib = 400; mib <= 2400; mib += 100) {
    SCOPED_TRACE("ulimit -v " + std::to_string(mib) + " MiB");
    const auto r = run_with_limit(with(kQuick, {"--blas-threads", "1", "--skip-memory-check"}), dir, RLIMIT_AS,
                                  mib << 20);
    // (a CUDA build's libraries may not even load under the lowest limits, or fail in their constructors)
    EXPECT_TRUE(r.code == 0 || r.code == 1 || ended_before_main(r)) << "exit " << r.code << ": " << r.output;
    if (r.code == 1)
      EXPECT_TRUE(r.output.find("out of host memory") != std::string::npos ||
                  r.output.find("cannot start its worker thread") != std::string::npos)
          << r.output;
    if (r.output.find("OpenBLAS needs about 128 MiB for the buffers of 1 thread") != std::string::npos) ++blas_named;
  }
  EXPECT_GT(blas_named, 0) << "no limit failed on OpenBLAS's buffers: the sweep no longer covers the case";
#endif
}

TEST(HardeningThree, EstimateWorksForEveryPresetOnItsDefaults) {
  const fs::path dir = scratch("h3_estimate");
  for (const char* preset : {"llama-tiny", "llama-100m", "Llama-3.2-1B", "Llama-3.2-3B", "Llama-3.1-8B"}) {
    const auto r = run({"--preset", preset, "--estimate"}, dir);
    EXPECT_TRUE(r.code == 0 || r.code == 1) << preset << ": " << r.output;  // fits, or not on this machine
    EXPECT_NE(r.output.find("gathered parameters (max_live_bytes)"), std::string::npos) << preset << ": " << r.output;
    EXPECT_TRUE(r.output.find("\nfits") != std::string::npos || r.output.find("does not fit") != std::string::npos)
        << preset << ": " << r.output;
  }
  const auto eight = run({"--preset", "Llama-3.1-8B", "--estimate"}, dir);
  EXPECT_NE(eight.output.find("gathered parameters (max_live_bytes)               3.91 GiB"), std::string::npos)
      << eight.output;
  const auto exact = run({"--preset", "Llama-3.1-8B", "--estimate", "--max-live", "1GiB"}, dir);
  EXPECT_EQ(exact.code, 2) << exact.output;
  EXPECT_NE(exact.output.find("max_live_bytes=1073741824: must be at least the largest fetch unit"), std::string::npos)
      << exact.output;
}

// Item 14: a value of megabytes is echoed cut (its length said), wherever it is refused: a
// DeepSpeed config's string, a --log-level item, thousands of unknown keys; and a text file named
// *.bin, read as uint16 ids by its name, fails with the hint to read it as bytes.
TEST(HardeningThree, HugeValuesAreEchoedCutAndATextBinSaysHowItWasRead) {
  const fs::path dir = scratch("h3_echo");
  const std::string huge(15'000'000, 'A');
  std::ofstream(dir / "big.json") << "{\"optimizer\": {\"type\": \"" << huge << "\"}}";
  {
    std::ofstream keys(dir / "keys.json");
    keys << "{";
    for (int i = 0; i < 5000; ++i) keys << (i ? "," : "") << "\"unknown_key_" << i << "\": 1";
    keys << "}";
  }
  std::ofstream(dir / "text.bin") << "hello world, this is text, not token ids!\n";
  struct Case {
    std::vector<std::string> args;
    std::vector<const char*> expect;
  };
  const Case cases[] = {
      {{"--config", (dir / "big.json").string()}, {"optimizer.type=\"AAAA", "... (15000000 characters)"}},
      {{"--log-level", std::string(100'000, 'x')}, {"--log-level item 'xxxx", "... (100000 characters)"}},
      {{"--config", (dir / "keys.json").string()}, {", and 4980 more]"}},
      {{"--data", (dir / "text.bin").string()},
       {"not below the model's vocabulary", "read as raw uint16 token ids because the name ends in .bin",
        "--data-format bytes"}},
  };
  for (const auto& c : cases) {
    const auto r = run(with(with(kTiny, {"--steps", "1", "--quiet"}), c.args), dir);
    EXPECT_TRUE(r.code == 1 || r.code == 2) << r.output.substr(0, 2000);
    EXPECT_LT(r.output.size(), 8000u) << r.output.substr(0, 2000);
    for (const char* e : c.expect) EXPECT_NE(r.output.find(e), std::string::npos) << e << ": " << r.output.substr(0, 2000);
  }
}

// Item 12: values that were silently replaced or ignored are refused by name (exit 2 before
// anything runs), and a resume with nothing left to train says so instead of exiting 0.
TEST(HardeningThree, SilentlyReplacedValuesAreRefusedByName) {
  const fs::path dir = scratch("h3_silent");
  struct Case {
    std::vector<std::string> args;
    const char* expect;
  };
  std::ofstream(dir / "text.txt") << "hello world, hello bytes";
  const Case cases[] = {
      {{"--seed", "-1"}, "--seed: expected a whole number from 0 to 18446744073709551615"},
      {{"--seed", "18446744073709551616"}, "--seed: expected a whole number from 0 to 18446744073709551615"},
      {{"--metrics", ""}, "--metrics: an empty path"},
      {{"--export", ""}, "--export: an empty path"},
      {{"--checkpoint-dir", ""}, "--checkpoint-dir: an empty path"},
      {{"--data", (dir / "text.txt").string(), "--vocab", "50257"}, "bytes are a vocabulary of 256"},
  };
  for (const auto& c : cases) {
    // kTiny's own --vocab 32 left out where the case names one.
    const auto tiny = std::find(c.args.begin(), c.args.end(), "--vocab") != c.args.end() ? without(kTiny, "--vocab") : kTiny;
    const auto r = run(with(with(tiny, {"--steps", "1", "--quiet"}), c.args), dir);
    EXPECT_EQ(r.code, 2) << c.expect << ": " << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << r.output;
  }
  EXPECT_EQ(run(with(kTiny, {"--steps", "1", "--quiet", "--seed", "18446744073709551615"}), dir).code, 0);

  const fs::path ck = dir / "ck";
  ASSERT_EQ(run(with(kTiny, {"--steps", "2", "--quiet", "--checkpoint-dir", ck.string(), "--checkpoint-every", "2"}), dir).code, 0);
  const auto done = run(with(kTiny, {"--steps", "2", "--quiet", "--checkpoint-dir", ck.string(), "--resume"}), dir);
  EXPECT_GT(done.code, 0) << done.output;
  EXPECT_LT(done.code, 128) << done.output;
  EXPECT_NE(done.output.find("is at step 2 already, so there is nothing to train (give --steps above 2)"),
            std::string::npos)
      << done.output;
  // The same refusal with the optimizer offloaded: the checkpoint's load into the host's optimizer
  // state was still queued on the compute stream when the refused run tore the engine down (a
  // write after free: heap corruption in about one run of ten, the message lost). Several times,
  // since it hung on timing.
  for (int i = 0; i < 8; ++i) {
    const auto offloaded = run(with(kTiny, {"--steps", "2", "--quiet", "--checkpoint-dir", ck.string(), "--resume",
                                            "--offload-optimizer", "cpu"}),
                               dir);
    EXPECT_GT(offloaded.code, 0) << offloaded.output;
    EXPECT_LT(offloaded.code, 128) << offloaded.output;
    EXPECT_NE(offloaded.output.find("so there is nothing to train"), std::string::npos) << offloaded.output;
  }
  EXPECT_EQ(run(with(kTiny, {"--steps", "3", "--quiet", "--checkpoint-dir", ck.string(), "--resume"}), dir).code, 0);
}

// Items 5 and 8: inputs that are not regular files never hang or crash a reader. --data as a fifo
// with the default --data-format auto (the format probe opened it before any check) and a fifo,
// a folder or a link to /dev/zero named like a flight record are refused by name, in bounded time.
TEST(HardeningThree, FifosFoldersAndDevicesAsInputsAreNamedNeverReadForever) {
  const fs::path dir = scratch("h3_inputs");
  ASSERT_EQ(::mkfifo((dir / "data.fifo").c_str(), 0600), 0);
  const auto start = std::chrono::steady_clock::now();
  const auto fifo_data = run(with(without(kQuick, "--vocab"), {"--data", (dir / "data.fifo").string()}), dir);
  EXPECT_EQ(fifo_data.code, 2) << fifo_data.output;
  EXPECT_NE(fifo_data.output.find("--data " + (dir / "data.fifo").string() + ": is a fifo; expected a regular file"),
            std::string::npos)
      << fifo_data.output;

  struct Case {
    const char* what;
    std::function<void(const fs::path&)> plant;
    const char* expect;
  };
  const Case cases[] = {
      {"a folder", [](const fs::path& p) { fs::create_directories(p); }, "is a folder; expected a regular file"},
      {"a fifo", [](const fs::path& p) { ASSERT_EQ(::mkfifo(p.c_str(), 0600), 0); }, "is a fifo; expected a regular file"},
      {"a link to /dev/zero", [](const fs::path& p) { fs::create_symlink("/dev/zero", p); },
       "is a character device; expected a regular file"},
  };
  int n = 0;
  for (const auto& c : cases) {
    const fs::path folder = dir / ("records" + std::to_string(n++));
    fs::create_directories(folder);
    c.plant(folder / "rank0-of2.json");
    const auto r = run({"--flight-report", folder.string()}, dir);
    EXPECT_GT(r.code, 0) << c.what << ": " << r.output;
    EXPECT_LT(r.code, 128) << c.what << ": " << r.output;
    EXPECT_NE(r.output.find(c.expect), std::string::npos) << c.what << ": " << r.output;
  }
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 60.0);
}

}  // namespace
