// offload_optimizer=nvme: how the rank's swap files are laid out. Each unit's master and state
// is one file of the rank's claimed folder (locked against a second run: claimed first, let go
// last), streamed by the swapper through pinned buffers. A unit's file holds its master, then each
// state tensor, each from a page boundary; a sub-group (a SwapPiece: sub_group_size elements at
// most) is one piece of each, read and written as one. The NVMe placement fills it in its setup
// (optimizer_on_nvme.cpp); the pass beside backward (swap_pass.hpp) and the shards on NVMe
// (shards_on_nvme.cpp) read it. Private: not installed.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "coshard/offload/nvme_store.hpp"
#include "coshard/offload/swap_folder.hpp"
#include "coshard/offload/swapper.hpp"

namespace coshard::zero::detail {

// One sub-group of the swap files: elements [begin, begin + count) of unit `unit`'s shard.
struct SwapPiece {
  std::size_t unit = 0;
  std::int64_t begin = 0, count = 0;
};

struct SwapFiles {
  offload::SwapFolder folder;
  std::shared_ptr<offload::NvmeStore> store;
  std::unique_ptr<offload::Swapper> swapper;
  std::vector<offload::SubGroup> subgroups;
  std::vector<SwapPiece> pieces;          // what each sub-group is
  std::vector<std::size_t> first_piece;   // unit k's sub-groups: [first_piece[k], first_piece[k + 1])
  std::vector<std::string> files;         // unit k's file
  // The sub-groups a step reads, steps and writes back (frozen units' never are), and their
  // descriptions for its pass (grads_to_nvme: each with its gradient piece, read only).
  std::vector<std::size_t> stepped_pieces;
  std::vector<offload::SubGroup> stepped_subgroups;
  // grads_to_nvme: per sub-group, the piece of its unit's gradient region the writing pass fills.
  std::vector<offload::SubGroup> grad_subgroups;
};

}  // namespace coshard::zero::detail
