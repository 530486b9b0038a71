// TensorBoard event files: CRC-32C against its published check values, the record framing and
// the Event bytes against TensorFlow's definitions decoded by hand (not through the same
// generated code), a Trainer writing every scalar of every step from the builder, a DeepSpeed
// "tensorboard" section, and files that are not what they should be refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>

#include "coshard/modules/gpt.hpp"
#include "coshard/trainer/tensorboard.hpp"
#include "../support/on_ranks.hpp"

namespace coshard::trainer {
namespace {

namespace fs = std::filesystem;

fs::path scratch(const std::string& name) {
  const fs::path p = fs::current_path() / "tensorboard_test_scratch" / name;
  fs::remove_all(p);
  fs::create_directories(p);
  return p;
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

std::span<const std::byte> bytes_of(std::string_view s) { return std::as_bytes(std::span<const char>(s.data(), s.size())); }

std::vector<fs::path> event_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().starts_with("events.out.tfevents.")) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  return files;
}

// A protobuf varint at `at`, advancing it.
std::uint64_t varint(std::string_view s, std::size_t& at) {
  std::uint64_t v = 0;
  for (int shift = 0; at < s.size(); shift += 7) {
    const auto b = static_cast<std::uint8_t>(s[at++]);
    v |= static_cast<std::uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) break;
  }
  return v;
}

