// The wire format of the rendezvous store (TcpStore), separate from the sockets so that it can be
// tested and fuzzed on its own.
//
// Every message is a frame: u32 little-endian payload length, then the payload.
//   request  payload: u8 op, then per op:
//     set:  str key, bytes value          get: str key, u32 timeout_ms
//     add:  str key, i64 delta            (str/bytes = u32 length + that many bytes)
//   response payload: u8 status (0 ok, 1 timeout, 2 error), then
//     ok+get: bytes value;  ok+add: i64 value;  ok+set: nothing;  timeout/error: str message
// Limits (max_frame_bytes, kMaxKeyBytes) are checked before anything is allocated, and a frame
// that is malformed (unknown op, a length past the end, trailing bytes) is rejected with an
// error that says what was wrong; the server then answers with an error and closes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::collectives::store {

inline constexpr std::size_t kMaxKeyBytes = 4096;
inline constexpr std::size_t kDefaultMaxFrameBytes = std::size_t{64} << 20;

enum class Op : std::uint8_t { set = 1, get = 2, add = 3 };
enum class Status : std::uint8_t { ok = 0, timeout = 1, error = 2 };

struct Request {
  Op op = Op::get;
  std::string key;
  std::vector<std::byte> value;   // set
  std::uint32_t timeout_ms = 0;   // get
  std::int64_t delta = 0;         // add
};

struct Response {
  Status status = Status::ok;
  std::vector<std::byte> value;  // ok + get
  std::int64_t number = 0;       // ok + add
  std::string message;           // timeout / error
};

// Frames (length prefix included).
std::vector<std::byte> encode(const Request& request);
std::vector<std::byte> encode(const Response& response, Op answered);

// The payload length announced by a 4-byte header, checked against the limit.
Result<std::uint32_t> frame_length(std::span<const std::byte, 4> header, std::size_t max_frame_bytes);
// Payloads (without the length prefix).
Result<Request> decode_request(std::span<const std::byte> payload);
Result<Response> decode_response(std::span<const std::byte> payload, Op answered);

}  // namespace coshard::collectives::store
