// TcpStore: server and client (rules in store.hpp). Everything runs on one Runtime's reactor,
// so the server's tables need no locks; state shared with timer handlers lives in shared_ptrs
// because a handler may run after the coroutine that armed it has moved on.
#include "coshard/collectives/store.hpp"

#include <asio/ip/address.hpp>
#include <asio/steady_timer.hpp>

#include <array>
#include <cstring>
#include <map>
#include <set>

#include "coshard/async/net.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/semaphore.hpp"
#include "coshard/async/time.hpp"

namespace coshard::collectives {
namespace {

using async::Task;
using async::net::tcp;
using namespace store;

// ---- server ------------------------------------------------------------------------------------

struct KeyWait {
  explicit KeyWait(asio::any_io_executor ex) : timer(std::move(ex)) {}
  std::coroutine_handle<> waiter;
  asio::steady_timer timer;
  bool done = false;
  bool timed_out = false;
};

struct ServerState {
  explicit ServerState(asio::io_context& io, std::size_t max_frame) : acceptor(io), max_frame_bytes(max_frame) {}
  tcp::acceptor acceptor;
  std::size_t max_frame_bytes;
  std::map<std::string, std::vector<std::byte>> values;
  std::multimap<std::string, std::shared_ptr<KeyWait>> waits;
  std::set<std::shared_ptr<tcp::socket>> connections;
  bool closed = false;

  void publish(const std::string& key) {
    auto [first, last] = waits.equal_range(key);
    for (auto it = first; it != last; ++it) {
      KeyWait& w = *it->second;
      if (w.done) continue;
      w.done = true;
      w.timer.cancel();
      async::Runtime::current()->schedule(w.waiter);
    }
    waits.erase(first, last);
  }

  void close() {
    if (closed) return;
    closed = true;
    std::error_code ignored;
    acceptor.close(ignored);
    for (const auto& s : connections) s->close(ignored);
  }
};

// Suspends until `key` is published or `timeout` passes.
class KeyWaitAwaiter {
 public:
  KeyWaitAwaiter(ServerState& server, std::string key, std::chrono::milliseconds timeout)
      : server_(server), key_(std::move(key)), timeout_(timeout) {}
  bool await_ready() const { return server_.values.contains(key_); }
  void await_suspend(std::coroutine_handle<> h) {
    wait_ = std::make_shared<KeyWait>(server_.acceptor.get_executor());
    wait_->waiter = h;
    server_.waits.emplace(key_, wait_);
    wait_->timer.expires_after(timeout_);
    wait_->timer.async_wait([w = wait_](const std::error_code& ec) {
      if (ec || w->done) return;
      w->done = true;
      w->timed_out = true;
      w->waiter.resume();
    });
  }
  bool await_resume() const { return !wait_ || !wait_->timed_out; }  // true: the key is there

