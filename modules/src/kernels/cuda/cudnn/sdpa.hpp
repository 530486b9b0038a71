// Causal attention through cuDNN's fused flash attention (the graph API): the forward and
// backward graphs coshard's attention layer needs, built once per shape and cached, and run on a
// stream with no host synchronization.
//
// The graphs are the patterns cuDNN's fused attention engines take (cuDNN's documentation of the
// graph API and its operation set are the source): S = Q K^T, scaled; the causal mask (row index
// >= column index, else -inf); softmax keeping one f32 statistic a row (max + log of the sum of
// exponentials); O = P V. Backward recomputes P from that statistic. Q, K and V are read in place
// from coshard's packed qkv rows [B, T, (H + 2 KVH) hd] through strides, and dQ, dK, dV written
// into dqkv the same way; grouped-query heads (H a multiple of KVH) sum their key and value
// gradients over each group inside the graph.
//
// Backward's buffers come from the caller's scratch (the attention layer's, from the
// stream-ordered caching allocator): each row's sum of dO * O (f32 [B, H, T]), then, in the
// non-deterministic form, the f32 accumulator of dQ, then cuDNN's own workspace. The forward's
// workspace (none, for the shapes measured) comes from cudaMallocAsync on the stream.
#pragma once

#include <array>
#include <compare>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kernels/cuda/cudnn/graph.hpp"
#include "kernels/cuda/cudnn/library.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail::cudnn {

enum class SdpaPass : std::uint8_t { forward, backward };

struct SdpaShape {
  DataType dtype = DataType::bf16;
  std::int64_t B = 0, T = 0, H = 0, KVH = 0, hd = 0;
  // Backward: dQ written by one product (true) or summed in an f32 accumulator with atomics
  // (false: cuDNN's faster form, whose bits may differ run to run).
  bool deterministic = true;
  auto operator<=>(const SdpaShape&) const = default;
};

// Empty when coshard builds cuDNN graphs for the shape; else why not, naming the value (the
// dtype, the head size, the grouping). cuDNN may still find no engine for a shape this allows
// (the plan's build says so).
std::string sdpa_unsupported(const SdpaShape& shape);

// One pass's execution plan and what it needs at run time.
class SdpaPlan {
 public:
  SdpaShape shape;
  SdpaPass pass = SdpaPass::forward;
  std::int64_t engine = -1;            // cuDNN's global engine index that took the graph
  std::int64_t workspace_bytes = 0;    // cuDNN's own workspace
  std::int64_t softmax_sum_bytes = 0;  // backward: f32 [B, H, T]
  std::int64_t dq_accum_bytes = 0;     // backward, non-deterministic: f32 [B, H, T, hd]
  // Backward's whole scratch: the two buffers above, then cuDNN's workspace (256-byte aligned).
  std::int64_t scratch_bytes() const;

  // Forward: qkv in, out and stats (f32 [B, H, T]) written. Backward: dout, qkv, out, stats in,
  // dqkv written, scratch of scratch_bytes(). `handle` is set to the caller's stream.
  Result<void> forward(cudnnHandle_t handle, void* stream, const void* qkv, void* out, float* stats) const;
  Result<void> backward(cudnnHandle_t handle, void* stream, const void* dout, const void* qkv, const void* out,
                        const float* stats, void* dqkv, void* scratch) const;

 private:
  friend Result<std::unique_ptr<SdpaPlan>> build_sdpa_plan(const Library&, const SdpaShape&, SdpaPass,
                                                           const PlanTarget&);
  // Q's, K's and V's first columns in packed rows laid out as qkv (dqkv alike).
  std::array<void*, 3> heads(const void* rows) const;
  Result<void> execute(cudnnHandle_t handle, std::vector<std::int64_t> uids, std::vector<void*> pointers,
                       void* workspace) const;
  const Library* lib_ = nullptr;
  std::vector<Descriptor> graph_;  // every descriptor the plan was built from
  Descriptor plan_;
  // By-value scalars travel as host pointers in the variant pack: they live here.
  std::unique_ptr<std::array<float, 3>> scalars_ = std::make_unique<std::array<float, 3>>();
  std::vector<std::int64_t> scalar_uids_;
  std::vector<void*> scalar_pointers_;
  // Ranks sharing a device share a plan, each through its own handle and stream; their enqueues
  // take turns (cuDNN does not document one plan executed from two threads at once).
  mutable std::mutex execute_mutex_;
};

Result<std::unique_ptr<SdpaPlan>> build_sdpa_plan(const Library& lib, const SdpaShape& shape, SdpaPass pass,
                                                  const PlanTarget& target);

// Plans by shape and pass, built on first ask (cuDNN's heuristics and, for some engines, a
// runtime compile: milliseconds to seconds) and kept for the life of the cache. A shape that
// failed keeps its error, so a step never retries a build that cannot succeed. Thread-safe.
class SdpaPlanCache {
 public:
  explicit SdpaPlanCache(PlanTarget target) : target_(target) {}
  // The plan, or why the shape has none; the pointer lives as long as the cache.
  Result<const SdpaPlan*> get(const Library& lib, const SdpaShape& shape, SdpaPass pass);
  std::size_t size() const;
  std::size_t builds() const;

 private:
  PlanTarget target_;
  mutable std::mutex mutex_;
  std::map<std::pair<SdpaShape, SdpaPass>, Result<std::unique_ptr<SdpaPlan>>> plans_;
  std::size_t builds_ = 0;
};

}  // namespace coshard::modules::detail::cudnn
