// Token data for the trainer: the global batch of a step, in host memory.
//
// A step's global batch depends only on (seed, step), never on the world size: rank r of W takes
// rows [r * B / W, (r + 1) * B / W). So runs at different world sizes and stages see the same
// data and their losses compare, and a resumed run needs nothing but the step number.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::trainer {

// Rows of token ids and their next-token targets, row-major [rows, seq].
struct HostBatch {
  std::int64_t rows = 0;
  std::int64_t seq = 0;
  std::vector<std::int32_t> tokens;
  std::vector<std::int32_t> targets;

  // Rows [begin, end) (end <= rows).
  HostBatch slice(std::int64_t begin, std::int64_t end) const;
  // This rank's rows of a global batch whose rows divide evenly by `world`.
  HostBatch rank_rows(int rank, int world) const;
};

class TokenSource {
 public:
  virtual ~TokenSource() = default;
  virtual std::int64_t vocab() const noexcept = 0;
  virtual std::string describe() const = 0;
  // What the data is, independent of where it lies: recorded in checkpoints and compared on resume.
  virtual std::string identity() const = 0;
  // The global batch of `step`: `rows` windows of `seq` tokens and their targets.
  virtual HostBatch batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const = 0;
};

// A task with structure to learn and a known floor: each row starts at a random token and each
// next token follows a fixed random permutation of the vocabulary with probability 1 - noise,
// or is uniform otherwise. A model that learns the permutation reaches a loss near the entropy
// of that mixture (`floor_loss`), far below ln(vocab).
class SyntheticTask final : public TokenSource {
 public:
  SyntheticTask(std::int64_t vocab, std::uint64_t seed, double noise = 0.1);
  std::int64_t vocab() const noexcept override { return vocab_; }
  std::string describe() const override;
  std::string identity() const override;
  HostBatch batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const override;
  double floor_loss() const noexcept;

 private:
  std::int64_t vocab_;
  std::uint64_t seed_;
  double noise_;
  std::vector<std::int32_t> next_;
};

// A file read as bytes (vocabulary 256); each row is a window at a position drawn from
// (seed, step, row).
class ByteCorpus final : public TokenSource {
 public:
  // The file must hold at least seq + 1 bytes for the sequence length used (checked per batch
  // by `check`).
  static Result<std::unique_ptr<ByteCorpus>> open(const std::filesystem::path& path, std::uint64_t seed);
  Result<void> check(std::int64_t seq) const;
  std::int64_t vocab() const noexcept override { return 256; }
  std::string describe() const override;
  std::string identity() const override;  // size and CRC-32 of the bytes (a moved file is the same data)
  HostBatch batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const override;

 private:
  ByteCorpus() = default;
  std::filesystem::path path_;
  std::vector<std::byte> bytes_;
  std::uint64_t seed_ = 0;
};

}  // namespace coshard::trainer
