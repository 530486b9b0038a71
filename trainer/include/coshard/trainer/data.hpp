// Token data for the trainer: the global batch of a step, in host memory.
//
// A step's global batch depends only on (seed, step), never on the world size: rank r of W takes
// rows [r * B / W, (r + 1) * B / W). So runs at different world sizes and stages see the same
// data and their losses compare, and a resumed run needs nothing but the step number.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
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

// How a --data file holds its tokens.
//   bytes  each byte is a token (vocabulary 256): text
//   u16    token ids as little-endian uint16, or llm.c's .bin with its header (version 1)
//   u32    token ids as little-endian uint32, or llm.c's .bin with its header (version 2)
//   automatic  llm.c's header where the file starts with it (its version gives the width); else
//              a name ending in .bin is raw uint16 (nanoGPT's train.bin); else bytes
enum class TokenFormat : std::uint8_t { automatic, bytes, u16, u32 };
std::string_view to_string(TokenFormat format) noexcept;
// "auto", "bytes", "u16" or "u32".
Result<TokenFormat> parse_token_format(std::string_view text);

// A file of token ids for a model of `vocab` tokens. llm.c's .bin starts with 256 int32: the
// magic 20240520, the version (1: uint16 tokens, 2: uint32) and the token count; raw files are
// the ids alone. Every id is checked below `vocab` once, at open (an id the model cannot embed is
// an error naming it and its position, never a wrong lookup); each row is a window at a position
// drawn from (seed, step, row), as for bytes.
class TokenFile final : public TokenSource {
 public:
  // `format`: u16, u32 or automatic (bytes is ByteCorpus's).
  static Result<std::unique_ptr<TokenFile>> open(const std::filesystem::path& path, TokenFormat format,
                                                 std::int64_t vocab, std::uint64_t seed);
  // The same from bytes already read; `name` goes into the messages.
  static Result<std::unique_ptr<TokenFile>> from_bytes(std::vector<std::byte> bytes, std::string name,
                                                       TokenFormat format, std::int64_t vocab, std::uint64_t seed);
  // The file must hold at least seq + 1 tokens.
  Result<void> check(std::int64_t seq) const;
  std::int64_t vocab() const noexcept override { return vocab_; }
  std::int64_t tokens() const noexcept { return count_; }
  std::string describe() const override;
  std::string identity() const override;  // width, count and CRC-32 of the tokens
  HostBatch batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const override;
  // Token i (0 <= i < tokens()), checked below the vocabulary at open.
  std::int32_t token(std::int64_t i) const noexcept { return at(i); }

 private:
  TokenFile() = default;
  std::int32_t at(std::int64_t i) const noexcept;
  std::string name_;
  std::vector<std::byte> bytes_;  // the whole file; the tokens start at offset_
  std::size_t offset_ = 0;
  std::size_t width_ = 2;
  bool header_ = false;
  std::int64_t count_ = 0;
  std::int64_t vocab_ = 0;
  std::uint64_t seed_ = 0;
};

// Token data in several files (llm.c's fineweb_train_000001.bin, ...): the files in the order
// given, read as one stream of tokens (a window may run from one file into the next), each file
// opened and checked as a TokenFile (header, size, every id below the vocabulary). Each row is a
// window at a position of the whole stream drawn from (seed, step, row), so a resumed run reads
// exactly the batches it would have, and the identity (every file's tokens, in order) refuses a
// resume over changed, missing or reordered files by name. The files are read into memory when
// opened: a file changed afterwards does not change this run.
class TokenShards final : public TokenSource {
 public:
  static Result<std::unique_ptr<TokenShards>> open(std::span<const std::filesystem::path> files, TokenFormat format,
                                                   std::int64_t vocab, std::uint64_t seed);
  Result<void> check(std::int64_t seq) const;
  std::int64_t vocab() const noexcept override { return vocab_; }
  std::int64_t tokens() const noexcept { return total_; }
  std::string describe() const override;
  std::string identity() const override;
  HostBatch batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const override;

 private:
  TokenShards() = default;
  std::int32_t at(std::int64_t i) const noexcept;
  std::vector<std::unique_ptr<TokenFile>> files_;
  std::vector<std::int64_t> starts_;  // each file's first token in the stream
  std::int64_t total_ = 0;
  std::int64_t vocab_ = 0;
  std::uint64_t seed_ = 0;
};

// --data's files: each spec a path, or a glob (*, ?, [...]) expanded in name order; a glob that
// matches nothing, or a file named twice, is an error naming it.
Result<std::vector<std::filesystem::path>> expand_data_paths(std::span<const std::string> specs);

// What `automatic` means for this file: u16 or u32 from llm.c's header, u16 for a name ending in
// .bin, else bytes (reads the first 8 bytes; any other format is returned as given).
Result<TokenFormat> resolve_token_format(const std::filesystem::path& path, TokenFormat format);

// The TokenSource a --data file is (TokenFormat above), checked for sequences of `seq`.
// `vocab` is the model's (token files only; bytes are 256).
Result<std::unique_ptr<TokenSource>> open_data(const std::filesystem::path& path, TokenFormat format,
                                               std::int64_t vocab, std::int64_t seq, std::uint64_t seed);
// Several files: one is open_data's; more are TokenShards (token ids only: text files are one).
Result<std::unique_ptr<TokenSource>> open_data(std::span<const std::filesystem::path> files, TokenFormat format,
                                               std::int64_t vocab, std::int64_t seq, std::uint64_t seed);

}  // namespace coshard::trainer
