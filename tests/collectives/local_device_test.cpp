// The Local backend with its ranks sharing one GPU: every collective against the reference and
// bit for bit against the CPU backend, in-place use, coalesced groups, split, and the failures
// (a sequence mismatch, a missing rank, a buffer the device cannot read). Skips without a GPU,
// except the refusal of a device this machine lacks.
#include <gtest/gtest.h>

#include <atomic>
#include <functional>
#include <thread>
#include <vector>

#include "coshard/async/memory.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/collectives/local.hpp"
#include "reference.hpp"

namespace coshard::collectives {
namespace {

using namespace reference;
using Comms = std::vector<std::unique_ptr<Communicator>>;

bool have_gpu() { return async::cuda_compiled() && async::cuda_device_count() > 0; }

Comms make_on_gpu(int world, LocalOptions options = {}) {
  options.device = async::Device::cuda(0);
  auto comms = make_local_communicators(world, options);
  EXPECT_TRUE(comms.has_value()) << (comms ? "" : comms.error().message());
  return comms ? std::move(*comms) : Comms{};
}

void run_ranks(Comms& comms, const std::function<void(Communicator&)>& fn) {
  std::vector<std::thread> threads;
  for (auto& c : comms) threads.emplace_back([&fn, &c] { fn(*c); });
  for (auto& t : threads) t.join();
}

// One rank's device memory, filled from and read back to the host on its communication stream.
class DeviceBuffers {
 public:
  explicit DeviceBuffers(Communicator& c) : c_(c), alloc_(std::move(*async::CachingAllocator::create(c.stream().device()))) {}

  // A device copy of `host`, with room for at least `bytes`.
  void* upload(const Bytes& host, std::size_t bytes = 0) {
    auto block = alloc_->allocate(std::max<std::size_t>({bytes, host.size(), 1}), c_.stream());
    EXPECT_TRUE(block.has_value());
    if (!host.empty()) EXPECT_TRUE(c_.stream().copy(block->data(), host.data(), host.size()));
    blocks_.push_back(std::move(*block));
    return blocks_.back().data();
  }
  Bytes download(const void* p, std::size_t bytes) {
    Bytes out(bytes);
    if (bytes > 0) EXPECT_TRUE(c_.stream().copy(out.data(), p, bytes));
    auto done = c_.stream().record();
    EXPECT_TRUE(done && done->synchronize());
    return out;
  }
  void clear() {
    for (auto& b : blocks_) b.reset();
    blocks_.clear();
  }