 private:
  ServerState& server_;
  std::string key_;
  std::chrono::milliseconds timeout_;
  std::shared_ptr<KeyWait> wait_;
};

Task<void> serve(std::shared_ptr<ServerState> server, std::shared_ptr<tcp::socket> socket) {
  server->connections.insert(socket);
  auto reply = [&](const Response& response, Op op) -> Task<Result<void>> {
    auto frame = encode(response, op);
    co_return co_await async::net::write_all(*socket, frame);
  };
  for (;;) {
    std::array<std::byte, 4> header{};
    if (!co_await async::net::read_exact(*socket, header)) break;  // the client left
    auto length = frame_length(header, server->max_frame_bytes);
    if (!length) {
      // Named, not a temporary: GCC 12 destroys aggregate temporaries in co_await twice.
      const Response refusal{Status::error, {}, 0, length.error().message()};
      (void)co_await reply(refusal, Op::set);
      break;
    }
    std::vector<std::byte> payload(*length);
    if (!co_await async::net::read_exact(*socket, payload)) break;
    auto request = decode_request(payload);
    if (!request) {
      const Response refusal{Status::error, {}, 0, request.error().message()};
      (void)co_await reply(refusal, Op::set);
      break;
    }
    Response response;
    switch (request->op) {
      case Op::set:
        server->values[request->key] = std::move(request->value);
        server->publish(request->key);
        break;
      case Op::add: {
        auto& stored = server->values[request->key];
        std::int64_t current = 0;
        if (stored.size() == sizeof(current)) std::memcpy(&current, stored.data(), sizeof(current));
        current += request->delta;
        stored.resize(sizeof(current));
        std::memcpy(stored.data(), &current, sizeof(current));
        response.number = current;
        server->publish(request->key);
        break;
      }
      case Op::get:
        if (co_await KeyWaitAwaiter(*server, request->key, std::chrono::milliseconds(request->timeout_ms))) {
          response.value = server->values[request->key];
        } else {
          response.status = Status::timeout;
          response.message = "key '" + request->key + "' was not set within " + std::to_string(request->timeout_ms) + " ms";
        }
        break;
    }
    if (!co_await reply(response, request->op)) break;
  }
  std::error_code ignored;
  socket->close(ignored);
  server->connections.erase(socket);
}

Task<void> accept_loop(std::shared_ptr<ServerState> server) {
  while (!server->closed) {
    auto peer = co_await async::net::accept(server->acceptor);
    if (!peer) break;  // closed
    async::Runtime::current()->spawn(serve(server, std::make_shared<tcp::socket>(std::move(*peer)))).detach();
  }
}

Result<tcp::endpoint> resolve(const StoreOptions& o) {
  std::error_code ec;
  auto address = asio::ip::make_address(o.host == "localhost" ? "127.0.0.1" : o.host, ec);
  if (ec) {
    return fail(ErrorCode::invalid_argument, "rendezvous address '", o.host, "': not a numeric IPv4/IPv6 address (", ec.message(), ")");
  }
  return tcp::endpoint(address, o.port);
}

}  // namespace

// ---- client --------------------------------------------------------------------------------------

struct TcpStore::Impl {
  Impl(asio::io_context& io, StoreOptions o) : options(std::move(o)), socket(io), one_call(1) {}
  StoreOptions options;
  tcp::socket socket;
  async::Semaphore one_call;  // a client has one request in flight
  std::shared_ptr<ServerState> server;
  std::uint16_t port = 0;
  std::string broken;  // non-empty once the connection is unusable

  Task<Result<Response>> call(Request request, std::chrono::milliseconds limit) {
    auto permit = co_await one_call.acquire();
    if (!permit) co_return fail(permit.error());
    // Built only when an error needs it (DESIGN: nothing formatted on the success path).
    auto what = [&] {
      return "store " + std::string(request.op == Op::set ? "set" : request.op == Op::get ? "get" : "add") + "('" +
             request.key + "') at " + options.host + ":" + std::to_string(options.port);
    };
    if (!broken.empty()) co_return fail(ErrorCode::closed, what(), ": ", broken);
    auto frame = encode(request);
    if (frame.size() - 4 > options.max_frame_bytes) {
      co_return fail(ErrorCode::out_of_range, what(), ": message of ", frame.size() - 4, " bytes exceeds the limit of ",
                     options.max_frame_bytes);
    }
    async::net::Deadline deadline(socket, limit);
    auto result = co_await exchange(frame, request.op, deadline);
    if (!result) {
      // The stream may hold half a message now: nothing more can be said on it.
      broken = result.error().message();
      std::error_code ignored;
      socket.close(ignored);
      co_return fail(Error(result.error().code(), what() + ": " + result.error().message()));
    }
    if (result->status == Status::timeout) co_return fail(ErrorCode::timeout, what(), ": ", result->message);
    if (result->status == Status::error) co_return fail(ErrorCode::invalid_argument, what(), ": the server refused it: ", result->message);
    co_return std::move(*result);
  }

