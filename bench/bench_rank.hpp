// What the benchmark binaries share: whether a GPU is here, and one rank's runtime, compute
// stream, caching allocator and Context on a device.
#pragma once

#include <memory>

#include "coshard/async/runtime.hpp"
#include "coshard/modules/module.hpp"

namespace coshard::bench {

inline bool have_gpu() { return async::cuda_compiled() && async::cuda_device_count() > 0; }

// The members in this order: the Context goes before its allocator and stream, and the stream
// drains before any of them goes.
struct BenchRank {
  async::Runtime rt;
  std::unique_ptr<async::Stream> stream;
  std::unique_ptr<async::CachingAllocator> allocator;
  std::unique_ptr<modules::Context> ctx;

  BenchRank() = default;
  BenchRank(const BenchRank&) = delete;
  BenchRank& operator=(const BenchRank&) = delete;
  ~BenchRank() {
    if (stream) (void)stream->synchronize();
  }

  // The stream (named "compute"), allocator and Context on `device`.
  Result<void> open(async::Device device, modules::ContextOptions options = {}) {
    COSHARD_TRY_ASSIGN(auto s, async::Stream::create(device, {.name = "compute"}));
    stream = std::make_unique<async::Stream>(std::move(s));
    COSHARD_TRY_ASSIGN(allocator, async::CachingAllocator::create(device));
    COSHARD_TRY_ASSIGN(auto c, modules::Context::create(*stream, *allocator, options));
    ctx = std::make_unique<modules::Context>(std::move(c));
    return {};
  }

  static Result<std::unique_ptr<BenchRank>> make(async::Device device, modules::ContextOptions options = {}) {
    auto r = std::make_unique<BenchRank>();
    COSHARD_TRY(r->open(device, options));
    return r;
  }
};

}  // namespace coshard::bench
