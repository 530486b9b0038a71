#include "nccl_library.hpp"

#include <string_view>

#include "coshard/async/detail/shared_library.hpp"

namespace coshard::collectives::detail::nccl {
namespace {

using async::detail::SharedLibrary;

constexpr const char* kFile = "libnccl.so.2";
static_assert(NCCL_MAJOR == 2, "the soname above names the major version of the header built against");
constexpr int kOldest = NCCL_VERSION(2, 18, 0);  // ncclCommSplit

// The candidate opened, its functions bound and its version checked; else why not.
Result<Library> take(const std::string& candidate) {
  COSHARD_TRY_ASSIGN(SharedLibrary file, SharedLibrary::open(candidate));
  Library lib;
  file.bind(lib.get_version, "ncclGetVersion");
  file.bind(lib.error_string, "ncclGetErrorString");
  file.bind(lib.last_error, "ncclGetLastError");
  file.bind(lib.get_unique_id, "ncclGetUniqueId");
  file.bind(lib.comm_init_rank, "ncclCommInitRank");
  file.bind(lib.comm_split, "ncclCommSplit");
  file.bind(lib.comm_abort, "ncclCommAbort");
  file.bind(lib.comm_destroy, "ncclCommDestroy");
  file.bind(lib.comm_count, "ncclCommCount");
  file.bind(lib.comm_user_rank, "ncclCommUserRank");
  file.bind(lib.comm_get_async_error, "ncclCommGetAsyncError");
  file.bind(lib.group_start, "ncclGroupStart");
  file.bind(lib.group_end, "ncclGroupEnd");
  file.bind(lib.all_gather, "ncclAllGather");
  file.bind(lib.reduce_scatter, "ncclReduceScatter");
  file.bind(lib.all_reduce, "ncclAllReduce");
  file.bind(lib.broadcast, "ncclBroadcast");
  file.bind(lib.send, "ncclSend");
  file.bind(lib.recv, "ncclRecv");
  if (!file.missing().empty()) return fail(ErrorCode::unsupported, file.missing(), " is missing: not NCCL");
  if (lib.get_version(&lib.version) != ncclSuccess)
    return fail(ErrorCode::unsupported, "ncclGetVersion did not give its version");
  if (lib.version < kOldest || lib.version / 10000 != NCCL_MAJOR)
    return fail(ErrorCode::unsupported, "NCCL ", version_string(lib.version), "; this build needs NCCL ", NCCL_MAJOR,
                " from ", version_string(kOldest));
  lib.path = file.file();
  if (lib.path.empty()) lib.path = candidate;
  std::move(file).keep();  // open for the life of the process
  return lib;
}

}  // namespace

std::string Library::describe() const { return "NCCL " + version_string(version) + " (" + path + ")"; }

std::string version_string(int version) {
  if (version >= 10000) return async::detail::dotted_version(static_cast<std::size_t>(version));
  // before 2.9: X*1000 + Y*100 + Z
  return std::to_string(version / 1000) + "." + std::to_string(version / 100 % 10) + "." + std::to_string(version % 100);
}

Result<Library> open_library(std::span<const std::string> candidates) {
  return async::detail::first_library(candidates, std::string("NCCL (") + kFile + ")", "COSHARD_NCCL_LIBRARY", take);
}

Result<const Library*> library() {
#ifdef COSHARD_NCCL_LIBRARY_DIR
  constexpr std::string_view found_in = COSHARD_NCCL_LIBRARY_DIR;
#else
  constexpr std::string_view found_in;
#endif
  static const Result<Library> loaded =
      open_library(async::detail::library_candidates("COSHARD_NCCL_LIBRARY", kFile, found_in));
  if (!loaded) return fail(loaded.error());
  return &*loaded;
}

}  // namespace coshard::collectives::detail::nccl