  Task<Result<Response>> exchange(const std::vector<std::byte>& frame, Op op, const async::net::Deadline& deadline) {
    COSHARD_CO_TRY(co_await async::net::write_all(socket, frame, &deadline));
    std::array<std::byte, 4> header{};
    COSHARD_CO_TRY(co_await async::net::read_exact(socket, header, &deadline));
    COSHARD_CO_TRY_ASSIGN(const std::uint32_t length, frame_length(header, options.max_frame_bytes));
    std::vector<std::byte> payload(length);
    COSHARD_CO_TRY(co_await async::net::read_exact(socket, payload, &deadline));
    co_return decode_response(payload, op);
  }
};

TcpStore::TcpStore(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

TcpStore::~TcpStore() { close(); }

void TcpStore::close() {
  std::error_code ignored;
  impl_->socket.close(ignored);
  if (impl_->server) impl_->server->close();
}

std::uint16_t TcpStore::port() const noexcept { return impl_->port; }

Task<Result<std::unique_ptr<TcpStore>>> TcpStore::connect(StoreOptions options) {
  async::Runtime* rt = async::Runtime::current();
  if (rt == nullptr) co_return fail(ErrorCode::invalid_argument, "TcpStore::connect: must be awaited on a coshard Runtime");
  if (options.timeout.count() <= 0) {
    co_return fail(ErrorCode::invalid_argument, "StoreOptions::timeout=", options.timeout.count(), " ms: must be positive");
  }
  COSHARD_CO_TRY_ASSIGN(tcp::endpoint endpoint, resolve(options));
  auto impl = std::make_unique<Impl>(rt->io_context(), options);

  if (options.host_server) {
    auto server = std::make_shared<ServerState>(rt->io_context(), options.max_frame_bytes);
    std::error_code ec;
    server->acceptor.open(endpoint.protocol(), ec);
    if (!ec) server->acceptor.set_option(tcp::acceptor::reuse_address(true), ec);
    if (!ec) server->acceptor.bind(endpoint, ec);
    if (!ec) server->acceptor.listen(asio::socket_base::max_listen_connections, ec);
    if (ec) {
      co_return fail(ErrorCode::io, "rendezvous server: cannot listen on ", options.host, ":", options.port, ": ", ec.message());
    }
    endpoint = server->acceptor.local_endpoint();
    impl->options.port = endpoint.port();
    rt->spawn(accept_loop(server)).detach();
    impl->server = std::move(server);
  }
  impl->port = endpoint.port();

  // The server may not be up yet: retry until the timeout.
  const auto give_up = std::chrono::steady_clock::now() + options.timeout;
  for (;;) {
    async::net::Deadline attempt(impl->socket, std::chrono::milliseconds(1000));
    auto connected = co_await async::net::connect(impl->socket, endpoint, &attempt);
    if (connected) break;
    std::error_code ignored;
    impl->socket.close(ignored);
    if (std::chrono::steady_clock::now() >= give_up) {
      co_return fail(ErrorCode::timeout, "could not reach the rendezvous store at ", options.host, ":", endpoint.port(),
                     " within ", options.timeout.count(), " ms: ", connected.error().message());
    }
    co_await async::sleep_for(std::chrono::milliseconds(50));
  }
  impl->socket.set_option(tcp::no_delay(true));
  co_return std::make_unique<TcpStore>(std::move(impl));
}

Task<Result<void>> TcpStore::set(std::string key, std::span<const std::byte> value) {
  Request r{Op::set, std::move(key), {value.begin(), value.end()}, 0, 0};
  COSHARD_CO_TRY(co_await impl_->call(std::move(r), impl_->options.timeout));
  co_return Result<void>{};
}

Task<Result<std::vector<std::byte>>> TcpStore::get(std::string key) {
  const auto wait = impl_->options.timeout;
  Request r{Op::get, std::move(key), {}, static_cast<std::uint32_t>(wait.count()), 0};
  // The server waits up to `wait`; the socket deadline leaves it time to answer "timeout".
  COSHARD_CO_TRY_ASSIGN(Response response, co_await impl_->call(std::move(r), wait + wait / 2 + std::chrono::seconds(1)));
  co_return std::move(response.value);
}

Task<Result<std::int64_t>> TcpStore::add(std::string key, std::int64_t delta) {
  Request r{Op::add, std::move(key), {}, 0, delta};
  COSHARD_CO_TRY_ASSIGN(Response response, co_await impl_->call(std::move(r), impl_->options.timeout));
  co_return response.number;
}

}  // namespace coshard::collectives
