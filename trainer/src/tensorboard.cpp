// TensorBoard event files: the writer, the scalars of a step, and the reader (the rules are at
// the top of coshard/trainer/tensorboard.hpp). The messages are protobuf's, generated from
// trainer/proto/tensorboard_event.proto.
#include "coshard/trainer/tensorboard.hpp"

#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

#include "step_metrics.hpp"
#include "tensorboard_event.pb.h"

namespace coshard::trainer {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kFileVersion = "brain.Event:2";

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string host_name() {
  std::array<char, 256> host{};
  if (::gethostname(host.data(), host.size() - 1) != 0) return "localhost";
  std::string name(host.data());
  for (char& c : name)
    if (c == '/') c = '_';
  return name.empty() ? "localhost" : name;
}

struct FileCloser {
  void operator()(std::FILE* f) const noexcept { std::fclose(f); }
};

}  // namespace

std::vector<std::pair<std::string, double>> tensorboard_scalars(const StepStats& s) {
  std::vector<std::pair<std::string, double>> out;
  for (const auto& m : step_metrics()) {
    if (m.tag.empty()) continue;
    const auto value = m.value(s);
    if (value.is_null()) continue;  // absent: timing off, a step that does not evaluate
    out.emplace_back(std::string(m.tag), value.get<double>());
  }
  // (each MoE layer by its block's name, "h2", or its place among the MoE layers)
  auto layer = [&](std::size_t l) { return l < s.moe_layers.size() ? s.moe_layers[l] : "moe" + std::to_string(l); };
  for (std::size_t l = 0; l < s.experts_used.size(); ++l)
    out.emplace_back("moe/experts_used/" + layer(l), static_cast<double>(s.experts_used[l]));
  for (std::size_t l = 0; l < s.largest_expert_share.size(); ++l)
    out.emplace_back("moe/largest_expert_share/" + layer(l), s.largest_expert_share[l]);
  return out;
}

struct TensorBoardWriter::Impl {
  fs::path path;
  std::unique_ptr<std::FILE, FileCloser> file;

  Result<void> write(const tensorboard::Event& event) {
    std::string payload;
    if (!event.SerializeToString(&payload))
      return fail(ErrorCode::internal, "TensorBoard event for step ", event.step(), ": protobuf could not serialise it");
    const std::string record = tfrecord::frame(payload);
    if (std::fwrite(record.data(), 1, record.size(), file.get()) != record.size() || std::fflush(file.get()) != 0)
      return fail(ErrorCode::io, "TensorBoard file ", path.string(), ": write failed: ", std::strerror(errno));
    return {};
  }
};

TensorBoardWriter::TensorBoardWriter(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TensorBoardWriter::TensorBoardWriter(TensorBoardWriter&&) noexcept = default;
TensorBoardWriter& TensorBoardWriter::operator=(TensorBoardWriter&&) noexcept = default;
TensorBoardWriter::~TensorBoardWriter() = default;

const fs::path& TensorBoardWriter::file() const noexcept { return impl_->path; }

Result<TensorBoardWriter> TensorBoardWriter::create(const fs::path& dir) {
  if (dir.empty()) return fail(ErrorCode::invalid_argument, "TensorBoard folder: empty path");
  std::error_code ec;
  if (fs::exists(dir, ec) && !fs::is_directory(dir, ec))
    return fail(ErrorCode::invalid_argument, "TensorBoard folder ", dir.string(), ": exists and is not a folder");
  fs::create_directories(dir, ec);
  if (ec) return fail(ErrorCode::io, "TensorBoard folder ", dir.string(), ": cannot create it: ", ec.message());
  // TensorFlow's name; the pid and a counter keep two writers of one second and host apart.
  static std::atomic<int> counter{0};
  const auto seconds = static_cast<long long>(now_seconds());
  const std::string prefix = "events.out.tfevents." + std::to_string(seconds) + "." + host_name() + "." +
                             std::to_string(::getpid()) + ".";
  auto impl = std::make_unique<Impl>();
  for (int tries = 0; tries < 1000 && !impl->file; ++tries) {
    impl->path = dir / (prefix + std::to_string(counter.fetch_add(1)));
    impl->file.reset(std::fopen(impl->path.c_str(), "wbx"));  // x: never an existing file
    if (!impl->file && errno != EEXIST)
      return fail(ErrorCode::io, "TensorBoard file ", impl->path.string(), ": cannot create it: ", std::strerror(errno));
  }
  if (!impl->file) return fail(ErrorCode::io, "TensorBoard folder ", dir.string(), ": no free file name after ", prefix, "*");
  tensorboard::Event version;
  version.set_wall_time(now_seconds());
  version.set_file_version(std::string(kFileVersion));
  COSHARD_TRY(impl->write(version));
  return TensorBoardWriter(std::move(impl));
}

Result<void> TensorBoardWriter::add_scalars(std::int64_t step, std::span<const std::pair<std::string, double>> scalars) {
  tensorboard::Event event;
  event.set_wall_time(now_seconds());
  event.set_step(step);
  auto* summary = event.mutable_summary();
  for (const auto& [tag, value] : scalars) {
    auto* v = summary->add_value();
    v->set_tag(tag);
    v->set_simple_value(static_cast<float>(value));
  }
  return impl_->write(event);
}

Result<TensorBoardFile> read_tensorboard_file(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return fail(ErrorCode::io, "TensorBoard file ", path.string(), ": cannot open it");
  const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
  return parse_tensorboard_file(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())), path.string());
}

Result<TensorBoardFile> parse_tensorboard_file(std::span<const std::byte> bytes, std::string_view name) {
  COSHARD_TRY_ASSIGN(auto records, tfrecord::split(bytes, name));
  TensorBoardFile out;
  for (std::size_t i = 0; i < records.size(); ++i) {
    tensorboard::Event event;
    if (!event.ParseFromString(records[i]))
      return fail(ErrorCode::io, "TensorBoard file ", name, ": record ", i, " is not an Event");
    if (event.has_file_version()) {
      if (i == 0) out.file_version = event.file_version();
      continue;
    }
    if (!event.has_summary()) continue;  // graphs, sessions, ...: not scalars
    for (const auto& v : event.summary().value())
      if (v.has_simple_value()) out.scalars.push_back({event.step(), event.wall_time(), v.tag(), v.simple_value()});
  }
  if (out.file_version.empty())
    return fail(ErrorCode::io, "TensorBoard file ", name, ": its first event carries no file version");
  return out;
}

}  // namespace coshard::trainer
