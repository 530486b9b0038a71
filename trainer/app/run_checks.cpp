#include "run_checks.hpp"

#include <algorithm>
#include <fstream>
#include <span>
#include <system_error>
#include <vector>

#include "coshard/async/files.hpp"
#include "coshard/async/json_limits.hpp"
#include "coshard/zero/checkpoint.hpp"

namespace coshard::train_app {

namespace fs = std::filesystem;

namespace {

void add_contents(const fs::path& dir, CheckpointFolderContents& out, bool top) {
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return;
  for (const auto& entry : fs::directory_iterator(dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name == "latest") {
      out.latest.push_back(entry.path());
    } else if (zero::is_checkpoint_folder_name(name)) {
      out.checkpoints.push_back(entry.path());
    } else if (top && zero::tensor_folder_size(name) > 0 && entry.is_directory(ec)) {
      out.tensor_folders.push_back(entry.path());
      add_contents(entry.path(), out, false);
    } else {
      for (const char* suffix : {".partial", ".replaced"}) {
        if (name.ends_with(suffix) && zero::is_checkpoint_folder_name(name.substr(0, name.size() - std::string_view(suffix).size())))
          out.leftovers.push_back(entry.path());
      }
    }
  }
}

}  // namespace

CheckpointFolderContents checkpoint_folder_contents(const fs::path& dir) {
  CheckpointFolderContents out;
  add_contents(dir, out, true);
  // Oldest first by step, wherever each is.
  std::sort(out.checkpoints.begin(), out.checkpoints.end(),
            [](const fs::path& a, const fs::path& b) { return std::pair(a.filename(), a) < std::pair(b.filename(), b); });
  return out;
}

Result<void> check_input_path(const NamedPath& in) {
  std::error_code ec;
  const auto st = fs::status(in.path, ec);
  if (ec || !fs::exists(st)) return fail(ErrorCode::io, in.role, " ", in.path.string(), ": no such file");
  return async::check_input_file(in.path, in.role);  // "is a fifo; expected a regular file", ...
}

// A path the system cannot take (PATH_MAX, NAME_MAX): refused with its text cut, never echoed
// whole (a 10 MB --tensorboard path was echoed in full by each message that named it).
Result<void> check_path_length(const NamedPath& p) {
  const std::string text = p.path.string();
  constexpr std::size_t kPathMax = 4096, kNameMax = 255;
  if (text.size() >= kPathMax)
    return fail(ErrorCode::invalid_argument, p.role, " ", async::bounded_echo(text, 256), ": a path of ", text.size(),
                " characters (expected fewer than ", kPathMax, ", the system's PATH_MAX)");
  for (const auto& part : p.path)
    if (part.string().size() > kNameMax)
      return fail(ErrorCode::invalid_argument, p.role, " ", async::bounded_echo(text, 256), ": a name of ",
                  part.string().size(), " characters in it (expected at most ", kNameMax, ", the system's NAME_MAX)");
  return {};
}

Result<void> check_run_paths(const RunPaths& paths) {
  for (const auto* group : {&paths.inputs, &paths.output_files, &paths.output_folders})
    for (const auto& p : *group) COSHARD_TRY(check_path_length(p));
  for (const auto& in : paths.inputs) COSHARD_TRY(check_input_path(in));
  // Aliases: an output over an input, two outputs on one path, an output file inside an output
  // folder (where coshard writes files of its own), or two output folders nested.
  for (const auto& out : paths.output_files) {
    for (const auto& in : paths.inputs)
      if (async::same_path(out.path, in.path))
        return fail(ErrorCode::invalid_argument, out.role, " ", out.path.string(), " is the same file as ", in.role,
                    " ", in.path.string(), ": an output may not overwrite an input");
    for (const auto& other : paths.output_files)
      if (&other < &out && async::same_path(out.path, other.path))
        return fail(ErrorCode::invalid_argument, out.role, " and ", other.role, " name the same file ",
                    out.path.string());
    for (const auto& folder : paths.output_folders)
      if (async::path_within(out.path, folder.path))
        return fail(ErrorCode::invalid_argument, out.role, " ", out.path.string(), " lies inside ", folder.role, " ",
                    folder.path.string(), ", where coshard writes files of its own");
  }
  for (const auto& folder : paths.output_folders) {
    for (const auto& other : paths.output_folders)
      if (&other != &folder && async::path_within(folder.path, other.path))
        return fail(ErrorCode::invalid_argument, folder.role, " ", folder.path.string(),
                    (async::same_path(folder.path, other.path) ? " is the same folder as " : " lies inside "),
                    other.role, " ", other.path.string());
    for (const auto& in : paths.inputs)
      if (async::path_within(in.path, folder.path) && folder.role != "--checkpoint-dir")
        return fail(ErrorCode::invalid_argument, in.role, " ", in.path.string(), " lies inside ", folder.role, " ",
                    folder.path.string(), ", where coshard writes files of its own");
  }
  // Then what each path is (folders first: an output folder is created here).
  for (const auto& out : paths.output_folders) COSHARD_TRY(async::check_output_folder(out.path, out.role));
  for (const auto& out : paths.output_files) COSHARD_TRY(async::check_output_file(out.path, out.role));
  return {};
}

Result<void> prepare_checkpoint_folder(const fs::path& dir, bool resume, bool start_over, bool remove) {
  auto held = checkpoint_folder_contents(dir);
  if (remove) {
    // Leftovers of saves that did not finish (a crash, a full disk): a *.partial never was a
    // checkpoint and goes; a *.replaced is an older copy moved aside while the same step was
    // published again: it goes if that step's folder is there, else it is that folder.
    for (const auto& p : held.leftovers) {
      std::error_code ec;
      const std::string name = p.filename().string();
      if (name.ends_with(".replaced")) {
        const fs::path original = p.parent_path() / name.substr(0, name.size() - std::string_view(".replaced").size());
        if (!fs::exists(original, ec)) {
          fs::rename(p, original, ec);
          if (!ec) continue;
        }
      }
      fs::remove_all(p, ec);
      if (ec) return fail(ErrorCode::io, "--checkpoint-dir: removing the leftover ", p.string(), ": ", ec.message());
    }
    held = checkpoint_folder_contents(dir);
  }
  if (resume) return {};
  if (held.checkpoints.empty() && held.latest.empty()) return {};
  if (!start_over) {
    const std::string newest = held.checkpoints.empty() ? held.latest.front().lexically_relative(dir).string()
                                                        : held.checkpoints.back().lexically_relative(dir).string();
    return fail(ErrorCode::invalid_argument, "--checkpoint-dir ", dir.string(), " holds ", held.checkpoints.size(),
                " checkpoint(s) (newest ", newest,
                "): --resume continues it; --start-over removes them and starts afresh");
  }
  if (!remove) return {};
  std::error_code ec;
  for (const auto& p : held.latest) {
    fs::remove(p, ec);
    if (ec) return fail(ErrorCode::io, "--start-over: removing ", p.string(), ": ", ec.message());
  }
  for (const auto& p : held.checkpoints) {
    fs::remove_all(p, ec);
    if (ec) return fail(ErrorCode::io, "--start-over: removing ", p.string(), ": ", ec.message());
  }
  // A tensor rank's folder goes once empty (anything else of the user's there keeps it).
  for (const auto& p : held.tensor_folders) fs::remove(p, ec);
  return {};
}

Result<std::string> file_fingerprint(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::error_code ec;
  const auto size = std::filesystem::file_size(path, ec);
  if (!in || ec) return fail(ErrorCode::io, "cannot read ", path.string(), ec ? ": " + ec.message() : std::string());
  constexpr std::uint64_t kHead = 64 << 10, kPiece = 4 << 10, kPieces = 64;
  std::vector<char> bytes;
  auto take = [&](std::uint64_t at, std::uint64_t n) {
    n = std::min(n, size > at ? size - at : 0);
    const auto before = bytes.size();
    bytes.resize(before + n);
    in.seekg(static_cast<std::streamoff>(at));
    in.read(bytes.data() + before, static_cast<std::streamsize>(n));
    bytes.resize(before + static_cast<std::size_t>(in.gcount()));
    in.clear();
  };
  take(0, kHead);
  if (size > kHead)
    for (std::uint64_t k = 0; k < kPieces; ++k) take(kHead + (size - kHead) / kPieces * k, kPiece);
  const auto crc = async::crc32_of(std::as_bytes(std::span<const char>(bytes.data(), bytes.size())));
  return std::to_string(size) + " bytes, sampled crc32 " + std::to_string(crc);
}

}  // namespace coshard::train_app
