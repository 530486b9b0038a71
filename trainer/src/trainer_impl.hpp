// Trainer::Impl, shared by the loop (trainer.cpp) and the checkpoints (checkpoint.cpp).
#pragma once

#include <chrono>
#include <span>

#include <memory>
#include <optional>

#include "coshard/async/join_handle.hpp"
#include "coshard/async/memory.hpp"
#include "coshard/async/stream.hpp"
#include "coshard/offload/nvme_store.hpp"
#include "coshard/trainer/trainer.hpp"

namespace coshard::trainer {

// One rank's file of a checkpoint, as written.
struct ShardFile {
  std::string name;  // inside the checkpoint folder
  std::uint64_t bytes = 0;
  std::uint32_t crc32 = 0;
  async::PinnedBuffer staging;  // the buffer it was written from, back for the next save
};

struct PendingSave {
  std::filesystem::path dir;           // the checkpoints' parent folder
  std::string name;                    // "step-00000042"
  std::int64_t step = 0;
  std::string manifest;                // rank 0: the manifest, less the file records
  async::JoinHandle<Result<ShardFile>> write;  // the rank file, on the blocking pool
  int steps_left = 2;                  // published at the start of the second step after the save
};

struct Trainer::Impl {
  TrainerConfig config;
  collectives::Communicator* comm = nullptr;
  modules::Module* model = nullptr;
  std::unique_ptr<async::Stream> stream;
  std::unique_ptr<async::CachingAllocator> allocator;
  std::unique_ptr<modules::Context> ctx;
  std::unique_ptr<modules::Optimizer> optimizer;
  std::unique_ptr<zero::Engine> engine;
  modules::CrossEntropyLoss own_loss;      // the default
  modules::Loss* loss = &own_loss;         // or the builder's

  std::int64_t steps = 0;
  int skipped_in_a_row = 0;  // steps skipped for inf/NaN gradients, up to this one
  std::optional<PendingSave> pending;
  // The pinned buffer a save assembles this rank's file in, kept between saves: pinning memory
  // afresh for every save cost a host-side page registration each time (cudaHostRegister with a
  // GPU) and made the resident set swing with the save cycle.
  async::PinnedBuffer staging;
  // Checkpoint files go through the offload store (io_uring; O_DIRECT where the filesystem allows).
  std::shared_ptr<offload::NvmeStore> store;
  std::filesystem::path store_dir;

  ~Impl();

  // Each rank's `mine` (same length everywhere), rank-major: for the ranks to agree on a
  // checkpoint. One small all-gather, awaited.
  async::Task<Result<std::vector<std::int64_t>>> exchange(std::vector<std::int64_t> mine);
  // One optimizer step over `micro` (this rank's micro-batches, on the device); `counted` is the
  // global batch's tokens or samples for the statistics.
  async::Task<Result<StepStats>> step(std::span<const modules::Batch> micro, std::int64_t counted,
                                      std::chrono::steady_clock::time_point start);
  // Publishes the pending save (every rank calls it at the same point).
  async::Task<Result<void>> publish();
};

}  // namespace coshard::trainer
