// Token files for --data: llm.c's .bin with its header, or raw uint16/uint32 ids (data.hpp).
#include <cstring>
#include <fstream>
#include <limits>

#include "coshard/async/files.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/trainer/data.hpp"
#include "data_rng.hpp"

namespace coshard::trainer {
namespace {

constexpr std::int32_t kLlmcMagic = 20240520;
constexpr std::size_t kLlmcHeaderBytes = 256 * sizeof(std::int32_t);

std::int32_t read_i32(const std::byte* at) {
  std::int32_t v = 0;
  std::memcpy(&v, at, sizeof(v));  // little-endian files on little-endian hosts (x86-64, aarch64)
  return v;
}

bool has_llmc_header(const std::vector<std::byte>& bytes) {
  return bytes.size() >= kLlmcHeaderBytes && read_i32(bytes.data()) == kLlmcMagic;
}

}  // namespace

std::string_view to_string(TokenFormat format) noexcept {
  switch (format) {
    case TokenFormat::automatic: return "auto";
    case TokenFormat::bytes: return "bytes";
    case TokenFormat::u16: return "u16";
    case TokenFormat::u32: return "u32";
  }
  return "unknown-format";
}

Result<TokenFormat> parse_token_format(std::string_view text) {
  for (const TokenFormat f : {TokenFormat::automatic, TokenFormat::bytes, TokenFormat::u16, TokenFormat::u32}) {
    if (text == to_string(f)) return f;
  }
  return fail(ErrorCode::invalid_argument, "data format '", text, "': expected auto, bytes, u16 or u32");
}

Result<std::unique_ptr<TokenFile>> TokenFile::open(const std::filesystem::path& path, TokenFormat format,
                                                   std::int64_t vocab, std::uint64_t seed) {
  // A regular file no larger than this machine's memory (a device, a folder or a fifo is refused
  // by name, never read without end).
  COSHARD_TRY_ASSIGN(auto bytes, async::read_regular_file(path, async::host_memory_bytes(), "data file"));
  return from_bytes(std::move(bytes), path.string(), format, vocab, seed);
}

Result<std::unique_ptr<TokenFile>> TokenFile::from_bytes(std::vector<std::byte> bytes, std::string name,
                                                         TokenFormat format, std::int64_t vocab, std::uint64_t seed) {
  if (format == TokenFormat::bytes) {
    return fail(ErrorCode::invalid_argument, "data file ", name, ": bytes are read by ByteCorpus, not as token ids");
  }
  if (vocab < 1 || vocab > std::numeric_limits<std::int32_t>::max()) {
    return fail(ErrorCode::invalid_argument, "data file ", name, ": vocabulary ", vocab, ": expected 1 to 2^31 - 1");
  }
  auto f = std::unique_ptr<TokenFile>(new TokenFile());
  f->name_ = std::move(name);
  f->vocab_ = vocab;
  f->seed_ = seed;
  const std::string& n = f->name_;
  std::size_t payload = bytes.size();
  std::string read_as;
  if (has_llmc_header(bytes)) {
    const std::int32_t version = read_i32(bytes.data() + 4), count = read_i32(bytes.data() + 8);
    if (version != 1 && version != 2) {
      return fail(ErrorCode::invalid_argument, "data file ", n, ": llm.c header version ", version,
                  ": expected 1 (uint16 tokens) or 2 (uint32 tokens)");
    }
    f->header_ = true;
    f->width_ = version == 1 ? 2 : 4;
    if (format != TokenFormat::automatic && (format == TokenFormat::u16) != (f->width_ == 2)) {
      return fail(ErrorCode::invalid_argument, "data file ", n, ": --data-format ", to_string(format), " but its llm.c header (version ",
                  version, ") says ", f->width_ == 2 ? "uint16" : "uint32", " tokens");
    }
    f->offset_ = kLlmcHeaderBytes;
    payload = bytes.size() - kLlmcHeaderBytes;
    if (count < 0 || static_cast<std::size_t>(count) * f->width_ != payload) {
      return fail(ErrorCode::invalid_argument, "data file ", n, ": its llm.c header counts ", count, " tokens of ", f->width_,
                  " bytes, but ", payload, " bytes follow the header (a truncated or damaged file?)");
    }
  } else {
    f->width_ = format == TokenFormat::u32 ? 4 : 2;
    // Chosen by the name alone (--data-format auto): say so, in case the file is text.
    if (format == TokenFormat::automatic)
      read_as = " (read as raw uint16 token ids because the name ends in .bin and there is no llm.c header; "
                "if it is text, pass --data-format bytes)";
    if (payload % f->width_ != 0) {
      return fail(ErrorCode::invalid_argument, "data file ", n, ": ", payload, " bytes is not a whole number of ",
                  f->width_ == 2 ? "uint16" : "uint32", " token ids (no llm.c header: magic ", kLlmcMagic, " not found)",
                  read_as);
    }
  }
  f->count_ = static_cast<std::int64_t>(payload / f->width_);
  f->bytes_ = std::move(bytes);
  // Every id the model will embed, once.
  for (std::int64_t i = 0; i < f->count_; ++i) {
    const std::int64_t id = static_cast<std::uint32_t>(f->at(i));
    if (id >= vocab) {
      return fail(ErrorCode::invalid_argument, "data file ", n, ": token ", i, " is id ", id,
                  ", not below the model's vocabulary of ", vocab, " (--vocab)", read_as);
    }
  }
  return f;
}

std::int32_t TokenFile::at(std::int64_t i) const noexcept {
  const std::byte* p = bytes_.data() + offset_ + static_cast<std::size_t>(i) * width_;
  if (width_ == 2) {
    std::uint16_t v = 0;
    std::memcpy(&v, p, 2);
    return static_cast<std::int32_t>(v);
  }
  std::uint32_t v = 0;
  std::memcpy(&v, p, 4);
  return static_cast<std::int32_t>(v);  // below vocab < 2^31: checked at open
}

Result<void> TokenFile::check(std::int64_t seq) const {
  if (count_ < seq + 1) {
    return fail(ErrorCode::invalid_argument, "data file ", name_, ": ", count_, " tokens; a sequence length of ", seq,
                " needs at least ", seq + 1);
  }
  return {};
}

std::string TokenFile::describe() const {
  return name_ + " (" + std::to_string(count_) + " tokens, " + (width_ == 2 ? "uint16" : "uint32") +
         (header_ ? ", llm.c header" : ", raw") + ", vocab " + std::to_string(vocab_) + ")";
}

std::string TokenFile::identity() const {
  const std::span<const std::byte> tokens(bytes_.data() + offset_, bytes_.size() - offset_);
  return "tokens u" + std::to_string(width_ * 8) + " " + std::to_string(count_) + " crc32 " +
         std::to_string(async::crc32_of(tokens));
}

HostBatch TokenFile::batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const {
  return detail::window_batch(seed_, step, rows, seq, count_, [this](std::int64_t i) { return at(i); });
}

Result<TokenFormat> resolve_token_format(const std::filesystem::path& path, TokenFormat format) {
  if (format != TokenFormat::automatic) return format;
  // The probe opens the file itself: a fifo would block it, a device stream to it without end.
  COSHARD_TRY(async::check_input_file(path, "data"));
  std::ifstream in(path, std::ios::binary);
  std::int32_t magic = 0;
  if (in.read(reinterpret_cast<char*>(&magic), sizeof(magic)) && magic == kLlmcMagic) {
    std::int32_t version = 0;
    in.read(reinterpret_cast<char*>(&version), sizeof(version));
    return version == 2 ? TokenFormat::u32 : TokenFormat::u16;  // a bad version is named at open
  }
  return path.extension() == ".bin" ? TokenFormat::u16 : TokenFormat::bytes;
}

Result<std::unique_ptr<TokenSource>> open_data(const std::filesystem::path& path, TokenFormat format,
                                               std::int64_t vocab, std::int64_t seq, std::uint64_t seed) {
  if (format == TokenFormat::automatic) {
    COSHARD_TRY_ASSIGN(const TokenFormat resolved, resolve_token_format(path, format));
    // A file with llm.c's header is read as it says (its width from the header).
    if (resolved == TokenFormat::bytes) format = resolved;
  }
  if (format == TokenFormat::bytes) {
    COSHARD_TRY_ASSIGN(auto c, ByteCorpus::open(path, seed));
    COSHARD_TRY(c->check(seq));
    return std::unique_ptr<TokenSource>(std::move(c));
  }
  COSHARD_TRY_ASSIGN(auto f, TokenFile::open(path, format, vocab, seed));
  COSHARD_TRY(f->check(seq));
  return std::unique_ptr<TokenSource>(std::move(f));
}

}  // namespace coshard::trainer
