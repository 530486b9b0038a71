#include "mpi_process.hpp"

namespace coshard::collectives::detail {

std::string mpi_error_string(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) return "MPI error " + std::to_string(code);
  return std::string(text, static_cast<std::size_t>(length));
}

Result<std::shared_ptr<MpiProcess>> MpiProcess::instance() {
  // The holder lives to the end of the process: its destruction at exit finalises MPI once no
  // communicator is left.
  static std::mutex mutex;
  static std::shared_ptr<MpiProcess> process;
  std::lock_guard lock(mutex);
  if (process) return process;
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  if (finalized) return fail(ErrorCode::unsupported, "MPI: already finalised in this process; it cannot start again");
  int level = MPI_THREAD_SINGLE;
  bool owned = false;
  if (initialized) {
    MPI_Query_thread(&level);
  } else {
    if (const int r = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &level); r != MPI_SUCCESS) {
      return fail(ErrorCode::device, "MPI_Init_thread: ", mpi_error_string(r));
    }
    owned = true;
  }
  if (level < MPI_THREAD_SERIALIZED) {
    return fail(ErrorCode::unsupported, "MPI gives thread level ", level,
                ": the MPI backend calls MPI from its streams' threads and needs MPI_THREAD_SERIALIZED (",
                MPI_THREAD_SERIALIZED, ") or MPI_THREAD_MULTIPLE (", MPI_THREAD_MULTIPLE,
                ")", initialized ? " (the program initialised MPI itself: use MPI_Init_thread)" : "");
  }
  int* tag_ub = nullptr;
  int found = 0;
  MPI_Comm_get_attr(MPI_COMM_WORLD, MPI_TAG_UB, &tag_ub, &found);
  process = std::make_shared<MpiProcess>(owned, level, found && tag_ub != nullptr ? *tag_ub : 32767);
  return process;
}

MpiProcess::~MpiProcess() {
  if (!owned_) return;
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (finalized) return;
  // The kept buffers outlive MPI: a freed request's send may still read its buffer.
  std::vector<std::pair<std::shared_ptr<const std::string>, MPI_Request>> kept;
  std::vector<MPI_Comm> retired;
  {
    std::lock_guard lock(kept_mutex_);
    kept.swap(kept_);
    retired.swap(retired_);
  }
  for (auto& [buffer, request] : kept) {
    int done = 0;
    MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (!done) MPI_Request_free(&request);  // a peer gone before reading it
  }
  for (MPI_Comm& comm : retired) MPI_Comm_free(&comm);
  MPI_Finalize();
}

std::unique_lock<std::mutex> MpiProcess::lock() {
  if (thread_level_ >= MPI_THREAD_MULTIPLE) return {};
  return std::unique_lock(mutex_);
}

void MpiProcess::keep_until_finalize(std::shared_ptr<const std::string> buffer, MPI_Request request) {
  std::lock_guard lock(kept_mutex_);
  kept_.emplace_back(std::move(buffer), request);
}

void MpiProcess::retire(MPI_Comm comm) {
  std::lock_guard lock(kept_mutex_);
  retired_.push_back(comm);
}

}  // namespace coshard::collectives::detail
