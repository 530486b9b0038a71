#include "coshard/collectives/store.hpp"

#include <gtest/gtest.h>

#include <chrono>

#include "coshard/async/net.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/time.hpp"
#include "coshard/async/when_all.hpp"
#include "coshard/collectives/store_protocol.hpp"

namespace coshard::collectives {
namespace {

using namespace std::chrono_literals;
using async::Task;

std::vector<std::byte> bytes_of(std::string_view s) {
  auto b = std::as_bytes(std::span(s.data(), s.size()));
  return {b.begin(), b.end()};
}

// ---- protocol ----------------------------------------------------------------------------------

std::span<const std::byte> payload_of(const std::vector<std::byte>& frame) { return std::span(frame).subspan(4); }

TEST(StoreProtocol, RequestsAndResponsesRoundTrip) {
  store::Request set{store::Op::set, "k", bytes_of("value"), 0, 0};
  auto s = store::decode_request(payload_of(store::encode(set)));
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->key, "k");
  EXPECT_EQ(s->value, bytes_of("value"));
  store::Request get{store::Op::get, "key/2", {}, 1234, 0};
  auto g = store::decode_request(payload_of(store::encode(get)));
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->timeout_ms, 1234u);
  store::Response add{store::Status::ok, {}, -42, {}};
  auto a = store::decode_response(payload_of(store::encode(add, store::Op::add)), store::Op::add);
  ASSERT_TRUE(a.has_value());
  EXPECT_EQ(a->number, -42);
}

TEST(StoreProtocol, MalformedMessagesAreRejectedWithWhatWasWrong) {
  auto frame = store::encode(store::Request{store::Op::set, "key", bytes_of("v"), 0, 0});
  std::vector<std::byte> payload(frame.begin() + 4, frame.end());

  auto bad_op = payload;
  bad_op[0] = std::byte{9};
  auto r1 = store::decode_request(bad_op);
  ASSERT_FALSE(r1.has_value());
  EXPECT_NE(r1.error().message().find("unknown op 9"), std::string::npos);

  auto truncated = payload;
  truncated.pop_back();
  auto r2 = store::decode_request(truncated);
  ASSERT_FALSE(r2.has_value());
  EXPECT_NE(r2.error().message().find("truncated value"), std::string::npos);

  auto trailing = payload;
  trailing.push_back(std::byte{0});
  auto r3 = store::decode_request(trailing);
  ASSERT_FALSE(r3.has_value());
  EXPECT_NE(r3.error().message().find("trailing"), std::string::npos);

  auto huge_key = payload;  // claim a 1 GiB key
  huge_key[1] = std::byte{0};
  huge_key[2] = std::byte{0};
  huge_key[3] = std::byte{0};
  huge_key[4] = std::byte{0x40};
  auto r4 = store::decode_request(huge_key);
  ASSERT_FALSE(r4.has_value());
  EXPECT_NE(r4.error().message().find("exceeds the limit of 4096"), std::string::npos);

  std::array<std::byte, 4> big{std::byte{0}, std::byte{0}, std::byte{0}, std::byte{0x10}};  // 256 MiB
  auto r5 = store::frame_length(big, store::kDefaultMaxFrameBytes);
  ASSERT_FALSE(r5.has_value());
  EXPECT_NE(r5.error().message().find("268435456 bytes exceeds the limit"), std::string::npos);
  std::array<std::byte, 4> zero{};
  EXPECT_FALSE(store::frame_length(zero, 100).has_value());
}

// ---- the store over loopback -------------------------------------------------------------------

StoreOptions server_options(std::chrono::milliseconds timeout = 5s) {
  return StoreOptions{.host = "127.0.0.1", .port = 0, .host_server = true, .timeout = timeout};
}

TEST(TcpStore, SetGetAndAddAcrossClients) {
  async::Runtime rt;
  auto r = rt.block_on([]() -> Task<Result<bool>> {
    // Options are named variables: GCC 12 destroys an aggregate temporary inside a co_await
    // expression twice (see store.hpp).
    const StoreOptions host_options = server_options();
    COSHARD_CO_TRY_ASSIGN(auto host, co_await TcpStore::connect(host_options));
    const StoreOptions peer_options{.port = host->port(), .timeout = 5s};
    COSHARD_CO_TRY_ASSIGN(auto peer, co_await TcpStore::connect(peer_options));
    // A get that waits for a set made later by another client.
    auto later = [](TcpStore& s) -> Task<Result<void>> {
      co_await async::sleep_for(20ms);
      co_return co_await s.set("blob", bytes_of("hello"));
    };
    auto [got, set] = co_await async::when_all(peer->get("blob"), later(*host));
    COSHARD_CO_TRY(set);
    COSHARD_CO_TRY(got);
    COSHARD_CO_TRY_ASSIGN(std::int64_t a, co_await host->add("count", 2));
    COSHARD_CO_TRY_ASSIGN(std::int64_t b, co_await peer->add("count", 3));
    co_return *got == bytes_of("hello") && a == 2 && b == 5;
  }());
  ASSERT_TRUE(r.has_value()) << r.error().message();
  EXPECT_TRUE(*r);
}

