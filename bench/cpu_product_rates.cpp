// The CPU's matrix-product rates through coshard's own kernels (ops::matmul_into, a Linear's
// product: x [M, K] times a weight [N, K] used transposed): f32 on OpenBLAS, bf16 natively through
// oneDNN where the CPU has the instructions (else on f32 copies), in GFLOP/s, one JSON line a shape
// and dtype. bench/cpu_bf16.py divides a training step's work by these rates.
//
//   cpu_product_rates [--threads N] [--seconds S] M N K [M N K ...]
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>
#include <vector>

#include "coshard/async/memory.hpp"
#include "coshard/async/runtime.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/modules/cpu_blas_kernels.hpp"
#include "coshard/modules/cpu_half_products.hpp"
#include "coshard/modules/cpu_threads.hpp"
#include "coshard/modules/module.hpp"
#include "coshard/modules/ops.hpp"

namespace {

using namespace coshard;
using modules::DataType;

int usage(const char* why) {
  std::fprintf(stderr, "cpu_product_rates: %s\nusage: cpu_product_rates [--threads N] [--seconds S] M N K [M N K ...]\n", why);
  return 2;
}

bool positive(std::string_view text, long long& out) {
  char* end = nullptr;
  const std::string s(text);
  out = std::strtoll(s.c_str(), &end, 10);
  return !s.empty() && end != nullptr && *end == '\0' && out > 0;
}

}  // namespace

int main(int argc, char** argv) {
  modules::choose_blas_kernels_and_restart(argv);
  long long threads = 0, seconds = 2;
  std::vector<long long> dims;
  for (int i = 1; i < argc; ++i) {
    const std::string_view arg(argv[i]);
    long long v = 0;
    if ((arg == "--threads" || arg == "--seconds") && i + 1 < argc) {
      if (!positive(argv[++i], v)) return usage("--threads and --seconds take a positive whole number");
      (arg == "--threads" ? threads : seconds) = v;
    } else if (positive(arg, v)) {
      dims.push_back(v);
    } else {
      return usage(("not a size: " + std::string(arg.substr(0, 64))).c_str());
    }
  }
  if (dims.empty() || dims.size() % 3 != 0) return usage("give the shapes as M N K triples");
  modules::set_cpu_math_threads(threads > 0 ? static_cast<int>(threads) : modules::default_cpu_math_threads(1));
  const auto half = modules::cpu_half_products();
  if (!half) return usage(half.error().message().c_str());

  async::Runtime rt;
  auto stream = async::Stream::create(async::Device::cpu(), {.name = "products"});
  auto allocator = async::CachingAllocator::create(async::Device::cpu());
  if (!stream || !allocator) return usage("no CPU stream or allocator");
  auto ctx = modules::Context::create(*stream, **allocator);
  if (!ctx) return usage(ctx.error().message().c_str());

  for (std::size_t s = 0; s < dims.size(); s += 3) {
    const long long m = dims[s], n = dims[s + 1], k = dims[s + 2];
    for (const DataType dt : {DataType::f32, DataType::bf16}) {
      auto x = ctx->zeros(modules::Shape{m, k}, dt), w = ctx->zeros(modules::Shape{n, k}, dt), y = ctx->zeros(modules::Shape{m, n}, dt);
      if (!x || !w || !y) return usage("no memory for the operands");
      auto product = [&] { return modules::ops::matmul_into(*ctx, *x, *w, *y, {.trans_b = true}); };
      for (int warm = 0; warm < 2; ++warm)
        if (!product()) return usage("the product failed");
      if (!stream->synchronize()) return usage("the stream failed");
      const auto start = std::chrono::steady_clock::now();
      long long count = 0;
      double elapsed = 0;
      do {
        for (int i = 0; i < 4; ++i, ++count)
          if (!product()) return usage("the product failed");
        if (!stream->synchronize()) return usage("the stream failed");
        elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
      } while (elapsed < static_cast<double>(seconds));
      const double gflops = 2.0 * static_cast<double>(m) * static_cast<double>(n) * static_cast<double>(k) *
                            static_cast<double>(count) / elapsed / 1e9;
      const std::string kernels = dt == DataType::f32 ? modules::cpu_blas_kernels().describe() : half->describe(dt);
      std::printf("{\"dtype\": \"%s\", \"m\": %lld, \"n\": %lld, \"k\": %lld, \"threads\": %d, \"gflops\": %.2f, "
                  "\"kernels\": \"%s\"}\n",
                  std::string(to_string(dt)).c_str(), m, n, k, modules::cpu_math_threads(), gflops, kernels.c_str());
      std::fflush(stdout);
    }
  }
  return 0;
}
