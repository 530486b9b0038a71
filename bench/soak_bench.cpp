// Soak: many steps of a small GPT at world size 4 (ranks as threads), ZeRO-3, optimizer state on
// NVMe, a sharded checkpoint every `checkpoint` steps (written behind training, published two
// steps later; 0: none). Samples resident memory, open file descriptors and the
// runtimes' live tasks every `sample` steps, and reports the slope of each over the second half
// of the run (the first half warms caches and pools). Flat means: nothing grows with steps.
//
//   build/release/bench/soak_bench [steps=10000] [sample=250] [folder=./soak_nvme] [checkpoint=500]
#include <dirent.h>
#include <unistd.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>
#include <vector>

#include "coshard/async/runtime.hpp"
#include "coshard/collectives/local.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/trainer/trainer.hpp"

namespace {

using namespace coshard;

double rss_kib() {
  long pages = 0, resident = 0;
  if (std::FILE* f = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(f, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return static_cast<double>(resident) * static_cast<double>(::sysconf(_SC_PAGESIZE)) / 1024.0;
}

double open_fds() {
  int n = 0;
  if (DIR* d = ::opendir("/proc/self/fd")) {
    while (::readdir(d)) ++n;
    ::closedir(d);
  }
  return n - 3;  // ".", "..", and the directory itself
}

// Least-squares slope of y over x.
double slope(const std::vector<double>& x, const std::vector<double>& y) {
  const double n = static_cast<double>(x.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t i = 0; i < x.size(); ++i) {
    sx += x[i];
    sy += y[i];
    sxx += x[i] * x[i];
    sxy += x[i] * y[i];
  }
  const double d = n * sxx - sx * sx;
  return d == 0 ? 0 : (n * sxy - sx * sy) / d;
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t steps = argc > 1 ? std::atoll(argv[1]) : 10'000;
  const std::int64_t every = argc > 2 ? std::atoll(argv[2]) : 250;
  const std::filesystem::path folder = argc > 3 ? argv[3] : "soak_nvme";
  const std::int64_t checkpoint_every = argc > 4 ? std::atoll(argv[4]) : 500;
  std::atomic<int> checkpoints{0};
  constexpr int kWorld = 4;
  std::filesystem::remove_all(folder);

  auto comms = collectives::make_local_communicators(kWorld);
  if (!comms) {
    std::fprintf(stderr, "soak: %s\n", comms.error().message().c_str());
    return 1;
  }
  std::mutex mutex;
  std::vector<double> at, rss, fds, tasks;
  std::vector<std::string> errors;
  trainer::SyntheticTask data(64, 1);
  std::vector<std::thread> threads;
  const auto start = std::chrono::steady_clock::now();
  for (int r = 0; r < kWorld; ++r) {
    threads.emplace_back([&, r] {
      async::Runtime rt;
      auto body = [&]() -> async::Task<Result<void>> {
        modules::GptConfig g;
        g.vocab = 64;
        g.max_seq = 16;
        g.dim = 32;
        g.layers = 2;
        g.heads = 2;
        COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt(g));
        trainer::TrainerConfig c;
        c.zero_stage = 3;
        c.adaptive_prefetch = true;
        c.prefetch_bucket_bytes = 0;
        c.offload_optimizer.device = trainer::OffloadDevice::nvme;
        c.offload_optimizer.nvme_path = folder / "state";
        c.offload_optimizer.buffer_count = 3;
        trainer::TrainerBuilder builder(c);
        builder.communicator(*(*comms)[static_cast<std::size_t>(r)]);
        COSHARD_CO_TRY_ASSIGN(auto t, co_await builder.build(*model));
        for (std::int64_t step = 0; step < steps; ++step) {
          const auto global = data.batch(static_cast<std::uint64_t>(step), 8, 16);
          COSHARD_CO_TRY_ASSIGN(auto stats, co_await t.step(global.rank_rows(r, kWorld)));
          if (checkpoint_every > 0 && (step + 1) % checkpoint_every == 0) {
            COSHARD_CO_TRY(co_await t.save_checkpoint(folder / "checkpoints"));
            if (r == 0) ++checkpoints;
          }
          if (r == 0 && (step + 1) % every == 0) {
            std::lock_guard lock(mutex);
            at.push_back(static_cast<double>(step + 1));
            rss.push_back(rss_kib());
            fds.push_back(open_fds());
            tasks.push_back(static_cast<double>(async::Runtime::current()->live_tasks()));
            std::printf("step %lld  loss %.3f  rss %.0f KiB  fds %.0f  live tasks %.0f\n", static_cast<long long>(step + 1),
                        stats.loss, rss.back(), fds.back(), tasks.back());
            std::fflush(stdout);
          }
        }
        COSHARD_CO_TRY(co_await t.finish_checkpoint());
        co_return Result<void>{};
      };
      auto done = rt.block_on(body());
      if (!done) {
        std::lock_guard lock(mutex);
        errors.push_back(done.error().message());
      }
    });
  }
  for (auto& t : threads) t.join();
  std::string latest;
  if (std::FILE* f = std::fopen((folder / "checkpoints" / "latest").c_str(), "r")) {
    char name[64] = {};
    if (std::fgets(name, sizeof name, f)) latest = name;
    std::fclose(f);
    while (!latest.empty() && latest.back() == '\n') latest.pop_back();
  }
  std::filesystem::remove_all(folder);
  if (!errors.empty()) {
    std::fprintf(stderr, "soak: %s\n", errors.front().c_str());
    return 1;
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const std::size_t half = at.size() / 2;
  const std::vector<double> x(at.begin() + static_cast<std::ptrdiff_t>(half), at.end());
  auto tail = [&](const std::vector<double>& v) {
    return std::vector<double>(v.begin() + static_cast<std::ptrdiff_t>(half), v.end());
  };
  std::printf("soak: %lld steps at world size %d in %.0f s (%.2f ms/step), %d checkpoints, latest %s\n",
              static_cast<long long>(steps), kWorld, seconds, seconds * 1e3 / static_cast<double>(steps),
              checkpoints.load(), latest.empty() ? "(none)" : latest.c_str());
  if (x.size() >= 2) {
    std::printf("second half slopes per 1000 steps: rss %+.1f KiB, fds %+.2f, live tasks %+.2f\n",
                1000 * slope(x, tail(rss)), 1000 * slope(x, tail(fds)), 1000 * slope(x, tail(tasks)));
    std::printf("rss %.0f -> %.0f KiB over the second half\n", tail(rss).front(), tail(rss).back());
  }
  return 0;
}