TEST(TcpStore, AKeyThatNeverComesTimesOutNamingIt) {
  async::Runtime rt;
  auto r = rt.block_on([]() -> Task<Result<std::vector<std::byte>>> {
    const StoreOptions options = server_options(150ms);
    COSHARD_CO_TRY_ASSIGN(auto host, co_await TcpStore::connect(options));
    co_return co_await host->get("rank/3/ready");
  }());
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::timeout);
  EXPECT_NE(r.error().message().find("'rank/3/ready'"), std::string::npos) << r.error().message();
}

TEST(TcpStore, OversizedAndMalformedMessagesGetClearErrors) {
  async::Runtime rt;
  auto r = rt.block_on([]() -> Task<Result<std::string>> {
    StoreOptions o = server_options();
    o.max_frame_bytes = 1024;
    COSHARD_CO_TRY_ASSIGN(auto host, co_await TcpStore::connect(o));
    std::vector<std::byte> big(4096);
    auto too_big = co_await host->set("big", big);
    if (too_big || too_big.error().code() != ErrorCode::out_of_range) co_return fail(ErrorCode::internal, "expected out_of_range");

    // A raw client sends garbage: the server answers with an error frame and hangs up.
    async::net::tcp::socket raw(async::Runtime::current()->io_context());
    const async::net::tcp::endpoint server(asio::ip::make_address("127.0.0.1"), host->port());
    COSHARD_CO_TRY(co_await async::net::connect(raw, server));
    std::vector<std::byte> garbage{std::byte{3}, std::byte{0}, std::byte{0}, std::byte{0}, std::byte{7}, std::byte{1}, std::byte{2}};
    COSHARD_CO_TRY(co_await async::net::write_all(raw, garbage));
    std::array<std::byte, 4> header{};
    COSHARD_CO_TRY(co_await async::net::read_exact(raw, header));
    COSHARD_CO_TRY_ASSIGN(std::uint32_t n, store::frame_length(header, 1 << 20));
    std::vector<std::byte> payload(n);
    COSHARD_CO_TRY(co_await async::net::read_exact(raw, payload));
    COSHARD_CO_TRY_ASSIGN(store::Response reply, store::decode_response(payload, store::Op::set));
    std::array<std::byte, 1> more{};
    auto after = co_await async::net::read_exact(raw, more);  // the server closed the connection
    if (after) co_return fail(ErrorCode::internal, "expected the server to hang up");
    // The store itself is unharmed.
    COSHARD_CO_TRY(co_await host->set("ok", bytes_of("1")));
    co_return reply.status == store::Status::error ? reply.message : std::string("not an error");
  }());
  ASSERT_TRUE(r.has_value()) << r.error().message();
  EXPECT_NE(r->find("unknown op 7"), std::string::npos) << *r;
}

TEST(TcpStore, ClientsFailPromptlyWhenTheHostGoesAway) {
  async::Runtime rt;
  auto r = rt.block_on([]() -> Task<Result<std::pair<ErrorCode, double>>> {
    const StoreOptions host_options = server_options(10s);
    COSHARD_CO_TRY_ASSIGN(auto host, co_await TcpStore::connect(host_options));
    const StoreOptions peer_options{.port = host->port(), .timeout = 10s};
    COSHARD_CO_TRY_ASSIGN(auto peer, co_await TcpStore::connect(peer_options));
    auto kill_host = [](TcpStore& h) -> Task<void> {
      co_await async::sleep_for(30ms);
      h.close();
    };
    const auto t0 = std::chrono::steady_clock::now();
    auto [got, done] = co_await async::when_all(peer->get("never"), kill_host(*host));
    (void)done;
    const double ms = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    if (got) co_return fail(ErrorCode::internal, "the get should have failed");
    co_return std::pair{got.error().code(), ms};
  }());
  ASSERT_TRUE(r.has_value()) << r.error().message();
  EXPECT_EQ(r->first, ErrorCode::closed);
  EXPECT_LT(r->second, 2000.0) << "failed only after " << r->second << " ms, not when the host went away";
}

TEST(TcpStore, UnreachableHostFailsAfterTheTimeout) {
  async::Runtime rt;
  auto r = rt.block_on([]() -> Task<Result<std::unique_ptr<TcpStore>>> {
    // Port 1 on loopback: nothing listens (and we may not bind it).
    const StoreOptions options{.host = "127.0.0.1", .port = 1, .timeout = 200ms};
    co_return co_await TcpStore::connect(options);
  }());
  ASSERT_FALSE(r.has_value());
  EXPECT_EQ(r.error().code(), ErrorCode::timeout);
  EXPECT_NE(r.error().message().find("127.0.0.1:1"), std::string::npos) << r.error().message();
  const StoreOptions bad_options{.host = "not-an-address"};
  auto bad = rt.block_on(TcpStore::connect(bad_options));
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message().find("'not-an-address'"), std::string::npos);
}

}  // namespace
}  // namespace coshard::collectives
