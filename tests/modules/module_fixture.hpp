// A runtime, a CPU stream, an allocator and a Context, for tests of modules on the CPU backend.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/module.hpp"
#include "support/reference_math.hpp"

namespace coshard::modules::testing {

using coshard::testing::normwise_error;
using coshard::testing::random_values;

// The normwise tolerance of a layer's result computed in `dt` against an f32 reference: bf16's
// and f16's rounding, or for f32 (on CUDA) another order of sums and rsqrtf.
inline double dtype_tolerance(DataType dt) {
  switch (dt) {
    case DataType::bf16: return 3e-2;
    case DataType::f16: return 5e-3;
    default: return 1e-4;
  }
}

// Skips the test where no CUDA device is present (CI and the build machines compile, never run).
#define COSHARD_SKIP_WITHOUT_CUDA()                                                         \
  do {                                                                                      \
    if (!::coshard::async::cuda_compiled() || ::coshard::async::cuda_device_count() == 0) \
      GTEST_SKIP() << "no CUDA device";                                                     \
  } while (false)

class ModuleFixture : public ::testing::Test {
 protected:
  void SetUp() override {
    auto stream = async::Stream::create(async::Device::cpu(), {.name = "compute"});
    ASSERT_TRUE(stream) << stream.error().message();
    stream_ = std::make_unique<async::Stream>(std::move(*stream));
    auto alloc = async::CachingAllocator::create(async::Device::cpu());
    ASSERT_TRUE(alloc) << alloc.error().message();
    allocator_ = std::move(*alloc);
    auto ctx = Context::create(*stream_, *allocator_);
    ASSERT_TRUE(ctx) << ctx.error().message();
    ctx_ = std::make_unique<Context>(std::move(*ctx));
  }
  void TearDown() override {
    if (stream_) (void)stream_->synchronize();
  }

  // Waits (without blocking the reactor) until the stream has run everything enqueued so far.
  async::Task<Result<void>> drained() {
    COSHARD_CO_TRY_ASSIGN(auto ev, stream_->record());
    co_return co_await ev;
  }

  Tensor host_tensor(const std::vector<double>& values, Shape shape, DataType dtype) {
    auto bytes = encode_values(values, dtype);
    auto t = ctx_->upload(bytes, shape, dtype);
    EXPECT_TRUE(t) << t.error().message();
    return t ? *t : Tensor{};
  }
  Tensor tokens(const std::vector<int>& ids, Shape shape) {
    std::vector<double> v(ids.begin(), ids.end());
    return host_tensor(v, shape, DataType::i32);
  }

  async::Runtime rt_;
  std::unique_ptr<async::Stream> stream_;
  std::unique_ptr<async::CachingAllocator> allocator_;
  std::unique_ptr<Context> ctx_;
};

}  // namespace coshard::modules::testing
