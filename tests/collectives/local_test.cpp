#include "coshard/collectives/local.hpp"

#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/async/sync.hpp"
#include "reference.hpp"

namespace coshard::collectives {
namespace {

using namespace reference;

using Comms = std::vector<std::unique_ptr<Communicator>>;

Comms make(int world, LocalOptions options = {}) {
  auto comms = make_local_communicators(world, options);
  EXPECT_TRUE(comms.has_value()) << (comms ? "" : comms.error().message());
  return std::move(*comms);
}

// Runs fn(comm) for every rank on its own thread, as ranks of a real job would.
void run_ranks(Comms& comms, const std::function<void(Communicator&)>& fn) {
  std::vector<std::thread> threads;
  for (auto& c : comms) threads.emplace_back([&fn, &c] { fn(*c); });
  for (auto& t : threads) t.join();
}

class EveryCollective : public ::testing::TestWithParam<int> {};

TEST_P(EveryCollective, MatchesADirectComputationForEveryTypeOpAndSize) {
  const int world = GetParam();
  Comms comms = make(world);
  std::atomic<int> failures{0};
  run_ranks(comms, [&](Communicator& c) {
    const int r = c.rank();
    auto check = [&](const Result<async::Event>& e, const Bytes& got, const Bytes& want, const std::string& what) {
      if (!e || !e->synchronize()) {
        failures++;
        ADD_FAILURE() << what << " on rank " << r << ": " << (e ? "event failed" : e.error().message());
      } else if (got != want) {
        failures++;
        ADD_FAILURE() << what << " on rank " << r << " of " << world << ": wrong result";
      }
    };
    int case_index = 0;
    for (DataType t : kTypes) {
      const std::size_t es = size_of(t);
      for (std::size_t n : kCounts) {
        const std::string tag = std::string(to_string(t)) + " count=" + std::to_string(n);
        {  // all_gather
          Bytes send = values(t, r, 0, n), recv(world * n * es);
          check(c.all_gather(send.data(), recv.data(), n, t), recv, gathered(t, world, n), "all_gather " + tag);
        }
        {  // all_to_all: block q of rank r's send goes to rank q
          Bytes send = values(t, r, 0, world * n), recv(world * n * es);
          check(c.all_to_all(send.data(), recv.data(), n, t), recv, exchanged(t, world, r, n), "all_to_all " + tag);
        }
        {  // all_to_allv: uneven blocks, some empty
          Bytes send = v_send(t, world, r, n), recv(exchanged_v(t, world, r, n).size());
          const auto out = v_send_counts(world, r, n), in = v_recv_counts(world, r, n);
          check(c.all_to_allv(send.data(), out, recv.data(), in, t), recv, exchanged_v(t, world, r, n), "all_to_allv " + tag);
        }
        {  // broadcast from a rotating root; non-roots pass no send buffer
          const int root = case_index++ % world;
          Bytes send = values(t, r, 0, n), recv(n * es);
          check(c.broadcast(r == root ? send.data() : nullptr, recv.data(), n, t, root), recv, values(t, root, 0, n),
                "broadcast root=" + std::to_string(root) + " " + tag);
        }
        for (ReduceOp op : kOps) {
          const std::string otag = tag + " " + std::string(to_string(op));
          {  // reduce_scatter: rank r's block of the reduction over world*n elements
            Bytes send = values(t, r, 0, world * n), recv(n * es);
            check(c.reduce_scatter(send.data(), recv.data(), n, t, op), recv, reduced(t, op, world, r * n, n),
                  "reduce_scatter " + otag);
          }
          {  // all_reduce
            Bytes send = values(t, r, 0, n), recv(n * es);
            check(c.all_reduce(send.data(), recv.data(), n, t, op), recv, reduced(t, op, world, 0, n),
                  "all_reduce " + otag);
          }
        }
      }
    }
  });
  EXPECT_EQ(failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes1To8, EveryCollective, ::testing::Range(1, 9));

TEST(LocalCollectives, AllReduceIsBitIdenticalOnEveryRank) {
  constexpr int kWorld = 5;
  constexpr std::size_t kCount = 100'003;  // not divisible by the world size
  Comms comms = make(kWorld);
  std::vector<std::vector<float>> results(kWorld, std::vector<float>(kCount));
  run_ranks(comms, [&](Communicator& c) {
    std::vector<float> send(kCount);
    for (std::size_t j = 0; j < kCount; ++j) send[j] = 1.0f / static_cast<float>(1 + (j * 31 + c.rank() * 17) % 97);
    auto e = c.all_reduce(send.data(), results[static_cast<std::size_t>(c.rank())].data(), kCount, DataType::f32, ReduceOp::sum);
    ASSERT_TRUE(e && e->synchronize());
  });
  for (int r = 1; r < kWorld; ++r) {
    EXPECT_EQ(std::memcmp(results[0].data(), results[static_cast<std::size_t>(r)].data(), kCount * sizeof(float)), 0)
        << "rank " << r << " differs from rank 0";
  }
}

TEST(LocalCollectives, InPlaceUseGivesTheSameResults) {
  constexpr int kWorld = 4;
  constexpr std::size_t n = 1001;
  Comms comms = make(kWorld);
  std::atomic<int> bad{0};
  run_ranks(comms, [&](Communicator& c) {
    const int r = c.rank();
    const DataType t = DataType::f32;
    // all_gather with send at this rank's block of recv
    Bytes ag(kWorld * n * 4);
    Bytes mine = values(t, r, 0, n);
    std::memcpy(ag.data() + r * n * 4, mine.data(), mine.size());
    auto e1 = c.all_gather(ag.data() + r * n * 4, ag.data(), n, t);
    if (!e1 || !e1->synchronize() || ag != gathered(t, kWorld, n)) { bad++; ADD_FAILURE() << "in-place all_gather on rank " << r; }
    // all_reduce with send == recv
    Bytes ar = values(t, r, 0, n);
    auto e2 = c.all_reduce(ar.data(), ar.data(), n, t, ReduceOp::sum);
    if (!e2 || !e2->synchronize() || ar != reduced(t, ReduceOp::sum, kWorld, 0, n)) { bad++; ADD_FAILURE() << "in-place all_reduce on rank " << r; }
    // reduce_scatter with recv at this rank's block of send (read it only after the event)
    Bytes rs = values(t, r, 0, kWorld * n);
    auto e3 = c.reduce_scatter(rs.data(), rs.data() + r * n * 4, n, t, ReduceOp::max);
    if (!e3 || !e3->synchronize()) {
      bad++;
      ADD_FAILURE() << "in-place reduce_scatter failed on rank " << r;
      return;
    }
    Bytes got(rs.begin() + static_cast<long>(r * n * 4), rs.begin() + static_cast<long>((r + 1) * n * 4));
    if (got != reduced(t, ReduceOp::max, kWorld, r * n, n)) {
      bad++;
      ADD_FAILURE() << "in-place reduce_scatter on rank " << r;
    }
  });
  EXPECT_EQ(bad.load(), 0);
}

TEST(LocalCollectives, ACoalescedGroupIsOneLaunchWithEveryResult) {
  constexpr int kWorld = 3;
  constexpr std::size_t n = 257;
  Comms comms = make(kWorld);
  std::atomic<int> bad{0};
  run_ranks(comms, [&](Communicator& c) {
    const int r = c.rank();
    Bytes ag_send = values(DataType::bf16, r, 0, n), ag_recv(kWorld * n * 2);
    Bytes rs_send = values(DataType::f32, r, 0, kWorld * n), rs_recv(n * 4);
    Bytes ar = values(DataType::i32, r, 0, n);
    const auto before = c.launches();
    auto e = c.launch(Coalesced{}
                          .all_gather(ag_send.data(), ag_recv.data(), n, DataType::bf16)
                          .reduce_scatter(rs_send.data(), rs_recv.data(), n, DataType::f32, ReduceOp::avg)
                          .all_reduce(ar.data(), ar.data(), n, DataType::i32, ReduceOp::sum)
                          .barrier());
    if (!e || !e->synchronize()) {
      bad++;
      return;
    }
    if (c.launches() != before + 1) bad++;
    if (ag_recv != gathered(DataType::bf16, kWorld, n)) bad++;
    if (rs_recv != reduced(DataType::f32, ReduceOp::avg, kWorld, r * n, n)) bad++;
    if (ar != reduced(DataType::i32, ReduceOp::sum, kWorld, 0, n)) bad++;
  });
  EXPECT_EQ(bad.load(), 0);
}

TEST(LocalCollectives, MismatchedSequencesFailEveryRankWithAClearError) {
  Comms comms = make(2, LocalOptions{.timeout = std::chrono::seconds(10)});
  std::vector<std::string> messages(2);
  std::vector<ErrorCode> codes(2, ErrorCode::internal);
  run_ranks(comms, [&](Communicator& c) {
    std::vector<float> a(8), b(16);
    const std::size_t n = c.rank() == 0 ? 4 : 5;  // rank 1 disagrees on the count
    auto e = c.all_gather(a.data(), b.data(), n, DataType::f32, c.rank() == 0 ? "unit a" : "unit b");
    ASSERT_TRUE(e.has_value());
    auto s = e->synchronize();
    ASSERT_FALSE(s.has_value());
    codes[static_cast<std::size_t>(c.rank())] = s.error().code();
    messages[static_cast<std::size_t>(c.rank())] = s.error().message();
  });
  for (int r = 0; r < 2; ++r) {
    EXPECT_EQ(codes[static_cast<std::size_t>(r)], ErrorCode::invalid_argument);
    EXPECT_NE(messages[static_cast<std::size_t>(r)].find("all_gather(count=4, f32) for unit a"), std::string::npos) << messages[static_cast<std::size_t>(r)];
    EXPECT_NE(messages[static_cast<std::size_t>(r)].find("all_gather(count=5, f32) for unit b"), std::string::npos);
  }
}

TEST(LocalCollectives, AMissingPeerFailsTheOthersWithinTheTimeoutNamingIt) {
  Comms comms = make(3, LocalOptions{.timeout = std::chrono::milliseconds(200)});
  std::vector<float> data(64);
  std::vector<std::string> messages(2);
  std::vector<double> waited_ms(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {  // rank 2 never calls
    ranks.emplace_back([&, r] {
      Communicator& c = *comms[static_cast<std::size_t>(r)];
      std::vector<float> out(64);
      const auto t0 = std::chrono::steady_clock::now();
      auto e = c.all_reduce(data.data(), out.data(), 64, DataType::f32, ReduceOp::sum);
      ASSERT_TRUE(e.has_value());
      auto s = e->synchronize();
      waited_ms[static_cast<std::size_t>(r)] = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      ASSERT_FALSE(s.has_value());
      EXPECT_EQ(s.error().code(), ErrorCode::timeout);
      messages[static_cast<std::size_t>(r)] = s.error().message();
      // The group is broken for good: status() says why and the next collective fails at once.
      auto st = c.status();
      ASSERT_FALSE(st.has_value());
      EXPECT_EQ(st.error().code(), ErrorCode::timeout);
      auto again = c.barrier();
      ASSERT_TRUE(again.has_value());
      EXPECT_FALSE(again->synchronize().has_value());
    });
  }
  for (auto& t : ranks) t.join();
  for (int r = 0; r < 2; ++r) {
    EXPECT_NE(messages[static_cast<std::size_t>(r)].find("waiting for ranks [2]"), std::string::npos) << messages[static_cast<std::size_t>(r)];
    EXPECT_GE(waited_ms[static_cast<std::size_t>(r)], 150.0);
    EXPECT_LT(waited_ms[static_cast<std::size_t>(r)], 5000.0);
  }
}

// A rank that fails and aborts frees the peers waiting in a collective at once (the timeout here
// is an hour), each with an error naming the rank and its reason; later collectives fail too.
TEST(LocalCollectives, AnAbortedRankFailsThePeersAtOnceNamingIt) {
  Comms comms = make(3, LocalOptions{.timeout = std::chrono::hours(1)});
  std::vector<float> data(64);
  std::vector<std::string> messages(2);
  std::atomic<int> waiting{0};
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      Communicator& c = *comms[static_cast<std::size_t>(r)];
      std::vector<float> out(64);
      auto e = c.all_reduce(data.data(), out.data(), 64, DataType::f32, ReduceOp::sum);
      ASSERT_TRUE(e.has_value());
      ++waiting;
      auto s = e->synchronize();
      ASSERT_FALSE(s.has_value());
      EXPECT_EQ(s.error().code(), ErrorCode::closed);
      messages[static_cast<std::size_t>(r)] = s.error().message();
      auto again = c.barrier();
      ASSERT_TRUE(again.has_value());
      EXPECT_FALSE(again->synchronize().has_value());
    });
  }
  while (waiting.load() < 2) std::this_thread::yield();
  comms[2]->abort("its data file vanished");
  comms[2]->abort("a second reason is not reported");
  for (auto& t : ranks) t.join();
  for (const auto& m : messages) {
    EXPECT_NE(m.find("rank 2 of Local group of 3 failed: its data file vanished"), std::string::npos) << m;
    EXPECT_EQ(m.find("second"), std::string::npos) << m;
  }
  EXPECT_FALSE(comms[2]->status().has_value());
}

// A rank that fails while its pair waits for it in a collective of a group split from the world
// (a shard group's gather): aborting the world reaches the split groups, so the peer fails at
// once, naming it, not at the timeout.
TEST(LocalCollectives, AnAbortedRankBreaksTheGroupsSplitFromIt) {
  Comms comms = make(4, LocalOptions{.timeout = std::chrono::hours(1)});
  std::vector<std::unique_ptr<Communicator>> pairs(4);
  {
    std::vector<std::thread> splitting;
    for (int r = 0; r < 4; ++r)
      splitting.emplace_back([&, r] {
        auto sub = comms[static_cast<std::size_t>(r)]->split(r / 2, r);
        ASSERT_TRUE(sub.has_value()) << sub.error().message();
        pairs[static_cast<std::size_t>(r)] = std::move(*sub);
      });
    for (auto& t : splitting) t.join();
  }
  std::vector<float> data(64), out(64);
  auto e = pairs[0]->all_reduce(data.data(), out.data(), 64, DataType::f32, ReduceOp::sum);  // rank 1 never comes
  ASSERT_TRUE(e.has_value());
  comms[1]->abort("its data file vanished");
  auto s = e->synchronize();
  ASSERT_FALSE(s.has_value());
  EXPECT_EQ(s.error().code(), ErrorCode::closed);
  EXPECT_NE(s.error().message().find("rank 1 of Local group of 4 failed: its data file vanished"), std::string::npos)
      << s.error().message();
  EXPECT_FALSE(pairs[2]->status().has_value());  // the other pair's group too: the run is over
}

TEST(LocalCollectives, SplitFormsSubgroupsOrderedByKey) {
  constexpr int kWorld = 6;
  Comms comms = make(kWorld);
  std::atomic<int> bad{0};
  run_ranks(comms, [&](Communicator& c) {
    const int color = c.rank() % 2;
    auto sub = c.split(color, /*key=*/-c.rank());  // reversed order within each color
    if (!sub || !*sub) {
      bad++;
      return;
    }
    Communicator& s = **sub;
    if (s.size() != 3) bad++;
    // Old ranks of color 0 are 0,2,4; keys -0,-2,-4 put 4 first.
    const int expected_rank = (kWorld - 1 - c.rank()) / 2;
    if (s.rank() != expected_rank) bad++;
    std::int32_t mine = c.rank(), sum = 0;
    auto e = s.all_reduce(&mine, &sum, 1, DataType::i32, ReduceOp::sum);
    if (!e || !e->synchronize() || sum != (color == 0 ? 0 + 2 + 4 : 1 + 3 + 5)) bad++;
  });
  EXPECT_EQ(bad.load(), 0);
  // A negative color takes no part.
  Comms two = make(2);
  run_ranks(two, [&](Communicator& c) {
    auto sub = c.split(c.rank() == 0 ? -1 : 7, 0);
    ASSERT_TRUE(sub.has_value());
    if (c.rank() == 0) {
      EXPECT_EQ(*sub, nullptr);
    } else {
      ASSERT_NE(*sub, nullptr);
      EXPECT_EQ((*sub)->size(), 1);
    }
  });
}

TEST(LocalCollectives, BadArgumentsAreRejectedBeforeAnythingIsEnqueued) {
  auto none = make_local_communicators(0);
  ASSERT_FALSE(none.has_value());
  EXPECT_NE(none.error().message().find("world_size=0"), std::string::npos);
  Comms comms = make(2);
  float x = 0;
  auto root = comms[0]->broadcast(&x, &x, 1, DataType::f32, 2);
  ASSERT_FALSE(root.has_value());
  EXPECT_NE(root.error().message().find("root=2"), std::string::npos);
  auto null = comms[0]->all_reduce(nullptr, &x, 1, DataType::f32, ReduceOp::sum);
  ASSERT_FALSE(null.has_value());
  EXPECT_EQ(null.error().code(), ErrorCode::invalid_argument);
  float pair[4] = {};
  auto in_place = comms[0]->all_to_all(pair, pair + 1, 1, DataType::f32);  // (2 ranks: 2 floats each way)
  ASSERT_FALSE(in_place.has_value());
  EXPECT_NE(in_place.error().message().find("send and recv overlap (all_to_all is never in place)"), std::string::npos)
      << in_place.error().message();
  const std::size_t one[1] = {1}, two[2] = {1, 1};
  auto short_counts = comms[0]->all_to_allv(pair, one, pair + 2, one, DataType::f32);
  ASSERT_FALSE(short_counts.has_value());
  EXPECT_NE(short_counts.error().message().find("counts for 1 ranks on a communicator of 2"), std::string::npos)
      << short_counts.error().message();
  auto uneven = comms[0]->all_to_allv(pair, two, pair + 2, one, DataType::f32);
  ASSERT_FALSE(uneven.has_value());
  EXPECT_NE(uneven.error().message().find("send_counts and recv_counts differ in length"), std::string::npos)
      << uneven.error().message();
  auto v_in_place = comms[0]->all_to_allv(pair, two, pair + 1, two, DataType::f32);
  ASSERT_FALSE(v_in_place.has_value());
  EXPECT_NE(v_in_place.error().message().find("never in place"), std::string::npos) << v_in_place.error().message();
  EXPECT_EQ(comms[0]->launches(), 0u);
}

// all_to_allv's pairs must agree: rank 0 sending 2 elements where rank 1 expects 1 fails on every
// rank, naming both, instead of reading past a buffer.
TEST(LocalCollectives, AllToAllvWithPairsThatDisagreeFailsNamingThem) {
  Comms comms = make(2);
  std::vector<std::string> errors(2);
  run_ranks(comms, [&](Communicator& c) {
    float send[4] = {1, 2, 3, 4}, recv[4] = {};
    const std::size_t out[2] = {1, c.rank() == 0 ? 2u : 1u}, in[2] = {1, 1};
    auto e = c.all_to_allv(send, out, recv, in, DataType::f32, "routed tokens");
    if (!e) errors[static_cast<std::size_t>(c.rank())] = e.error().message();
    else if (auto done = e->synchronize(); !done) errors[static_cast<std::size_t>(c.rank())] = done.error().message();
  });
  for (const auto& e : errors)
    EXPECT_NE(e.find("rank 0 sends 2 elements to rank 1, which expects 1 from it"), std::string::npos) << e;
}

TEST(LocalCollectives, AwaitingCollectivesFromTasksNeverBlocksTheHost) {
  constexpr int kWorld = 4;
  Comms comms = make(kWorld);
  async::Runtime rt;
  const auto before = async::blocking_waits();
  std::vector<async::JoinHandle<bool>> ranks;
  std::vector<std::vector<float>> bufs(kWorld, std::vector<float>(4096, 1.0f));
  for (int r = 0; r < kWorld; ++r) {
    ranks.push_back(rt.spawn([](Communicator& c, std::vector<float>& buf) -> async::Task<bool> {
      for (int i = 0; i < 20; ++i) {
        auto e = c.all_reduce(buf.data(), buf.data(), buf.size(), DataType::f32, ReduceOp::avg);
        if (!e) co_return false;
        if (!(co_await *e)) co_return false;
      }
      co_return buf[0] == 1.0f;
    }(*comms[static_cast<std::size_t>(r)], bufs[static_cast<std::size_t>(r)])));
  }
  for (auto& h : ranks) {
    auto ok = rt.block_on([](async::JoinHandle<bool>& h) -> async::Task<Result<bool>> { co_return co_await h; }(h));
    ASSERT_TRUE(ok.has_value());
    EXPECT_TRUE(*ok);
  }
  EXPECT_EQ(async::blocking_waits(), before);
}

TEST(DataTypes, HalfAndBfloatConversionsRoundToNearestEven) {
  EXPECT_EQ(float_to_bf16(1.0f), 0x3F80);
  EXPECT_EQ(float_to_bf16(1.00390625f), 0x3F80);  // exactly half way: ties to even (down)
  EXPECT_EQ(float_to_bf16(1.01171875f), 0x3F82);  // half way above an odd mantissa: up
  EXPECT_EQ(bf16_to_float(0xC000), -2.0f);
  EXPECT_EQ(float_to_f16(1.0f), 0x3C00);
  EXPECT_EQ(float_to_f16(65504.0f), 0x7BFF);
  EXPECT_EQ(float_to_f16(65520.0f), 0x7C00);      // rounds to infinity
  EXPECT_EQ(float_to_f16(5.960464477539063e-08f), 0x0001);  // smallest subnormal
  EXPECT_EQ(f16_to_float(0x0001), 5.960464477539063e-08f);
  EXPECT_EQ(f16_to_float(0xFC00), -std::numeric_limits<float>::infinity());
#if defined(__FLT16_MAX__) && defined(__GNUC__) && !defined(__clang__)
  // Against the compiler's own _Float16: every half round-trips; sampled floats round alike.
  for (std::uint32_t h = 0; h < 65536; ++h) {
    const auto x = static_cast<std::uint16_t>(h);
    const float ref = static_cast<float>(std::bit_cast<_Float16>(x));
    if (ref != ref) continue;
    ASSERT_EQ(std::bit_cast<std::uint32_t>(f16_to_float(x)), std::bit_cast<std::uint32_t>(ref)) << h;
    ASSERT_EQ(float_to_f16(ref), x) << h;
  }
  for (std::uint32_t u = 0; u < 0xFFFF0000u; u += 65521u) {
    const float f = std::bit_cast<float>(u);
    if (f != f) continue;
    ASSERT_EQ(float_to_f16(f), std::bit_cast<std::uint16_t>(static_cast<_Float16>(f))) << f;
  }
#endif
}

}  // namespace
}  // namespace coshard::collectives