 private:
  Communicator& c_;
  std::unique_ptr<async::CachingAllocator> alloc_;
  std::vector<async::Block> blocks_;
};

TEST(LocalOnGpu, ADeviceThisMachineLacksIsRefusedWithAClearError) {
  auto comms = make_local_communicators(2, {.device = async::Device::cuda(async::cuda_device_count())});
  ASSERT_FALSE(comms.has_value());
  const std::string message = comms.error().message();
  EXPECT_NE(message.find("cuda:" + std::to_string(async::cuda_device_count())), std::string::npos) << message;
  if (have_gpu()) {
    auto too_many = make_local_communicators(65, {.device = async::Device::cuda(0)});
    ASSERT_FALSE(too_many.has_value());
    EXPECT_NE(too_many.error().message().find("at most 64 ranks"), std::string::npos) << too_many.error().message();
  }
}

class EveryCollectiveOnGpu : public ::testing::TestWithParam<int> {};

TEST_P(EveryCollectiveOnGpu, MatchesTheReferenceForEveryTypeOpAndSize) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  const int world = GetParam();
  Comms comms = make_on_gpu(world);
  std::atomic<int> failures{0};
  run_ranks(comms, [&](Communicator& c) {
    const int r = c.rank();
    DeviceBuffers mem(c);
    auto check = [&](const Result<async::Event>& e, const void* recv, const Bytes& want, const std::string& what) {
      if (!e) {
        failures++;
        ADD_FAILURE() << what << " on rank " << r << ": " << e.error().message();
        return;
      }
      if (mem.download(recv, want.size()) != want) {
        failures++;
        ADD_FAILURE() << what << " on rank " << r << " of " << world << ": wrong result";
      }
      mem.clear();
    };
    int case_index = 0;
    for (DataType t : kTypes) {
      const std::size_t es = size_of(t);
      for (std::size_t n : kCounts) {
        const std::string tag = std::string(to_string(t)) + " count=" + std::to_string(n);
        {
          void* send = mem.upload(values(t, r, 0, n));
          void* recv = mem.upload({}, world * n * es);
          check(c.all_gather(send, recv, n, t), recv, gathered(t, world, n), "all_gather " + tag);
        }
        {
          void* send = mem.upload(values(t, r, 0, world * n));
          void* recv = mem.upload({}, world * n * es);
          check(c.all_to_all(send, recv, n, t), recv, exchanged(t, world, r, n), "all_to_all " + tag);
        }
        {  // all_to_allv: uneven blocks, some empty
          const Bytes want = exchanged_v(t, world, r, n);
          void* send = mem.upload(v_send(t, world, r, n));
          void* recv = mem.upload({}, want.size() + es);  // (a byte at least: an empty receive is still a buffer)
          check(c.all_to_allv(send, v_send_counts(world, r, n), recv, v_recv_counts(world, r, n), t), recv, want,
                "all_to_allv " + tag);
        }
        {
          const int root = case_index++ % world;
          void* send = mem.upload(values(t, r, 0, n));
          void* recv = mem.upload({}, n * es);
          check(c.broadcast(r == root ? send : nullptr, recv, n, t, root), recv, values(t, root, 0, n),
                "broadcast root=" + std::to_string(root) + " " + tag);
        }
        for (ReduceOp op : kOps) {
          const std::string otag = tag + " " + std::string(to_string(op));
          {
            void* send = mem.upload(values(t, r, 0, world * n));
            void* recv = mem.upload({}, n * es);
            check(c.reduce_scatter(send, recv, n, t, op), recv, reduced(t, op, world, r * n, n),
                  "reduce_scatter " + otag);
          }
          {
            void* send = mem.upload(values(t, r, 0, n));
            void* recv = mem.upload({}, n * es);
            check(c.all_reduce(send, recv, n, t, op), recv, reduced(t, op, world, 0, n), "all_reduce " + otag);
          }
        }
      }
    }
  });
  EXPECT_EQ(failures.load(), 0);
}

INSTANTIATE_TEST_SUITE_P(WorldSizes1To8, EveryCollectiveOnGpu, ::testing::Range(1, 9));

// Large, uneven sizes: the GPU's results equal the CPU backend's bit for bit, on every rank.
TEST(LocalOnGpu, LargeReductionsAreBitIdenticalToTheCpuBackend) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int kWorld = 5;
  constexpr std::size_t kCount = 1'000'003;
  auto input = [](int rank, std::size_t j) { return 1.0f / static_cast<float>(1 + (j * 31 + rank * 17) % 97); };
  std::vector<std::vector<float>> cpu_ar(kWorld), cpu_rs(kWorld), gpu_ar(kWorld), gpu_rs(kWorld);
  {
    auto cpu = make_local_communicators(kWorld);
    ASSERT_TRUE(cpu.has_value());
    run_ranks(*cpu, [&](Communicator& c) {
      const auto r = static_cast<std::size_t>(c.rank());
      std::vector<float> send(kWorld * kCount);
      for (std::size_t j = 0; j < send.size(); ++j) send[j] = input(c.rank(), j);
      cpu_ar[r].resize(kCount);
      cpu_rs[r].resize(kCount);
      auto a = c.all_reduce(send.data(), cpu_ar[r].data(), kCount, DataType::f32, ReduceOp::sum);
      auto b = c.reduce_scatter(send.data(), cpu_rs[r].data(), kCount, DataType::f32, ReduceOp::avg);
      ASSERT_TRUE(a && a->synchronize() && b && b->synchronize());
    });
  }
  Comms gpu = make_on_gpu(kWorld);
  run_ranks(gpu, [&](Communicator& c) {
    const auto r = static_cast<std::size_t>(c.rank());
    DeviceBuffers mem(c);
    std::vector<float> host(kWorld * kCount);
    for (std::size_t j = 0; j < host.size(); ++j) host[j] = input(c.rank(), j);
    Bytes bytes(host.size() * 4);
    std::memcpy(bytes.data(), host.data(), bytes.size());
    void* send = mem.upload(bytes);
    void* ar = mem.upload({}, kCount * 4);
    void* rs = mem.upload({}, kCount * 4);
    auto group = Coalesced{}.all_reduce(send, ar, kCount, DataType::f32, ReduceOp::sum)
                     .reduce_scatter(send, rs, kCount, DataType::f32, ReduceOp::avg);
    auto e = c.launch(group);
    ASSERT_TRUE(e.has_value()) << e.error().message();
    for (auto [dst, src] : {std::pair{&gpu_ar[r], ar}, std::pair{&gpu_rs[r], rs}}) {
      Bytes back = mem.download(src, kCount * 4);
      dst->resize(kCount);
      std::memcpy(dst->data(), back.data(), back.size());
    }
  });
  for (std::size_t r = 0; r < kWorld; ++r) {
    EXPECT_EQ(gpu_ar[r], cpu_ar[r]) << "all_reduce on rank " << r;
    EXPECT_EQ(gpu_rs[r], cpu_rs[r]) << "reduce_scatter on rank " << r;
    EXPECT_EQ(gpu_ar[r], gpu_ar[0]) << "rank " << r << " differs from rank 0";
  }
}

