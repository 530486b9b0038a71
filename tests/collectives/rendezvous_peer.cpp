// One rank of the multi-process rendezvous test (run by multiprocess_test.cpp, not by hand).
// Environment (torchrun's): RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT; and for the test:
//   COSHARD_STORE_TIMEOUT_MS  how long a get waits
//   COSHARD_TEST_HANG_RANK    this rank hangs before publishing (to be killed)
// Each rank publishes a blob of odd size, reads every other rank's and checks it byte by byte;
// rank 0 hosts the store and leaves last. Exit codes: 0 ok, 2 bad setup, 3 store error, 4 bad data.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/store.hpp"

using namespace coshard;
using namespace coshard::collectives;

namespace {

int env_int(const char* name, int fallback) {
  const char* v = std::getenv(name);
  return v ? std::atoi(v) : fallback;
}

std::vector<std::byte> blob_of(int rank) {
  std::vector<std::byte> b(static_cast<std::size_t>(256 * 1024 + 1000 * rank + 7));
  std::uint32_t x = 2463534242u + static_cast<std::uint32_t>(rank);
  for (auto& byte : b) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    byte = static_cast<std::byte>(x);
  }
  return b;
}

async::Task<int> run(int rank, int world, StoreOptions options) {
  auto store = co_await TcpStore::connect(options);
  if (!store) {
    std::fprintf(stderr, "rank %d: %s\n", rank, store.error().message().c_str());
    co_return 3;
  }
  if (rank == env_int("COSHARD_TEST_HANG_RANK", -1)) {
    for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));  // until killed
  }
  const std::vector<std::byte> mine = blob_of(rank);
  if (auto s = co_await (*store)->set("blob/" + std::to_string(rank), mine); !s) {
    std::fprintf(stderr, "rank %d: %s\n", rank, s.error().message().c_str());
    co_return 3;
  }
  for (int q = 0; q < world; ++q) {
    if (q == rank) continue;
    auto got = co_await (*store)->get("blob/" + std::to_string(q));
    if (!got) {
      std::fprintf(stderr, "rank %d: %s\n", rank, got.error().message().c_str());
      co_return 3;
    }
    if (*got != blob_of(q)) {
      std::fprintf(stderr, "rank %d: blob of rank %d differs\n", rank, q);
      co_return 4;
    }
  }
  const std::vector<std::byte> none;
  if (auto s = co_await (*store)->set("done/" + std::to_string(rank), none); !s) co_return 3;
  if (rank == 0) {  // the host leaves last
    for (int q = 1; q < world; ++q) {
      if (auto d = co_await (*store)->get("done/" + std::to_string(q)); !d) {
        std::fprintf(stderr, "rank 0: %s\n", d.error().message().c_str());
        co_return 3;
      }
    }
  }
  std::printf("rank %d: exchanged %d blobs\n", rank, world - 1);
  co_return 0;
}

}  // namespace

int main() {
  const int rank = env_int("RANK", -1);
  const int world = env_int("WORLD_SIZE", -1);
  const char* addr = std::getenv("MASTER_ADDR");
  const int port = env_int("MASTER_PORT", -1);
  if (rank < 0 || world < 1 || rank >= world || port <= 0 || port > 65535) {
    std::fprintf(stderr, "rendezvous_peer: RANK, WORLD_SIZE, MASTER_PORT must be set (RANK=%d WORLD_SIZE=%d MASTER_PORT=%d)\n",
                 rank, world, port);
    return 2;
  }
  StoreOptions options;
  options.host = addr ? addr : "127.0.0.1";
  options.port = static_cast<std::uint16_t>(port);
  options.host_server = rank == 0;
  options.timeout = std::chrono::milliseconds(env_int("COSHARD_STORE_TIMEOUT_MS", 30000));
  async::Runtime rt;
  auto code = rt.block_on(run(rank, world, options));
  return code ? *code : 3;
}
