// The MPI backend, one rank per process: CTest starts this binary under mpirun with 2 and 4
// processes (loopback only). Each process runs every test; a test's collectives meet across them.
#include "coshard/collectives/mpi.hpp"

#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/async/sync.hpp"
#include "coshard/collectives/flight_recorder.hpp"
#include "coshard/collectives/local.hpp"
#include "reference.hpp"

namespace coshard::collectives {
namespace {

using namespace reference;
using Clock = std::chrono::steady_clock;

// A bounded timeout: a test that goes wrong on one rank fails the others instead of hanging.
std::unique_ptr<Communicator> make(std::chrono::milliseconds timeout = std::chrono::seconds(60)) {
  auto comm = make_mpi_communicator({.timeout = timeout});
  EXPECT_TRUE(comm.has_value()) << (comm ? "" : comm.error().message());
  return comm ? std::move(*comm) : nullptr;
}

Result<void> finish(const Result<async::Event>& e) {
  if (!e) return fail(e.error());
  return e->synchronize();
}

TEST(Mpi, RanksAreTheLaunchersProcesses) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  EXPECT_EQ(c->backend(), "mpi");
  EXPECT_GE(c->size(), 2) << "run this binary under mpirun -np N (N >= 2)";
  const char* rank = std::getenv("OMPI_COMM_WORLD_RANK");
  if (rank != nullptr) EXPECT_EQ(c->rank(), std::atoi(rank));
  EXPECT_FALSE(c->stream().device().is_cuda());
  EXPECT_NE(c->flight_recorder(), nullptr);
}

// Every collective, type, reduction and size against the reference (reductions in rank order:
// what the Local backend gives, bit for bit).
TEST(Mpi, EveryCollectiveMatchesTheReferenceForEveryTypeOpAndSize) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  const int r = c->rank(), world = c->size();
  auto check = [&](const Result<async::Event>& e, const Bytes& got, const Bytes& want, const std::string& what) {
    auto done = finish(e);
    if (!done) {
      ADD_FAILURE() << what << " on rank " << r << ": " << done.error().message();
    } else if (got != want) {
      ADD_FAILURE() << what << " on rank " << r << " of " << world << ": wrong result";
    }
  };
  int case_index = 0;
  for (DataType t : kTypes) {
    const std::size_t es = size_of(t);
    for (std::size_t n : kCounts) {
      const std::string tag = std::string(to_string(t)) + " count=" + std::to_string(n);
      {
        Bytes send = values(t, r, 0, n), recv(world * n * es);
        check(c->all_gather(send.data(), recv.data(), n, t), recv, gathered(t, world, n), "all_gather " + tag);
      }
      {
        Bytes send = values(t, r, 0, world * n), recv(world * n * es);
        check(c->all_to_all(send.data(), recv.data(), n, t), recv, exchanged(t, world, r, n), "all_to_all " + tag);
      }
      {  // all_to_allv: uneven blocks, some empty
        Bytes send = v_send(t, world, r, n), recv(exchanged_v(t, world, r, n).size());
        const auto out = v_send_counts(world, r, n), in = v_recv_counts(world, r, n);
        check(c->all_to_allv(send.data(), out, recv.data(), in, t), recv, exchanged_v(t, world, r, n), "all_to_allv " + tag);
      }
      {
        const int root = case_index++ % world;
        Bytes send = values(t, r, 0, n), recv(n * es);
        check(c->broadcast(r == root ? send.data() : nullptr, recv.data(), n, t, root), recv, values(t, root, 0, n),
              "broadcast root=" + std::to_string(root) + " " + tag);
      }
      for (ReduceOp op : kOps) {
        const std::string otag = tag + " " + std::string(to_string(op));
        {
          Bytes send = values(t, r, 0, world * n), recv(n * es);
          check(c->reduce_scatter(send.data(), recv.data(), n, t, op), recv, reduced(t, op, world, r * n, n),
                "reduce_scatter " + otag);
        }
        {
          Bytes send = values(t, r, 0, n), recv(n * es);
          check(c->all_reduce(send.data(), recv.data(), n, t, op), recv, reduced(t, op, world, 0, n), "all_reduce " + otag);
        }
      }
    }
  }
  EXPECT_TRUE(finish(c->barrier()));
}

