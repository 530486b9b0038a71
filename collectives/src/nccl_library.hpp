// NCCL, linked at run time: libnccl.so.2 (220 MB) is opened with dlopen when the first NCCL
// communicator or unique id is made, so a run without one (every run on the CPU) never loads it,
// nor pays its start-up time, memory and constructors. Only nccl.h is used at build time. Where
// it looks, in order: COSHARD_NCCL_LIBRARY (libnccl.so.2, or the folder holding it), the loader's
// search path, then the folder where this build found NCCL.
#pragma once

#include <nccl.h>

#include <span>
#include <string>

#include "coshard/async/result.hpp"

namespace coshard::collectives::detail::nccl {

// Every NCCL function coshard calls.
struct Library {
  decltype(&ncclGetVersion) get_version = nullptr;
  decltype(&ncclGetErrorString) error_string = nullptr;
  decltype(&ncclGetLastError) last_error = nullptr;
  decltype(&ncclGetUniqueId) get_unique_id = nullptr;
  decltype(&ncclCommInitRank) comm_init_rank = nullptr;
  decltype(&ncclCommSplit) comm_split = nullptr;
  decltype(&ncclCommAbort) comm_abort = nullptr;
  decltype(&ncclCommDestroy) comm_destroy = nullptr;
  decltype(&ncclCommCount) comm_count = nullptr;
  decltype(&ncclCommUserRank) comm_user_rank = nullptr;
  decltype(&ncclCommGetAsyncError) comm_get_async_error = nullptr;
  decltype(&ncclGroupStart) group_start = nullptr;
  decltype(&ncclGroupEnd) group_end = nullptr;
  decltype(&ncclAllGather) all_gather = nullptr;
  decltype(&ncclReduceScatter) reduce_scatter = nullptr;
  decltype(&ncclAllReduce) all_reduce = nullptr;
  decltype(&ncclBroadcast) broadcast = nullptr;
  decltype(&ncclSend) send = nullptr;  // (all_to_all: a send and a receive to each peer in one group)
  decltype(&ncclRecv) recv = nullptr;

  std::string path;  // the file opened
  int version = 0;   // ncclGetVersion's: 22809 is 2.28.9

  // "NCCL 2.28.9 (/usr/local/cuda/lib64/libnccl.so.2)".
  std::string describe() const;
};

// The first of `candidates` (files, or names for the loader) that is NCCL 2.18 or later (the
// first with ncclCommSplit); else an error naming each and why it was not (not found, a function
// missing, its version). A library taken stays open for the life of the process.
Result<Library> open_library(std::span<const std::string> candidates);

// The library, opened once per process on first call (thread-safe); the error says where it
// looked and why each failed.
Result<const Library*> library();

// NCCL's version code as "2.28.9" (codes before 2.9 had one digit for the minor version).
std::string version_string(int version);

}  // namespace coshard::collectives::detail::nccl
