#include "coshard/trainer/data.hpp"

#include "coshard/async/files.hpp"
#include "coshard/async/memory.hpp"
#include "data_rng.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <fstream>
#include <numeric>

namespace coshard::trainer {

using detail::mix;
using detail::Rng;

HostBatch HostBatch::slice(std::int64_t begin, std::int64_t end) const {
  HostBatch out;
  out.rows = end - begin;
  out.seq = seq;
  const auto b = static_cast<std::ptrdiff_t>(begin * seq), e = static_cast<std::ptrdiff_t>(end * seq);
  out.tokens.assign(tokens.begin() + b, tokens.begin() + e);
  out.targets.assign(targets.begin() + b, targets.begin() + e);
  return out;
}

HostBatch HostBatch::rank_rows(int rank, int world) const {
  const std::int64_t per = rows / world;
  return slice(rank * per, (rank + 1) * per);
}

SyntheticTask::SyntheticTask(std::int64_t vocab, std::uint64_t seed, double noise)
    : vocab_(vocab), seed_(seed), noise_(noise), next_(static_cast<std::size_t>(vocab)) {
  std::iota(next_.begin(), next_.end(), 0);
  Rng rng(mix(seed, 0xfeed, 0));
  for (std::size_t i = next_.size(); i > 1; --i) std::swap(next_[i - 1], next_[rng.below(i)]);
}

std::string SyntheticTask::describe() const {
  return "synthetic (vocab " + std::to_string(vocab_) + ", next token = a fixed permutation of the current one, " +
         std::to_string(static_cast<int>(noise_ * 100)) + "% noise)";
}

std::string SyntheticTask::identity() const {
  return "synthetic vocab " + std::to_string(vocab_) + " noise " + std::to_string(noise_);
}

double SyntheticTask::floor_loss() const noexcept {
  // Cross-entropy of the mixture: p(next) = 1 - noise + noise / V, others noise / V.
  const double v = static_cast<double>(vocab_);
  const double p_hit = 1 - noise_ + noise_ / v, p_other = noise_ / v;
  return -(p_hit * std::log(p_hit) + (v - 1) * p_other * (p_other > 0 ? std::log(p_other) : 0));
}

HostBatch SyntheticTask::batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const {
  HostBatch b{rows, seq, {}, {}};
  b.tokens.resize(static_cast<std::size_t>(rows * seq));
  b.targets.resize(b.tokens.size());
  for (std::int64_t r = 0; r < rows; ++r) {
    Rng rng(mix(seed_, step, static_cast<std::uint64_t>(r)));
    auto cur = static_cast<std::int32_t>(rng.below(static_cast<std::uint64_t>(vocab_)));
    for (std::int64_t t = 0; t < seq; ++t) {
      const std::int32_t nxt = rng.unit() < noise_ ? static_cast<std::int32_t>(rng.below(static_cast<std::uint64_t>(vocab_)))
                                                   : next_[static_cast<std::size_t>(cur)];
      b.tokens[static_cast<std::size_t>(r * seq + t)] = cur;
      b.targets[static_cast<std::size_t>(r * seq + t)] = nxt;
      cur = nxt;
    }
  }
  return b;
}

Result<std::unique_ptr<ByteCorpus>> ByteCorpus::open(const std::filesystem::path& path, std::uint64_t seed) {
  // A regular file no larger than this machine's memory (a device like /dev/zero, a folder or a
  // fifo is refused by name, never read without end).
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, async::host_memory_bytes(), "data file"));
  auto c = std::unique_ptr<ByteCorpus>(new ByteCorpus());
  c->path_ = path;
  c->seed_ = seed;
  c->bytes_ = std::move(bytes);
  return c;
}

Result<void> ByteCorpus::check(std::int64_t seq) const {
  if (static_cast<std::int64_t>(bytes_.size()) < seq + 1)
    return fail(ErrorCode::invalid_argument, "data file ", path_.string(), ": ", bytes_.size(),
                " bytes; a sequence length of ", seq, " needs at least ", seq + 1);
  return {};
}

std::string ByteCorpus::identity() const {
  return "bytes " + std::to_string(bytes_.size()) + " crc32 " + std::to_string(async::crc32_of(bytes_));
}

std::string ByteCorpus::describe() const {
  return path_.string() + " (" + std::to_string(bytes_.size()) + " bytes, vocab 256)";
}

HostBatch ByteCorpus::batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const {
  return detail::window_batch(seed_, step, rows, seq, static_cast<std::int64_t>(bytes_.size()), [this](std::int64_t i) {
    return std::to_integer<std::int32_t>(bytes_[static_cast<std::size_t>(i)]);
  });
}

}  // namespace coshard::trainer