// The same data through the Local backend in this process (its ranks as threads) and through MPI
// across the processes: the same bits, for a size that does not divide by the world.
TEST(Mpi, ResultsEqualTheLocalBackendsBitForBit) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  const int r = c->rank(), world = c->size();
  constexpr std::size_t kCount = 300'007;
  for (DataType t : {DataType::f32, DataType::bf16}) {
    const std::size_t es = size_of(t);
    std::vector<Bytes> local_out(static_cast<std::size_t>(world), Bytes(kCount * es));
    std::vector<Bytes> local_rs(static_cast<std::size_t>(world), Bytes(kCount * es));
    auto locals = make_local_communicators(world);
    ASSERT_TRUE(locals.has_value());
    std::vector<std::thread> threads;
    for (int q = 0; q < world; ++q) {
      threads.emplace_back([&, q] {
        auto& lc = *(*locals)[static_cast<std::size_t>(q)];
        Bytes send = values(t, q, 0, kCount);
        Bytes big = values(t, q, 0, kCount * static_cast<std::size_t>(world));
        EXPECT_TRUE(finish(lc.all_reduce(send.data(), local_out[static_cast<std::size_t>(q)].data(), kCount, t, ReduceOp::sum)));
        EXPECT_TRUE(finish(lc.reduce_scatter(big.data(), local_rs[static_cast<std::size_t>(q)].data(), kCount, t, ReduceOp::avg)));
      });
    }
    for (auto& th : threads) th.join();
    Bytes send = values(t, r, 0, kCount), out(kCount * es), rs(kCount * es);
    Bytes big = values(t, r, 0, kCount * static_cast<std::size_t>(world));
    ASSERT_TRUE(finish(c->all_reduce(send.data(), out.data(), kCount, t, ReduceOp::sum)));
    ASSERT_TRUE(finish(c->reduce_scatter(big.data(), rs.data(), kCount, t, ReduceOp::avg)));
    EXPECT_EQ(out, local_out[static_cast<std::size_t>(r)]) << to_string(t) << " all_reduce";
    EXPECT_EQ(rs, local_rs[static_cast<std::size_t>(r)]) << to_string(t) << " reduce_scatter";
  }
}

TEST(Mpi, InPlaceUseGivesTheSameResults) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  const int r = c->rank(), world = c->size();
  const DataType t = DataType::f32;
  constexpr std::size_t n = 1001;
  const std::size_t block = n * 4;
  {  // all_gather with send at this rank's block of recv
    Bytes buf(world * block);
    Bytes mine = values(t, r, 0, n);
    std::memcpy(buf.data() + r * block, mine.data(), block);
    ASSERT_TRUE(finish(c->all_gather(buf.data() + r * block, buf.data(), n, t)));
    EXPECT_EQ(buf, gathered(t, world, n));
  }
  {  // reduce_scatter with recv at this rank's block of send
    Bytes buf = values(t, r, 0, world * n);
    ASSERT_TRUE(finish(c->reduce_scatter(buf.data(), buf.data() + r * block, n, t, ReduceOp::sum)));
    EXPECT_EQ(Bytes(buf.begin() + r * block, buf.begin() + (r + 1) * block), reduced(t, ReduceOp::sum, world, r * n, n));
  }
  {  // all_reduce and broadcast with send == recv
    Bytes buf = values(t, r, 0, n);
    ASSERT_TRUE(finish(c->all_reduce(buf.data(), buf.data(), n, t, ReduceOp::max)));
    EXPECT_EQ(buf, reduced(t, ReduceOp::max, world, 0, n));
    Bytes b = values(t, r, 0, n);
    ASSERT_TRUE(finish(c->broadcast(b.data(), b.data(), n, t, world - 1)));
    EXPECT_EQ(b, values(t, world - 1, 0, n));
  }
}

