// TcpStore: the rendezvous key-value store, in the torchrun convention.
//
// Rank 0 hosts the server (bound to MASTER_ADDR:MASTER_PORT, loopback by default); every rank,
// rank 0 included, connects as a client. Keys are set once and read by many: get() waits on the
// server until the key exists or the timeout passes. add() is an atomic counter (barriers).
//
//   auto store = co_await TcpStore::connect({.host = "127.0.0.1", .port = 29500, .host_server = rank == 0});
//   co_await (*store)->set("nccl/uid", uid_bytes);
//   auto uid = co_await (*store)->get("nccl/uid");        // Result<std::vector<std::byte>>
//
// Failure behaviour: a key that never comes fails with ErrorCode::timeout naming the key; a
// server that goes away fails every pending and later call with ErrorCode::closed; a message
// over max_frame_bytes or malformed is refused with a clear error (the server answers with the
// error and drops that connection). All calls run on the Runtime that made the store, one at a
// time per client; destroy the store on that runtime (inside a task), before the runtime.
//
// GCC 12 trap: an aggregate temporary (StoreOptions{...}, or one returned by value) written inside
// a co_await expression is destroyed twice (double free). Build the options in a named variable
// first: `const StoreOptions o{.port = p}; co_await TcpStore::connect(o);`.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/result.hpp"
#include "coshard/async/task.hpp"
#include "coshard/collectives/store_protocol.hpp"

namespace coshard::collectives {

struct StoreOptions {
  std::string host = "127.0.0.1";
  std::uint16_t port = 29500;     // 0 with host_server: pick a free port (see TcpStore::port())
  bool host_server = false;       // this process runs the server (rank 0)
  std::chrono::milliseconds timeout{std::chrono::seconds(30)};  // connecting, and each get()
  std::size_t max_frame_bytes = store::kDefaultMaxFrameBytes;
};

class TcpStore {
 public:
  // Must be awaited on a coshard Runtime; the store then belongs to that runtime.
  static async::Task<Result<std::unique_ptr<TcpStore>>> connect(StoreOptions options);
  ~TcpStore();
  TcpStore(const TcpStore&) = delete;
  TcpStore& operator=(const TcpStore&) = delete;

  async::Task<Result<void>> set(std::string key, std::span<const std::byte> value);
  async::Task<Result<std::vector<std::byte>>> get(std::string key);
  async::Task<Result<std::int64_t>> add(std::string key, std::int64_t delta);

  // The port the server listens on (the actual one when 0 was asked for).
  std::uint16_t port() const noexcept;
  // Closes this client and, if it hosts one, the server: others' calls then fail with closed.
  void close();

  struct Impl;
  explicit TcpStore(std::unique_ptr<Impl> impl);

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace coshard::collectives