TEST(TfRecord, Crc32cMatchesItsCheckValues) {
  // The CRC catalogue's check value for CRC-32C, and RFC 3720's 32 zero bytes and 32 0xFF bytes.
  EXPECT_EQ(tfrecord::crc32c(bytes_of("123456789")), 0xE3069283u);
  const std::string zeros(32, '\0'), ones(32, '\xff');
  EXPECT_EQ(tfrecord::crc32c(bytes_of(zeros)), 0x8A9136AAu);
  EXPECT_EQ(tfrecord::crc32c(bytes_of(ones)), 0x62A8AB43u);
  const std::uint32_t c = 0xE3069283u;
  EXPECT_EQ(tfrecord::masked_crc32c(bytes_of("123456789")), ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST(TfRecord, FramesAndSplitsAndRefusesDamage) {
  const std::string a = tfrecord::frame("hello"), b = tfrecord::frame("");
  ASSERT_EQ(a.size(), 5u + 16u);
  EXPECT_EQ(a.substr(0, 8), std::string("\x05\0\0\0\0\0\0\0", 8));  // little-endian length
  EXPECT_EQ(a.substr(12, 5), "hello");
  const std::string file = a + b;
  auto records = tfrecord::split(bytes_of(file), "f");
  ASSERT_TRUE(records) << records.error().message();
  ASSERT_EQ(records->size(), 2u);
  EXPECT_EQ((*records)[0], "hello");
  EXPECT_EQ((*records)[1], "");

  std::string bad_payload = file;
  bad_payload[13] ^= 1;
  auto r1 = tfrecord::split(bytes_of(bad_payload), "events.x");
  ASSERT_FALSE(r1);
  EXPECT_NE(r1.error().message().find("events.x: record 0 at offset 0: the payload's CRC-32C does not match"),
            std::string::npos)
      << r1.error().message();
  std::string bad_length = file;
  bad_length[a.size()] = 9;
  auto r2 = tfrecord::split(bytes_of(bad_length), "events.x");
  ASSERT_FALSE(r2);
  EXPECT_NE(r2.error().message().find("record 1 at offset 21: the length's CRC-32C"), std::string::npos)
      << r2.error().message();
  auto r3 = tfrecord::split(bytes_of(std::string_view(file).substr(0, file.size() - 2)), "events.x");
  ASSERT_FALSE(r3);
  EXPECT_NE(r3.error().message().find("a truncated file"), std::string::npos) << r3.error().message();
}

// The bytes TensorFlow's definitions give, decoded by hand: Event.wall_time = 1 (double),
// step = 2 (varint), file_version = 3, summary = 5; Summary.value = 1; Value.tag = 1,
// simple_value = 2 (float).
TEST(TensorBoard, EventBytesAreTensorFlowsDefinitions) {
  const fs::path dir = scratch("bytes");
  auto writer = TensorBoardWriter::create(dir);
  ASSERT_TRUE(writer) << writer.error().message();
  const std::vector<std::pair<std::string, double>> scalars{{"train/loss", 2.5}, {"train/lr", 0.125}};
  ASSERT_TRUE(writer->add_scalars(42, scalars));
  const auto files = event_files(dir);
  ASSERT_EQ(files.size(), 1u);
  EXPECT_EQ(files[0], writer->file());
  const std::string raw = slurp(files[0]);
  auto records = tfrecord::split(bytes_of(raw), files[0].string());
  ASSERT_TRUE(records) << records.error().message();
  ASSERT_EQ(records->size(), 2u);

  const std::string& version = (*records)[0];
  ASSERT_EQ(version.size(), 9u + 2u + 13u);
  EXPECT_EQ(static_cast<std::uint8_t>(version[0]), 0x09);  // field 1, 64-bit
  EXPECT_EQ(static_cast<std::uint8_t>(version[9]), 0x1a);  // field 3, length-delimited
  EXPECT_EQ(version[10], 13);
  EXPECT_EQ(version.substr(11), "brain.Event:2");

  const std::string& event = (*records)[1];
  std::size_t at = 9;
  ASSERT_EQ(static_cast<std::uint8_t>(event[0]), 0x09);
  ASSERT_EQ(static_cast<std::uint8_t>(event[at++]), 0x10);  // field 2, varint
  EXPECT_EQ(varint(event, at), 42u);
  ASSERT_EQ(static_cast<std::uint8_t>(event[at++]), 0x2a);  // field 5, length-delimited
  const std::size_t summary_end = varint(event, at) + at;
  EXPECT_EQ(summary_end, event.size());
  std::map<std::string, float> found;
  while (at < summary_end) {
    ASSERT_EQ(static_cast<std::uint8_t>(event[at++]), 0x0a);  // Summary.value
    const std::size_t value_end = varint(event, at) + at;
    std::string tag;
    float value = -1;
    while (at < value_end) {
      const auto key = static_cast<std::uint8_t>(event[at++]);
      if (key == 0x0a) {  // tag
        const std::size_t n = varint(event, at);
        tag = event.substr(at, n);
        at += n;
      } else {
        ASSERT_EQ(key, 0x15);  // simple_value, 32-bit
        std::memcpy(&value, event.data() + at, 4);
        at += 4;
      }
    }
    found[tag] = value;
  }
  EXPECT_EQ(found, (std::map<std::string, float>{{"train/loss", 2.5f}, {"train/lr", 0.125f}}));

  // The reader gives the same back, and a second writer in the folder makes a file of its own.
  auto read = read_tensorboard_file(files[0]);
  ASSERT_TRUE(read) << read.error().message();
  EXPECT_EQ(read->file_version, "brain.Event:2");
  ASSERT_EQ(read->scalars.size(), 2u);
  EXPECT_EQ(read->scalars[1].tag, "train/lr");
  EXPECT_EQ(read->scalars[1].step, 42);
  EXPECT_GT(read->scalars[1].wall_time, 1.7e9);
  auto second = TensorBoardWriter::create(dir);
  ASSERT_TRUE(second);
  EXPECT_EQ(event_files(dir).size(), 2u);
  EXPECT_EQ(slurp(files[0]), raw);
}

TEST(TensorBoard, RefusesWhatIsNotAFolderOrAnEventFile) {
  const fs::path dir = scratch("refused");
  std::ofstream(dir / "plain.txt") << "not a folder";
  auto file = TensorBoardWriter::create(dir / "plain.txt");
  ASSERT_FALSE(file);
  EXPECT_NE(file.error().message().find("plain.txt: exists and is not a folder"), std::string::npos)
      << file.error().message();
  auto missing = read_tensorboard_file(dir / "absent");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.error().message().find("absent: cannot open it"), std::string::npos);
  std::ofstream(dir / "events.out.tfevents.1.x", std::ios::binary) << tfrecord::frame("\x12\x03" "abc");
  auto no_version = read_tensorboard_file(dir / "events.out.tfevents.1.x");
  ASSERT_FALSE(no_version);
  EXPECT_NE(no_version.error().message().find("no file version"), std::string::npos) << no_version.error().message();
}

// Every scalar of every step, from the builder, on rank 0 only; values as the steps returned them.
TEST(TensorBoard, TheTrainerWritesEveryScalarOfEveryStep) {
  const fs::path dir = scratch("trainer") / "run";
  constexpr int kSteps = 4;
  std::vector<StepStats> steps;
  std::mutex mutex;
  const auto errors = ::coshard::testing::on_ranks(2, [&](int rank, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt({.vocab = 32, .max_seq = 8, .dim = 16, .layers = 1, .heads = 2}));
    TrainerBuilder builder;
    builder.communicator(comm).zero_stage(3).adamw(1e-2f).tensorboard(dir);
    COSHARD_CO_TRY_ASSIGN(Trainer t, co_await builder.build(*model));
    const SyntheticTask task(32, 3);
    for (int i = 0; i < kSteps; ++i) {
      const auto global = task.batch(static_cast<std::uint64_t>(i), 4, 8);
      COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(global.rank_rows(rank, comm.size())));
      if (rank == 0) {
        std::lock_guard lock(mutex);
        steps.push_back(std::move(stats));
      }
    }
    co_return Result<void>{};
  });
  ASSERT_TRUE(errors.empty()) << errors.front();
  const auto files = event_files(dir);
  ASSERT_EQ(files.size(), 1u) << "rank 0 alone writes";
  auto read = read_tensorboard_file(files[0]);
  ASSERT_TRUE(read) << read.error().message();
  ASSERT_EQ(steps.size(), static_cast<std::size_t>(kSteps));
  for (const StepStats& s : steps) {
    const auto expected = tensorboard_scalars(s);
    for (const char* tag : {"train/loss", "train/lr", "train/grad_norm", "perf/tokens_per_s", "perf/step_ms",
                            "perf/exposed_comm_ms", "zero/prefetch_hit_rate", "offload/swap_bytes", "memory/peak_bytes",
                            "memory/peak_activation_bytes"})
      EXPECT_TRUE(std::any_of(expected.begin(), expected.end(), [&](const auto& e) { return e.first == tag; }))
          << tag;
    for (const auto& [tag, value] : expected) {
      const auto it = std::find_if(read->scalars.begin(), read->scalars.end(),
                                   [&](const TensorBoardScalar& x) { return x.step == s.step && x.tag == tag; });
      ASSERT_NE(it, read->scalars.end()) << "step " << s.step << " " << tag;
      EXPECT_EQ(it->value, static_cast<float>(value)) << "step " << s.step << " " << tag;
    }
  }
  EXPECT_EQ(read->scalars.size(), steps.size() * tensorboard_scalars(steps[0]).size());
  EXPECT_GT(steps.back().peak_memory_bytes, 0u);
}

