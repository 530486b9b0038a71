// SIGUSR1 dumps and the printed diagnosis (rules in flight_dumps.hpp).
#include "flight_dumps.hpp"

#include <semaphore.h>
#include <signal.h>

#include <algorithm>
#include <atomic>
#include <cstdio>

#include "coshard/collectives/flight_recorder.hpp"

namespace coshard::train_app {
namespace {

sem_t g_wake;
std::atomic<bool> g_stop{false};

extern "C" void on_sigusr1(int) { sem_post(&g_wake); }

}  // namespace

FlightDumps::FlightDumps(std::filesystem::path dir, std::vector<const collectives::Communicator*> comms, int world)
    : dir_(std::move(dir)), comms_(std::move(comms)), world_(world) {
  sem_init(&g_wake, 0, 0);
  g_stop.store(false);
  thread_ = std::thread([this] { run(); });
  struct sigaction action{};
  action.sa_handler = on_sigusr1;
  action.sa_flags = SA_RESTART;
  sigemptyset(&action.sa_mask);
  sigaction(SIGUSR1, &action, nullptr);
}

FlightDumps::~FlightDumps() {
  signal(SIGUSR1, SIG_IGN);  // a late SIGUSR1 must not end the process while it finishes
  g_stop.store(true);
  sem_post(&g_wake);
  thread_.join();
  sem_destroy(&g_wake);
}

void FlightDumps::run() {
  for (;;) {
    while (sem_wait(&g_wake) != 0) {
    }
    if (g_stop.load()) return;
    std::lock_guard lock(mutex_);
    for (const auto* comm : comms_) {
      if (auto written = collectives::write_flight_record(*comm, "SIGUSR1", dir_); !written)
        std::fprintf(stderr, "coshard-train: %s\n", written.error().message().c_str());
    }
    print_flight_diagnosis(dir_, world_);
  }
}

FlightDumps::Registration::Registration(FlightDumps& dumps, const collectives::Communicator& comm)
    : dumps_(dumps), comm_(&comm) {
  std::lock_guard lock(dumps_.mutex_);
  dumps_.comms_.push_back(comm_);
}

FlightDumps::Registration::~Registration() {
  std::lock_guard lock(dumps_.mutex_);
  std::erase(dumps_.comms_, comm_);
}

bool print_flight_diagnosis(const std::filesystem::path& dir, int world) {
  auto records = collectives::read_flight_records(dir);
  if (!records) {
    std::fprintf(stderr, "coshard-train: %s\n", records.error().message().c_str());
    return false;
  }
  if (records->empty()) {
    std::fprintf(stderr, "coshard-train: flight recorder folder %s holds no rank's record\n", dir.string().c_str());
    return false;
  }
  if (world <= 0) world = records->front().size;  // --flight-report: the size the records give
  std::fputs(collectives::diagnose(*records, world).c_str(), stderr);
  std::fflush(stderr);
  return true;
}

}  // namespace coshard::train_app
