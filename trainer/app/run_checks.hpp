// coshard-train's checks before the first step: every path the user named, by role. Inputs are
// regular files; outputs are regular files or new paths in folders that take a file; no output
// aliases an input or another output or lies inside an output folder; the checkpoint folder of a
// fresh run holds no checkpoints unless the user asked to start over. All of it up front, so a
// bad path never costs a trained model.
#pragma once

#include <filesystem>
#include <string>
#include <utility>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::train_app {

struct NamedPath {
  std::string role;  // "--data", "--metrics", ...
  std::filesystem::path path;
};

struct RunPaths {
  std::vector<NamedPath> inputs;          // read
  std::vector<NamedPath> output_files;    // written (replaced, or appended to)
  std::vector<NamedPath> output_folders;  // written into (created if absent)
};

Result<void> check_run_paths(const RunPaths& paths);
// One input: it exists and is a regular file (links followed), else named with what it is.
Result<void> check_input_path(const NamedPath& input);

// A file's fingerprint for ranks to compare (every rank given the same --init): its size and the
// CRC-32 of its first 64 KiB and of 64 pieces of 4 KiB spread over the rest. Files of other weights
// differ in all of them; reading the whole file would cost every rank a model's size.
Result<std::string> file_fingerprint(const std::filesystem::path& path);

// The checkpoint folder of a run: `resume` needs one to resume from (checked by the load); a
// fresh run refuses a folder that holds checkpoints, unless `start_over`, which removes them
// (only the checkpoint folders and `latest`: nothing else in the folder). Leftovers of saves
// that did not finish go in either case. Removals happen only where `remove` (one process of
// many does them).
Result<void> prepare_checkpoint_folder(const std::filesystem::path& dir, bool resume, bool start_over, bool remove);

// What a checkpoint folder holds of coshard's: published checkpoints, leftovers of unfinished
// saves (*.partial, *.replaced) and `latest` files, in it and in its tensor ranks' folders
// (tensor-<t>-of-<N>, a tensor-parallel run's), and those folders.
struct CheckpointFolderContents {
  std::vector<std::filesystem::path> checkpoints, leftovers, latest, tensor_folders;
};
CheckpointFolderContents checkpoint_folder_contents(const std::filesystem::path& dir);

}  // namespace coshard::train_app
