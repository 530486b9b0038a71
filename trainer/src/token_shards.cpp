// Token data in several files, read as one stream (data.hpp: TokenShards), and --data's globs.
#include <glob.h>
#include <sys/stat.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "coshard/async/files.hpp"
#include "coshard/async/json_limits.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/trainer/data.hpp"
#include "data_rng.hpp"

namespace coshard::trainer {

Result<std::unique_ptr<TokenShards>> TokenShards::open(std::span<const std::filesystem::path> files, TokenFormat format,
                                                       std::int64_t vocab, std::uint64_t seed) {
  if (files.empty()) return fail(ErrorCode::invalid_argument, "data: no files");
  // Every file is read into memory: all of them must fit (each alone is bounded when read).
  std::uintmax_t total_bytes = 0;
  for (const auto& path : files) {
    std::error_code ec;
    const auto size = std::filesystem::file_size(path, ec);
    if (!ec) total_bytes += size;  // (a file that cannot be sized is named when opened)
  }
  if (const std::size_t room = async::host_memory_bytes(); total_bytes > room)
    return fail(ErrorCode::out_of_memory, "data: ", files.size(), " files of ", total_bytes,
                " bytes in all are read into memory, and this machine has ", room, " bytes");
  auto s = std::unique_ptr<TokenShards>(new TokenShards());
  s->vocab_ = vocab;
  s->seed_ = seed;
  for (const auto& path : files) {
    COSHARD_TRY_ASSIGN(const TokenFormat resolved, resolve_token_format(path, format));
    if (resolved == TokenFormat::bytes)
      return fail(ErrorCode::invalid_argument, "data file ", path.string(), " (file ", s->files_.size() + 1, " of ",
                  files.size(), ") would be read as text (bytes): several --data files are token ids (llm.c's .bin, "
                  "or raw ids with --data-format u16/u32); join text files into one");
    COSHARD_TRY_ASSIGN(auto f, TokenFile::open(path, format == TokenFormat::automatic ? resolved : format, vocab, seed));
    s->starts_.push_back(s->total_);
    s->total_ += f->tokens();
    s->files_.push_back(std::move(f));
  }
  return s;
}

Result<void> TokenShards::check(std::int64_t seq) const {
  if (total_ < seq + 1)
    return fail(ErrorCode::invalid_argument, "data: ", files_.size(), " files of ", total_,
                " tokens in all; a sequence length of ", seq, " needs at least ", seq + 1);
  return {};
}

std::string TokenShards::describe() const {
  return std::to_string(files_.size()) + " files read as one stream of " + std::to_string(total_) + " tokens (first " +
         files_.front()->describe() + ")";
}

std::string TokenShards::identity() const {
  std::string id = "shards " + std::to_string(files_.size());
  std::string each;
  for (const auto& f : files_) each += "; " + f->identity();
  // A checkpoint's run identity holds a field of at most 4096 characters (about 100 files listed):
  // a longer list is its CRC-32, with the first and last file named (a changed, missing or
  // reordered file still changes it).
  if (id.size() + each.size() <= 2048) return id + each;
  const auto crc = async::crc32_of(std::as_bytes(std::span<const char>(each.data(), each.size())));
  return id + ", every file's tokens in order crc32 " + std::to_string(crc) + "; first " + files_.front()->identity() +
         "; last " + files_.back()->identity();
}

std::int32_t TokenShards::at(std::int64_t i) const noexcept {
  // The last file starting at or before i.
  const auto it = std::upper_bound(starts_.begin(), starts_.end(), i);
  const auto k = static_cast<std::size_t>(it - starts_.begin()) - 1;
  return files_[k]->token(i - starts_[k]);
}

HostBatch TokenShards::batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const {
  return detail::window_batch(seed_, step, rows, seq, total_, [this](std::int64_t i) { return at(i); });
}

Result<std::vector<std::filesystem::path>> expand_data_paths(std::span<const std::string> specs) {
  std::vector<std::filesystem::path> out;
  // Files, not spellings: s.bin, ./s.bin and a link to it are one file (device and inode).
  std::map<std::pair<dev_t, ino_t>, std::string> seen;
  for (const auto& spec : specs) {
    if (spec.empty()) return fail(ErrorCode::invalid_argument, "data: an empty path (name a file or a glob)");
    std::vector<std::string> matched;
    if (spec.find_first_of("*?[") == std::string::npos) {
      matched.push_back(spec);
    } else {
      glob_t g{};
      const int rc = ::glob(spec.c_str(), GLOB_ERR, nullptr, &g);  // (sorted by name)
      if (rc == 0)
        for (std::size_t i = 0; i < g.gl_pathc; ++i) matched.emplace_back(g.gl_pathv[i]);
      ::globfree(&g);
      if (rc == GLOB_NOMATCH || matched.empty())
        return fail(ErrorCode::invalid_argument, "data: '", async::bounded_echo(spec, 4096), "' matches no file");
      if (rc != 0)
        return fail(ErrorCode::io, "data: '", async::bounded_echo(spec, 4096), "': a folder on its way could not be read");
    }
    for (auto& m : matched) {
      struct stat st {};
      if (::stat(m.c_str(), &st) == 0) {  // (a path that is not there is named by the open, later)
        const auto [it, first] = seen.try_emplace({st.st_dev, st.st_ino}, m);
        if (!first)
          return fail(ErrorCode::invalid_argument, "data: ", async::bounded_echo(m, 1024),
                      it->second == m ? " is named twice" : " is the same file as " + async::bounded_echo(it->second, 1024),
                      " (its tokens would be read twice)");
      }
      out.emplace_back(std::move(m));
    }
  }
  if (out.empty()) return fail(ErrorCode::invalid_argument, "data: no files");
  return out;
}

Result<std::unique_ptr<TokenSource>> open_data(std::span<const std::filesystem::path> files, TokenFormat format,
                                               std::int64_t vocab, std::int64_t seq, std::uint64_t seed) {
  if (files.size() == 1) return open_data(files.front(), format, vocab, seq, seed);
  COSHARD_TRY_ASSIGN(auto shards, TokenShards::open(files, format, vocab, seed));
  COSHARD_TRY(shards->check(seq));
  return std::unique_ptr<TokenSource>(std::move(shards));
}

}  // namespace coshard::trainer
