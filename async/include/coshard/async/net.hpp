// TCP on the reactor: Asio's socket operations as awaitables.
//
//   co_await net::connect(socket, endpoint)    -> Result<void>
//   co_await net::read_exact(socket, buffer)   -> Result<void>  (loops over read_some)
//   co_await net::write_all(socket, buffer)    -> Result<void>
//   co_await net::accept(acceptor)             -> Result<tcp::socket>
//   net::Deadline d(socket, 2s);               // cancels the socket's operations when it expires
//
// The completion handler runs on the reactor and resumes the coroutine inline. Use these only
// from tasks of the Runtime that owns the socket's io_context. Errors name the operation and
// Asio's message; a peer that closed gives ErrorCode::closed, a cancelled operation under an
// expired Deadline gives ErrorCode::timeout.
#pragma once

#include <asio/ip/tcp.hpp>
#include <asio/steady_timer.hpp>

#include <chrono>
#include <coroutine>
#include <memory>
#include <span>
#include <system_error>

#include "coshard/async/detail/asio_op.hpp"
#include "coshard/async/result.hpp"
#include "coshard/async/task.hpp"

namespace coshard::async::net {

using tcp = asio::ip::tcp;

// Cancels every pending operation of `socket` once `after` has passed, unless destroyed first.
class Deadline {
 public:
  Deadline(tcp::socket& socket, std::chrono::nanoseconds after)
      : state_(std::make_shared<State>(socket.get_executor())) {
    state_->timer.expires_after(after);
    // The handler owns the state: it may run after this Deadline (and its frame) is gone.
    state_->timer.async_wait([state = state_, &socket](const std::error_code& ec) {
      if (ec || state->disarmed) return;
      state->expired = true;
      std::error_code ignored;
      socket.cancel(ignored);
    });
  }
  ~Deadline() {
    state_->disarmed = true;
    state_->timer.cancel();
  }
  Deadline(const Deadline&) = delete;
  Deadline& operator=(const Deadline&) = delete;

  bool expired() const noexcept { return state_->expired; }

 private:
  struct State {
    explicit State(const tcp::socket::executor_type& ex) : timer(ex) {}
    asio::steady_timer timer;
    bool expired = false;
    bool disarmed = false;
  };
  std::shared_ptr<State> state_;
};

namespace detail {

Unexpected net_error(const char* what, const std::error_code& ec, bool deadline_expired);

}  // namespace detail

inline Task<Result<void>> read_exact(tcp::socket& socket, std::span<std::byte> buffer, const Deadline* deadline = nullptr) {
  std::size_t done = 0;
  while (done < buffer.size()) {
    auto [ec, n] = co_await async::detail::TransferAwaiter([&](auto handler) {
      socket.async_read_some(asio::buffer(buffer.data() + done, buffer.size() - done), std::move(handler));
    });
    if (ec) co_return detail::net_error("read", ec, deadline && deadline->expired());
    done += n;
  }
  co_return Result<void>{};
}

inline Task<Result<void>> write_all(tcp::socket& socket, std::span<const std::byte> buffer, const Deadline* deadline = nullptr) {
  std::size_t done = 0;
  while (done < buffer.size()) {
    auto [ec, n] = co_await async::detail::TransferAwaiter([&](auto handler) {
      socket.async_write_some(asio::buffer(buffer.data() + done, buffer.size() - done), std::move(handler));
    });
    if (ec) co_return detail::net_error("write", ec, deadline && deadline->expired());
    done += n;
  }
  co_return Result<void>{};
}

inline Task<Result<void>> connect(tcp::socket& socket, const tcp::endpoint& endpoint, const Deadline* deadline = nullptr) {
  auto [ec, n] = co_await async::detail::TransferAwaiter([&](auto handler) {
    socket.async_connect(endpoint, [h = std::move(handler)](const std::error_code& e) mutable { h(e, 0); });
  });
  (void)n;
  if (ec) co_return detail::net_error("connect", ec, deadline && deadline->expired());
  co_return Result<void>{};
}

inline Task<Result<tcp::socket>> accept(tcp::acceptor& acceptor) {
  tcp::socket peer(acceptor.get_executor());
  auto [ec, n] = co_await async::detail::TransferAwaiter([&](auto handler) {
    acceptor.async_accept(peer, [h = std::move(handler)](const std::error_code& e) mutable { h(e, 0); });
  });
  (void)n;
  if (ec) co_return detail::net_error("accept", ec, false);
  co_return std::move(peer);
}

}  // namespace coshard::async::net