TEST(Mpi, ACoalescedGroupIsOneLaunchWithEveryResult) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  const int r = c->rank(), world = c->size();
  const DataType t = DataType::bf16;
  constexpr std::size_t n = 513;
  Bytes ag_send = values(t, r, 0, n), ag_recv(world * n * 2);
  Bytes rs_send = values(t, r, 0, world * n), rs_recv(n * 2);
  Bytes ar = values(t, r, 0, n);
  Bytes bc(n * 2);
  Bytes root_data = values(t, 0, 0, n);
  const auto before = c->launches();
  Coalesced group;
  group.all_gather(ag_send.data(), ag_recv.data(), n, t)
      .reduce_scatter(rs_send.data(), rs_recv.data(), n, t, ReduceOp::avg)
      .all_reduce(ar.data(), ar.data(), n, t, ReduceOp::sum)
      .broadcast(r == 0 ? root_data.data() : nullptr, bc.data(), n, t, 0)
      .barrier();
  ASSERT_TRUE(finish(c->launch(group)));
  EXPECT_EQ(c->launches(), before + 1);
  EXPECT_EQ(ag_recv, gathered(t, world, n));
  EXPECT_EQ(rs_recv, reduced(t, ReduceOp::avg, world, r * n, n));
  EXPECT_EQ(ar, reduced(t, ReduceOp::sum, world, 0, n));
  EXPECT_EQ(bc, root_data);
}

TEST(Mpi, SplitFormsSubgroupsOrderedByKey) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  const int r = c->rank(), world = c->size();
  // Colors by parity, keys reversed; the last rank of an odd world stays out (negative color).
  const int color = (world % 2 == 1 && r == world - 1) ? -1 : r % 2;
  auto sub = c->split(color, -r);
  ASSERT_TRUE(sub.has_value()) << sub.error().message();
  if (color < 0) {
    EXPECT_EQ(*sub, nullptr);
    return;
  }
  ASSERT_NE(*sub, nullptr);
  std::vector<int> members;
  for (int q = world - 1; q >= 0; --q) {
    if (q % 2 == color && !(world % 2 == 1 && q == world - 1)) members.push_back(q);
  }
  EXPECT_EQ((*sub)->size(), static_cast<int>(members.size()));
  EXPECT_EQ(members[static_cast<std::size_t>((*sub)->rank())], r);
  std::int32_t mine = r, sum = 0;
  ASSERT_TRUE(finish((*sub)->all_reduce(&mine, &sum, 1, DataType::i32, ReduceOp::sum)));
  std::int32_t want = 0;
  for (int q : members) want += q;
  EXPECT_EQ(sum, want);
}

TEST(Mpi, AwaitingCollectivesFromATaskNeverBlocksTheHost) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  async::Runtime rt;
  const auto before = async::blocking_waits();
  auto sum = rt.block_on([](Communicator& comm) -> async::Task<Result<float>> {
    float value = static_cast<float>(comm.rank() + 1), total = 0;
    for (int i = 0; i < 20; ++i) {
      COSHARD_CO_TRY_ASSIGN(auto e, comm.all_reduce(&value, &total, 1, DataType::f32, ReduceOp::sum));
      COSHARD_CO_TRY(co_await e);
    }
    co_return total;
  }(*c));
  EXPECT_EQ(async::blocking_waits(), before);
  ASSERT_TRUE(sum.has_value()) << sum.error().message();
  const int w = c->size();
  EXPECT_EQ(*sum, static_cast<float>(w * (w + 1) / 2));
}

TEST(Mpi, BadArgumentsAreRefusedBeforeAnythingIsSent) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  float x = 0;
  auto bad = c->all_reduce(&x, nullptr, 1, DataType::f32, ReduceOp::sum);
  ASSERT_FALSE(bad.has_value());
  EXPECT_NE(bad.error().message().find("recv"), std::string::npos) << bad.error().message();
  auto root = c->broadcast(&x, &x, 1, DataType::f32, c->size());
  ASSERT_FALSE(root.has_value());
  EXPECT_EQ(c->launches(), 0u);
  EXPECT_TRUE(finish(c->barrier()));  // nothing was sent: the ranks still agree
  EXPECT_FALSE(make_mpi_communicator({.timeout = std::chrono::milliseconds(0)}).has_value());
}

// Rank 1 launches a different count: every rank fails with an error that names both sides.
TEST(Mpi, MismatchedSequencesFailEveryRankWithAClearError) {
  auto c = make();
  ASSERT_NE(c, nullptr);
  const int r = c->rank();
  std::vector<float> send(8, 1.0f), recv(8);
  const std::size_t n = r == 1 ? 8 : 4;
  const std::string purpose = r == 1 ? "the branch only rank 1 runs" : "what the others run";
  auto done = finish(c->all_reduce(send.data(), recv.data(), n, DataType::f32, ReduceOp::sum, purpose));
  ASSERT_FALSE(done.has_value());
  EXPECT_NE(done.error().message().find("collective sequence mismatch"), std::string::npos) << done.error().message();
  // Each side's purpose: this rank's in its own ops, the peer's from its header.
  EXPECT_NE(done.error().message().find("for " + purpose), std::string::npos) << done.error().message();
  if (r == 0)
    EXPECT_NE(done.error().message().find("with other ops (another kind, count, type, reduction or root) for the "
                                          "branch only rank 1 runs"),
              std::string::npos)
        << done.error().message();
  EXPECT_FALSE(c->status().has_value());
  // A broken communicator refuses later launches at once.
  EXPECT_FALSE(c->barrier().has_value());
}

