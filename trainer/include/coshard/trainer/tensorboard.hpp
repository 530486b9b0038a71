// TensorBoard event files: what `tensorboard --logdir DIR` shows as curves.
//
// A file is a sequence of records (TensorFlow's TFRecord framing: the payload's length as a
// little-endian u64, the masked CRC-32C of those 8 bytes, the payload, the masked CRC-32C of the
// payload), each payload one serialised Event (protobuf). The first event carries the file
// version ("brain.Event:2"); each step after is one event whose summary holds its scalars.
//
// A writer makes a new file in its folder (creating the folder), named as TensorFlow does,
// events.out.tfevents.<seconds>.<host>.<pid>.<n>: it never opens an existing file, so a resumed
// run adds a file beside the last one's and TensorBoard shows both. Rank 0 writes; a write that
// fails (a full disk) is an error naming the file.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "coshard/async/result.hpp"
#include "coshard/trainer/trainer.hpp"

namespace coshard::trainer {

namespace tfrecord {
// CRC-32C (Castagnoli), and TensorFlow's mask of it: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
std::uint32_t crc32c(std::span<const std::byte> data) noexcept;
std::uint32_t masked_crc32c(std::span<const std::byte> data) noexcept;
// One record: header, payload, footer.
std::string frame(std::string_view payload);
// The payloads of a file's records, every CRC checked; the error names `name`, the record and
// its offset (a truncated last record, from a run that was killed, is an error too).
Result<std::vector<std::string>> split(std::span<const std::byte> file, std::string_view name);
}  // namespace tfrecord

// The scalars a step writes, tag and value: train/loss, train/lr, train/grad_norm,
// train/loss_scale, perf/tokens_per_s, perf/step_ms, perf/exposed_comm_ms (when timed),
// perf/blocking_waits, zero/prefetch_hit_rate, comm/gathered_bytes, comm/reduce_scattered_bytes,
// offload/swap_bytes, memory/peak_bytes, memory/peak_gathered_bytes.
std::vector<std::pair<std::string, double>> tensorboard_scalars(const StepStats& stats);

class TensorBoardWriter {
 public:
  // A new event file in `dir` (created with its parents when missing; refused when it is a file
  // or cannot be written), with its version record written.
  static Result<TensorBoardWriter> create(const std::filesystem::path& dir);
  TensorBoardWriter(TensorBoardWriter&&) noexcept;
  TensorBoardWriter& operator=(TensorBoardWriter&&) noexcept;
  ~TensorBoardWriter();

  // One event at `step` with these scalars, written through to the file (TensorBoard sees it at
  // its next poll). Non-finite values are written as they are (TensorBoard shows them).
  Result<void> add_scalars(std::int64_t step, std::span<const std::pair<std::string, double>> scalars);
  Result<void> add_step(const StepStats& stats) { return add_scalars(stats.step, tensorboard_scalars(stats)); }
  const std::filesystem::path& file() const noexcept;

 private:
  struct Impl;
  explicit TensorBoardWriter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

// Every scalar of an event file, in file order (tests, tools).
struct TensorBoardScalar {
  std::int64_t step = 0;
  double wall_time = 0;
  std::string tag;
  float value = 0;
};
struct TensorBoardFile {
  std::string file_version;  // from the first event
  std::vector<TensorBoardScalar> scalars;
};
Result<TensorBoardFile> read_tensorboard_file(const std::filesystem::path& file);
// The same from a file's bytes; `name` goes into the errors.
Result<TensorBoardFile> parse_tensorboard_file(std::span<const std::byte> bytes, std::string_view name);

}  // namespace coshard::trainer
