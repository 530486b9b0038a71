// coshard-train's side of the flight recorder (coshard/collectives/flight_recorder.hpp): with
// --flight-recorder DIR, SIGUSR1 makes every communicator of this process write its ring into DIR
// and prints the diagnosis of what DIR holds; after a failed run the diagnosis is printed too.
// --flight-report DIR prints the diagnosis of a folder and exits.
#pragma once

#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "coshard/collectives/communicator.hpp"

namespace coshard::train_app {

// SIGUSR1 → a dump. The handler only posts a semaphore (async-signal-safe); a thread of its own
// writes the files, so a process whose ranks are stuck in collectives still answers.
class FlightDumps {
 public:
  FlightDumps(std::filesystem::path dir, std::vector<const collectives::Communicator*> comms, int world);
  ~FlightDumps();
  FlightDumps(const FlightDumps&) = delete;
  FlightDumps& operator=(const FlightDumps&) = delete;

  // A group split from a world (a mesh's data and tensor groups) dumped too while the handle
  // lives: made after the group, it goes before it.
  class Registration {
   public:
    Registration(FlightDumps& dumps, const collectives::Communicator& comm);
    ~Registration();
    Registration(const Registration&) = delete;
    Registration& operator=(const Registration&) = delete;

   private:
    FlightDumps& dumps_;
    const collectives::Communicator* comm_;
  };

 private:
  void run();

  std::filesystem::path dir_;
  std::mutex mutex_;  // comms_: registrations come and go from the ranks' threads while a dump runs
  std::vector<const collectives::Communicator*> comms_;
  int world_;
  std::thread thread_;
};

// The diagnosis of `dir` on stderr (after a failed run, or for --flight-report). False when the
// folder holds no readable record (said on stderr).
bool print_flight_diagnosis(const std::filesystem::path& dir, int world);

}  // namespace coshard::train_app