// A rank that failed aborts its communicator: the peers' collectives fail at once, naming it
// and its reason, long before the timeout.
TEST(Mpi, AnAbortedRankFailsThePeersAtOnceNamingIt) {
  auto c = make(std::chrono::minutes(5));
  ASSERT_NE(c, nullptr);
  const int r = c->rank();
  // (Rank 1 aborts before launching: a peer that hears the notice while a group is still open
  // fails it, so a group before the abort could fail too on a rank that was slower.)
  if (r == 1) {
    c->abort("injected failure in the test");
    EXPECT_FALSE(c->status().has_value());
    EXPECT_FALSE(c->barrier().has_value());
    return;
  }
  const auto start = Clock::now();
  float x = 1, y = 0;
  auto done = finish(c->all_reduce(&x, &y, 1, DataType::f32, ReduceOp::sum));
  ASSERT_FALSE(done.has_value());
  EXPECT_LT(Clock::now() - start, std::chrono::minutes(1));
  EXPECT_EQ(done.error().code(), ErrorCode::closed);
  EXPECT_NE(done.error().message().find("rank 1"), std::string::npos) << done.error().message();
  EXPECT_NE(done.error().message().find("injected failure in the test"), std::string::npos) << done.error().message();
}

// A rank that fails while its pair waits for it in a communicator split from the world (a shard
// group's collective): aborting the world reaches the split communicators too, so the peer fails
// at once, naming the reason, not at the timeout.
TEST(Mpi, AnAbortedRankBreaksTheCommunicatorsSplitFromIt) {
  auto c = make(std::chrono::minutes(5));
  ASSERT_NE(c, nullptr);
  const int r = c->rank();
  auto pair = c->split(r / 2, r);
  ASSERT_TRUE(pair.has_value()) << pair.error().message();
  ASSERT_NE(*pair, nullptr);
  if (r == 1) {
    c->abort("injected failure in a shard group");
    EXPECT_FALSE((*pair)->status().has_value());
    return;
  }
  if (r != 0) return;  // (the other pairs have no part in it)
  const auto start = Clock::now();
  float x = 1, y = 0;
  auto done = finish((*pair)->all_reduce(&x, &y, 1, DataType::f32, ReduceOp::sum));
  ASSERT_FALSE(done.has_value());
  EXPECT_LT(Clock::now() - start, std::chrono::minutes(1));
  EXPECT_EQ(done.error().code(), ErrorCode::closed);
  EXPECT_NE(done.error().message().find("injected failure in a shard group"), std::string::npos) << done.error().message();
}

// The last rank never launches: the others fail within the timeout, naming it and the last
// group it reached; the flight recorder's record says the same.
TEST(Mpi, AMissingPeerFailsTheOthersWithinTheTimeoutNamingIt) {
  auto c = make(std::chrono::milliseconds(1500));
  ASSERT_NE(c, nullptr);
  const int r = c->rank(), world = c->size();
  ASSERT_TRUE(finish(c->barrier()));  // group #0: everyone
  if (r == world - 1) return;
  const auto start = Clock::now();
  auto done = finish(c->barrier());  // group #1: the last rank is missing
  ASSERT_FALSE(done.has_value());
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(30));
  EXPECT_EQ(done.error().code(), ErrorCode::timeout);
  const std::string missing = "rank " + std::to_string(world - 1) + " (the last group it reached here: #0)";
  EXPECT_NE(done.error().message().find(missing), std::string::npos) << done.error().message();
  const auto ring = c->flight_recorder()->snapshot();
  ASSERT_EQ(ring.size(), 2u);
  EXPECT_EQ(ring[0].state, CollectiveState::completed);
  EXPECT_EQ(ring[1].state, CollectiveState::failed);
}

}  // namespace
}  // namespace coshard::collectives
