// The process's MPI: initialised once (MPI_THREAD_MULTIPLE), finalised at exit when coshard
// initialised it. Private to the MPI backend.
#pragma once

#include <mpi.h>

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::collectives::detail {

class MpiProcess {
 public:
  // The process's MPI, initialised on the first call. Every communicator holds it, so MPI is
  // finalised only after the last of them is gone (and at the earliest at exit).
  static Result<std::shared_ptr<MpiProcess>> instance();

  MpiProcess(bool owned, int thread_level, int tag_ub) : owned_(owned), thread_level_(thread_level), tag_ub_(tag_ub) {}
  ~MpiProcess();
  MpiProcess(const MpiProcess&) = delete;
  MpiProcess& operator=(const MpiProcess&) = delete;

  // Held around every MPI call: empty where MPI gave MPI_THREAD_MULTIPLE, the process's one
  // MPI mutex where it gave only MPI_THREAD_SERIALIZED.
  std::unique_lock<std::mutex> lock();
  // The largest tag this MPI accepts (at least 32767).
  int tag_ub() const noexcept { return tag_ub_; }
  // Buffers of sends nobody waits for (abort notices): kept until MPI is finalised.
  void keep_until_finalize(std::shared_ptr<const std::string> buffer, MPI_Request request);
  // A communicator no longer used, freed at MPI_Finalize (see MpiChannel's destructor).
  void retire(MPI_Comm comm);

 private:
  const bool owned_;
  const int thread_level_;
  const int tag_ub_;
  std::mutex mutex_;
  std::mutex kept_mutex_;
  std::vector<std::pair<std::shared_ptr<const std::string>, MPI_Request>> kept_;
  std::vector<MPI_Comm> retired_;
};

// "MPI_ERR_TRUNCATE: message truncated" for an MPI error code.
std::string mpi_error_string(int code);

}  // namespace coshard::collectives::detail
