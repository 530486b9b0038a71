#include "coshard/async/net.hpp"

#include <asio/error.hpp>

namespace coshard::async::net::detail {

Unexpected net_error(const char* what, const std::error_code& ec, bool deadline_expired) {
  if (deadline_expired && ec == asio::error::operation_aborted) {
    return fail(ErrorCode::timeout, "socket ", what, ": deadline expired");
  }
  if (ec == asio::error::eof || ec == asio::error::connection_reset || ec == asio::error::broken_pipe) {
    return fail(ErrorCode::closed, "socket ", what, ": the peer closed the connection (", ec.message(), ")");
  }
  return fail(ErrorCode::io, "socket ", what, ": ", ec.message());
}

}  // namespace coshard::async::net::detail
