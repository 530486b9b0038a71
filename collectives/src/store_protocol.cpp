#include "coshard/collectives/store_protocol.hpp"

#include <cstring>

namespace coshard::collectives::store {
namespace {

class Writer {
 public:
  Writer() { out_.resize(4); }  // room for the length prefix
  void u8(std::uint8_t v) { out_.push_back(static_cast<std::byte>(v)); }
  void u32(std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out_.push_back(static_cast<std::byte>(v >> (8 * i)));
  }
  void i64(std::int64_t v) {
    const auto u = static_cast<std::uint64_t>(v);
    for (int i = 0; i < 8; ++i) out_.push_back(static_cast<std::byte>(u >> (8 * i)));
  }
  void bytes(std::span<const std::byte> b) {
    u32(static_cast<std::uint32_t>(b.size()));
    out_.insert(out_.end(), b.begin(), b.end());
  }
  void str(const std::string& s) { bytes(std::as_bytes(std::span(s.data(), s.size()))); }
  std::vector<std::byte> finish() {
    const auto n = static_cast<std::uint32_t>(out_.size() - 4);
    for (int i = 0; i < 4; ++i) out_[static_cast<std::size_t>(i)] = static_cast<std::byte>(n >> (8 * i));
    return std::move(out_);
  }

 private:
  std::vector<std::byte> out_;
};

class Reader {
 public:
  explicit Reader(std::span<const std::byte> in) : in_(in) {}

  Result<std::uint8_t> u8(const char* what) {
    if (left() < 1) return truncated(what, 1);
    return static_cast<std::uint8_t>(in_[pos_++]);
  }
  Result<std::uint32_t> u32(const char* what) {
    if (left() < 4) return truncated(what, 4);
    std::uint32_t v = 0;
    for (int i = 0; i < 4; ++i) v |= static_cast<std::uint32_t>(in_[pos_++]) << (8 * i);
    return v;
  }
  Result<std::int64_t> i64(const char* what) {
    if (left() < 8) return truncated(what, 8);
    std::uint64_t v = 0;
    for (int i = 0; i < 8; ++i) v |= static_cast<std::uint64_t>(in_[pos_++]) << (8 * i);
    return static_cast<std::int64_t>(v);
  }
  Result<std::span<const std::byte>> bytes(const char* what, std::size_t limit) {
    auto n = u32(what);
    if (!n) return fail(std::move(n).error());
    if (*n > limit) return fail(ErrorCode::out_of_range, "store message: ", what, " of ", *n, " bytes exceeds the limit of ", limit);
    if (left() < *n) return truncated(what, *n);
    auto s = in_.subspan(pos_, *n);
    pos_ += *n;
    return s;
  }
  Result<std::string> str(const char* what, std::size_t limit) {
    auto b = bytes(what, limit);
    if (!b) return fail(std::move(b).error());
    return std::string(reinterpret_cast<const char*>(b->data()), b->size());
  }
  Result<void> end() {
    if (left() != 0) return fail(ErrorCode::invalid_argument, "store message: ", left(), " unexpected trailing bytes");
    return {};
  }

 private:
  std::size_t left() const { return in_.size() - pos_; }
  Unexpected truncated(const char* what, std::size_t need) {
    return fail(ErrorCode::invalid_argument, "store message: truncated ", what, " (needs ", need, " bytes, ", left(), " left)");
  }
  std::span<const std::byte> in_;
  std::size_t pos_ = 0;
};

}  // namespace

std::vector<std::byte> encode(const Request& r) {
  Writer w;
  w.u8(static_cast<std::uint8_t>(r.op));
  w.str(r.key);
  switch (r.op) {
    case Op::set: w.bytes(r.value); break;
    case Op::get: w.u32(r.timeout_ms); break;
    case Op::add: w.i64(r.delta); break;
  }
  return w.finish();
}

std::vector<std::byte> encode(const Response& r, Op answered) {
  Writer w;
  w.u8(static_cast<std::uint8_t>(r.status));
  if (r.status != Status::ok) {
    w.str(r.message);
  } else if (answered == Op::get) {
    w.bytes(r.value);
  } else if (answered == Op::add) {
    w.i64(r.number);
  }
  return w.finish();
}

Result<std::uint32_t> frame_length(std::span<const std::byte, 4> header, std::size_t max_frame_bytes) {
  std::uint32_t n = 0;
  for (int i = 0; i < 4; ++i) n |= static_cast<std::uint32_t>(header[static_cast<std::size_t>(i)]) << (8 * i);
  if (n == 0) return fail(ErrorCode::invalid_argument, "store message: empty frame");
  if (n > max_frame_bytes) {
    return fail(ErrorCode::out_of_range, "store message: frame of ", n, " bytes exceeds the limit of ", max_frame_bytes);
  }
  return n;
}

Result<Request> decode_request(std::span<const std::byte> payload) {
  Reader in(payload);
  Request r;
  COSHARD_TRY_ASSIGN(const std::uint8_t op, in.u8("op"));
  if (op < 1 || op > 3) return fail(ErrorCode::invalid_argument, "store message: unknown op ", static_cast<int>(op));
  r.op = static_cast<Op>(op);
  COSHARD_TRY_ASSIGN(r.key, in.str("key", kMaxKeyBytes));
  switch (r.op) {
    case Op::set: {
      COSHARD_TRY_ASSIGN(auto value, in.bytes("value", payload.size()));
      r.value.assign(value.begin(), value.end());
      break;
    }
    case Op::get: {
      COSHARD_TRY_ASSIGN(r.timeout_ms, in.u32("timeout"));
      break;
    }
    case Op::add: {
      COSHARD_TRY_ASSIGN(r.delta, in.i64("delta"));
      break;
    }
  }
  COSHARD_TRY(in.end());
  return r;
}

Result<Response> decode_response(std::span<const std::byte> payload, Op answered) {
  Reader in(payload);
  Response r;
  COSHARD_TRY_ASSIGN(const std::uint8_t status, in.u8("status"));
  if (status > 2) return fail(ErrorCode::invalid_argument, "store message: unknown status ", static_cast<int>(status));
  r.status = static_cast<Status>(status);
  if (r.status != Status::ok) {
    COSHARD_TRY_ASSIGN(r.message, in.str("message", payload.size()));
  } else if (answered == Op::get) {
    COSHARD_TRY_ASSIGN(auto value, in.bytes("value", payload.size()));
    r.value.assign(value.begin(), value.end());
  } else if (answered == Op::add) {
    COSHARD_TRY_ASSIGN(r.number, in.i64("value"));
  }
  COSHARD_TRY(in.end());
  return r;
}

}  // namespace coshard::collectives::store