TEST(LocalOnGpu, InPlaceUseAndCoalescedGroupsGiveTheReferenceResults) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int kWorld = 4;
  constexpr std::size_t n = 1001;
  const DataType t = DataType::f32;
  Comms comms = make_on_gpu(kWorld);
  std::atomic<int> bad{0};
  run_ranks(comms, [&](Communicator& c) {
    const int r = c.rank();
    DeviceBuffers mem(c);
    // all_gather with send at this rank's block of recv
    Bytes ag(kWorld * n * 4);
    const Bytes mine = values(t, r, 0, n);
    std::memcpy(ag.data() + r * n * 4, mine.data(), mine.size());
    auto* ag_dev = static_cast<std::byte*>(mem.upload(ag));
    // all_reduce with send == recv; reduce_scatter with recv at this rank's block of send
    auto* ar_dev = mem.upload(values(t, r, 0, n));
    auto* rs_dev = static_cast<std::byte*>(mem.upload(values(t, r, 0, kWorld * n)));
    auto group = Coalesced{}
                     .all_gather(ag_dev + r * n * 4, ag_dev, n, t)
                     .all_reduce(ar_dev, ar_dev, n, t, ReduceOp::sum)
                     .reduce_scatter(rs_dev, rs_dev + r * n * 4, n, t, ReduceOp::max)
                     .barrier();
    const std::uint64_t before = c.launches();
    auto e = c.launch(group);
    if (!e) {
      bad++;
      ADD_FAILURE() << e.error().message();
      return;
    }
    if (c.launches() != before + 1) { bad++; ADD_FAILURE() << "a group is one launch"; }
    if (mem.download(ag_dev, ag.size()) != gathered(t, kWorld, n)) { bad++; ADD_FAILURE() << "in-place all_gather on rank " << r; }
    if (mem.download(ar_dev, n * 4) != reduced(t, ReduceOp::sum, kWorld, 0, n)) { bad++; ADD_FAILURE() << "in-place all_reduce on rank " << r; }
    if (mem.download(rs_dev + r * n * 4, n * 4) != reduced(t, ReduceOp::max, kWorld, r * n, n)) {
      bad++;
      ADD_FAILURE() << "in-place reduce_scatter on rank " << r;
    }
  });
  EXPECT_EQ(bad.load(), 0);
}