TEST(TensorBoard, DeepSpeedsSectionNamesTheFolder) {
  std::vector<std::string> notes;
  auto c = TrainerConfig::from_json(
      R"({"tensorboard": {"enabled": true, "output_path": "runs", "job_name": "gpt"}, "zero_optimization": {"stage": 2}})",
      TrainerConfig{}, &notes);
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->tensorboard_dir, fs::path("runs") / "gpt");
  auto off = TrainerConfig::from_json(R"({"tensorboard": {"enabled": false, "output_path": "runs"}})", TrainerConfig{}, &notes);
  ASSERT_TRUE(off);
  EXPECT_TRUE(off->tensorboard_dir.empty());
  auto no_path = TrainerConfig::from_json(R"({"tensorboard": {"enabled": true}})", TrainerConfig{}, &notes);
  ASSERT_FALSE(no_path);
  EXPECT_NE(no_path.error().message().find("tensorboard.output_path: required"), std::string::npos)
      << no_path.error().message();
  auto slash = TrainerConfig::from_json(R"({"tensorboard": {"enabled": true, "output_path": "runs", "job_name": "../x"}})",
                                       TrainerConfig{}, &notes);
  ASSERT_FALSE(slash);
  EXPECT_NE(slash.error().message().find("tensorboard.job_name=\"../x\" (expected a folder name, without '/')"),
            std::string::npos)
      << slash.error().message();
  auto odd = TrainerConfig::from_json(R"({"tensorboard": {"enabled": "yes", "flush_secs": 5}})", TrainerConfig{}, &notes);
  ASSERT_FALSE(odd);
  EXPECT_NE(odd.error().message().find("tensorboard.enabled=\"yes\" (expected true or false)"), std::string::npos)
      << odd.error().message();
  EXPECT_NE(odd.error().message().find("tensorboard.flush_secs"), std::string::npos) << odd.error().message();
}

}  // namespace
}  // namespace coshard::trainer