TEST(LocalOnGpu, SplitFormsSubgroupsOnTheSameDevice) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  constexpr int kWorld = 4;
  Comms comms = make_on_gpu(kWorld);
  std::atomic<int> bad{0};
  run_ranks(comms, [&](Communicator& c) {
    auto sub = c.split(c.rank() % 2, -c.rank());  // odd and even ranks, in reverse order
    if (!sub || !*sub) { bad++; ADD_FAILURE() << "split failed"; return; }
    Communicator& s = **sub;
    if (!s.stream().device().is_cuda() || s.size() != 2) { bad++; ADD_FAILURE() << "subgroup not on the GPU"; return; }
    DeviceBuffers mem(s);
    Bytes one(4);
    const float mine = static_cast<float>(c.rank());
    std::memcpy(one.data(), &mine, 4);
    void* p = mem.upload(one);
    auto e = s.all_reduce(p, p, 1, DataType::f32, ReduceOp::sum);
    if (!e) { bad++; ADD_FAILURE() << e.error().message(); return; }
    float got = 0;
    const Bytes back = mem.download(p, 4);
    std::memcpy(&got, back.data(), 4);
    const float want = c.rank() % 2 == 0 ? 0.0f + 2.0f : 1.0f + 3.0f;
    if (got != want) { bad++; ADD_FAILURE() << "rank " << c.rank() << " got " << got << ", want " << want; }
  });
  EXPECT_EQ(bad.load(), 0);
}

TEST(LocalOnGpu, MismatchedGroupsFailEveryRankNamingBoth) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Comms comms = make_on_gpu(2);
  std::vector<std::string> errors(2);
  run_ranks(comms, [&](Communicator& c) {
    DeviceBuffers mem(c);
    void* p = mem.upload({}, 64 * 4);
    auto e = c.rank() == 0 ? c.all_reduce(p, p, 16, DataType::f32, ReduceOp::sum)
                           : c.all_reduce(p, p, 32, DataType::f32, ReduceOp::sum);
    ASSERT_FALSE(e.has_value());
    errors[static_cast<std::size_t>(c.rank())] = e.error().message();
    auto later = c.barrier();  // the group stays failed
    ASSERT_FALSE(later.has_value());
  });
  for (const auto& m : errors) {
    EXPECT_NE(m.find("collective sequence mismatch"), std::string::npos) << m;
    EXPECT_NE(m.find("count=16"), std::string::npos) << m;
    EXPECT_NE(m.find("count=32"), std::string::npos) << m;
  }
}

TEST(LocalOnGpu, AMissingRankFailsTheOthersWithinTheTimeoutNamingIt) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Comms comms = make_on_gpu(3, {.timeout = std::chrono::milliseconds(200)});
  std::vector<std::string> errors(3);
  run_ranks(comms, [&](Communicator& c) {
    if (c.rank() == 2) return;  // never launches
    const auto start = std::chrono::steady_clock::now();
    auto e = c.barrier();
    const auto waited = std::chrono::steady_clock::now() - start;
    ASSERT_FALSE(e.has_value());
    EXPECT_EQ(e.error().code(), ErrorCode::timeout);
    EXPECT_LT(waited, std::chrono::seconds(5));
    errors[static_cast<std::size_t>(c.rank())] = e.error().message();
  });
  for (int r = 0; r < 2; ++r) {
    const auto& m = errors[static_cast<std::size_t>(r)];
    EXPECT_NE(m.find("[2]"), std::string::npos) << m;
    EXPECT_NE(m.find("cuda:0"), std::string::npos) << m;
  }
}

TEST(LocalOnGpu, ABufferTheDeviceCannotReadIsRefusedBeforeAnythingRuns) {
  if (!have_gpu()) GTEST_SKIP() << "no CUDA device";
  Comms comms = make_on_gpu(1);
  std::vector<float> pageable(16, 1.0f);
  auto e = comms[0]->all_reduce(pageable.data(), pageable.data(), 16, DataType::f32, ReduceOp::sum);
  ASSERT_FALSE(e.has_value());
  EXPECT_EQ(e.error().code(), ErrorCode::invalid_argument);
  EXPECT_NE(e.error().message().find("pageable host memory"), std::string::npos) << e.error().message();
  // Nothing was enqueued, so the communicator and the device still work.
  DeviceBuffers mem(*comms[0]);
  Bytes one(4);
  const float v = 2.5f;
  std::memcpy(one.data(), &v, 4);
  void* p = mem.upload(one);
  auto ok = comms[0]->all_reduce(p, p, 1, DataType::f32, ReduceOp::sum);
  ASSERT_TRUE(ok.has_value()) << ok.error().message();
  EXPECT_EQ(mem.download(p, 4), one);
}

}  // namespace
}  // namespace coshard::collectives
