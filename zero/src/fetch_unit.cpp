// A fetch unit's own operations (fetch_unit.hpp): its bindings, its gather, its gradient's
// reduction, each through the UnitIo it is given.
#include "fetch_unit.hpp"

#include <algorithm>
#include <memory>

#include "kernels/kernel_args.hpp"
#include "kernels/kernels.hpp"

namespace coshard::zero::detail {

using collectives::Coalesced;
using collectives::ReduceOp;
using modules::DataType;
using modules::Shape;

Result<void> FetchUnit::bind(const Tensor& values) {
  for (auto& p : params) {
    Tensor grad = grad_full ? grad_full.slice(p.offset, p.parameter->shape()) : Tensor{};
    COSHARD_TRY(p.parameter->bind(values.slice(p.offset, p.parameter->shape()), std::move(grad)));
  }
  return {};
}

Result<async::Event> FetchUnit::launch_in_group(collectives::Communicator& world, const Coalesced& g) const {
  return launch_within(world, *group->shard, g);
}

Result<async::Event> FetchUnit::launch_across_copies(collectives::Communicator& world, const Coalesced& g) const {
  return launch_within(world, *group->replicate, g);
}

namespace {

// Every rank's block of `n` elements of `over` into `whole`, from this rank's `source` (block
// `rank`), enqueued within the world's communication stream.
Result<async::Event> gather_blocks(const UnitIo& io, FetchMode mode, const ShardGroup& over, const Tensor& whole,
                                   std::int64_t n, const void* source, bool source_on_device, const std::string& purpose) {
  auto& cs = io.world.stream();
  const auto count = static_cast<std::size_t>(n);
  void* mine = whole.slice(static_cast<std::int64_t>(over.rank) * n, Shape{n}).data();
  Coalesced g;
  if (mode == FetchMode::all_gather && source_on_device) {
    g.all_gather(source, whole.data(), count, io.dtype);
  } else if (mode == FetchMode::all_gather) {
    COSHARD_TRY(cs.copy(mine, source, count * io.element_size()));
    g.all_gather(mine, whole.data(), count, io.dtype);
  } else {
    const auto all = count * static_cast<std::size_t>(over.ranks);
    COSHARD_TRY(cs.fill(whole.data(), 0, all * io.element_size()));
    COSHARD_TRY(cs.copy(mine, source, count * io.element_size()));
    g.all_reduce(whole.data(), whole.data(), all, io.dtype, ReduceOp::sum);
  }
  return launch_within(io.world, *over.shard, g.purpose(purpose));
}

}  // namespace

Result<async::Event> FetchUnit::gather_into(const UnitIo& io, FetchMode mode, const Tensor& whole, const void* source,
                                            bool source_on_device) const {
  return gather_blocks(io, mode, *group, whole, info.shard, source, source_on_device, gather_purpose);
}

Result<void> FetchUnit::keep_secondary(const UnitIo& io, const Tensor& whole) {
  auto& cs = io.world.stream();
  const std::int64_t n = secondary_elements();
  const auto bytes = static_cast<std::size_t>(n) * io.element_size();
  if (!secondary_block) {
    COSHARD_TRY_ASSIGN(secondary_block, io.ctx.allocator().allocate(bytes, cs));
  }
  COSHARD_TRY(cs.copy(secondary_block.data(), whole.slice(static_cast<std::int64_t>(secondary->rank) * n, Shape{n}).data(), bytes));
  secondary_holds = true;
  return {};
}

Result<async::Event> FetchUnit::gather_secondary_into(const UnitIo& io, FetchMode mode, const Tensor& whole) const {
  return gather_blocks(io, mode, *secondary, whole, secondary_elements(), secondary_block.data(), true, gather_purpose);
}

Result<FetchUnit::BlockPlan> FetchUnit::plan_blocks(const UnitIo& io, std::int64_t block,
                                                    modules::detail::BlockBits bits) const {
  using modules::detail::QuantSegment;
  using modules::detail::quant_block_count;
  using modules::detail::quant_packed_bytes;
  const int ranks = info.shard_ranks;
  // Each piece's segments, its values counted from the piece's start and its bytes from its own.
  std::vector<std::vector<QuantSegment>> pieces(static_cast<std::size_t>(ranks));
  std::int64_t piece_bytes = 0;
  std::vector<std::int64_t> piece_sizes;
  for (int q = 0; q < ranks; ++q) {
    const std::int64_t lo = q * info.shard, hi = lo + info.shard;
    std::vector<std::int64_t> cuts{lo, hi};
    for (const auto& p : params)
      for (const std::int64_t at : {p.offset, p.offset + p.parameter->numel()})
        if (at > lo && at < hi) cuts.push_back(at);
    std::sort(cuts.begin(), cuts.end());
    cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
    auto& piece = pieces[static_cast<std::size_t>(q)];
    std::int64_t bytes = 0, blocks = 0;
    for (std::size_t i = 0; i + 1 < cuts.size(); ++i) {
      const std::int64_t n = cuts[i + 1] - cuts[i];
      piece.push_back({cuts[i] - lo, n, bytes, blocks});
      bytes += quant_packed_bytes(n, block, bits);
      blocks += quant_block_count(n, block);
    }
    piece_bytes = std::max(piece_bytes, bytes);
    piece_sizes.push_back(bytes);
  }
  std::vector<QuantSegment> tables = pieces[static_cast<std::size_t>(group->rank)];
  BlockPlan plan;
  plan.block = block;
  plan.bits = bits;
  plan.piece_bytes = piece_bytes;
  plan.uneven = std::any_of(piece_sizes.begin(), piece_sizes.end(), [&](std::int64_t b) { return b < piece_bytes; });
  plan.own_segments = static_cast<std::int64_t>(tables.size());
  plan.own_blocks = tables.empty() ? 0 : tables.back().first_block + quant_block_count(tables.back().count, block);
  plan.own_bytes = tables.empty() ? 0 : tables.back().packed + quant_packed_bytes(tables.back().count, block, bits);
  std::int64_t blocks = 0;
  for (int q = 0; q < ranks; ++q)
    for (const auto& g : pieces[static_cast<std::size_t>(q)]) {
      tables.push_back({q * info.shard + g.value, g.count, q * piece_bytes + g.packed, blocks});
      blocks += quant_block_count(g.count, block);
    }
  plan.all_segments = static_cast<std::int64_t>(tables.size()) - plan.own_segments;
  plan.all_blocks = blocks;
  // The tables on the device, written on the communication stream (every gather is enqueued there
  // after this), from a host copy that goes once the stream has passed the copy.
  auto& cs = io.world.stream();
  const std::size_t table_bytes = tables.size() * sizeof(QuantSegment);
  COSHARD_TRY_ASSIGN(plan.tables_block, io.ctx.allocator().allocate(table_bytes, cs));
  auto host = std::make_shared<std::vector<QuantSegment>>(std::move(tables));
  COSHARD_TRY(cs.copy(plan.tables_block.data(), host->data(), table_bytes));
  COSHARD_TRY(cs.launch([host = std::move(host)] {}));
  plan.own = static_cast<const QuantSegment*>(plan.tables_block.data());
  plan.all = plan.own + plan.own_segments;
  return plan;
}

Result<async::Event> FetchUnit::gather_int8_into(const UnitIo& io, const Tensor& whole, const void* source,
                                                 bool source_on_device, void* staging) const {
  auto& cs = io.world.stream();
  const auto& kernels = io.ctx.kernels();
  const std::int64_t n = info.shard;
  const BlockPlan& int8 = weight_blocks;
  const auto piece = static_cast<std::size_t>(int8.piece_bytes);
  auto* mine = static_cast<std::byte*>(staging) + static_cast<std::size_t>(group->rank) * piece;
  if (!source_on_device) {  // (host memory: into its place in `whole` first, quantized from there)
    void* place = whole.slice(block_offset, Shape{n}).data();
    COSHARD_TRY(cs.copy(place, source, static_cast<std::size_t>(n) * io.element_size()));
    source = place;
  }
  COSHARD_TRY(kernels.quantize_blocks(cs, int8.bits, io.dtype, source, mine, int8.own, int8.own_segments, int8.own_blocks,
                                      int8.block));
  // (a piece shorter than the longest: its tail zeroed, so the bytes sent follow the shard alone)
  if (int8.own_bytes < int8.piece_bytes)
    COSHARD_TRY(cs.fill(mine + int8.own_bytes, 0, static_cast<std::size_t>(int8.piece_bytes - int8.own_bytes)));
  COSHARD_TRY(launch_in_group(io.world, Coalesced{}.all_gather(mine, staging, piece, DataType::u8).purpose(gather_purpose)));
  COSHARD_TRY(kernels.dequantize_blocks(cs, int8.bits, staging, io.dtype, whole.data(), int8.all, int8.all_segments,
                                        int8.all_blocks, int8.block));
  return cs.record();
}

Result<async::Event> FetchUnit::all_reduce_gradient(const UnitIo& io) const {
  return launch_within(io.world, *group->holders,
                       Coalesced{}
                           .all_reduce(grad_full.data(), grad_full.data(), static_cast<std::size_t>(info.padded),
                                       io.dtype, ReduceOp::avg)
                           .purpose(reduce_purpose));
}

Result<void> FetchUnit::scale_expert_gradient(const UnitIo& io) const {
  if (info.expert_parallel == 1) return {};
  return io.ctx.kernels().scale(io.world.stream(), io.dtype, grad_full.data(),
                                1.0f / static_cast<float>(info.expert_parallel), info.padded);
}

Result<async::Event> FetchUnit::reduce_scatter_gradient(const UnitIo& io, const Tensor& mine) const {
  const auto n = static_cast<std::size_t>(info.shard);
  Result<async::Event> done = fail(ErrorCode::internal, "gradients of unit ", info.name, " not reduced");
  if (grad_blocks.block > 0) {
    // Each rank's blocks of its whole gradient as int8 or int4 (block q for rank q), exchanged, and
    // the pieces of this rank's block summed in f32: the reduce-scatter in the format's bytes.
    auto& cs = io.world.stream();
    const auto& kernels = io.ctx.kernels();
    const BlockPlan& p = grad_blocks;
    const std::size_t bytes = p.gather_bytes(info.shard_ranks);
    COSHARD_TRY_ASSIGN(auto pieces, io.ctx.allocator().allocate(2 * bytes, cs));
    auto* send = static_cast<std::byte*>(pieces.data());
    auto* recv = send + bytes;
    // (pieces shorter than the longest: zeroed first, so the bytes sent follow the gradient alone)
    if (p.uneven) COSHARD_TRY(cs.fill(send, 0, bytes));
    COSHARD_TRY(
        kernels.quantize_blocks(cs, p.bits, io.dtype, grad_full.data(), send, p.all, p.all_segments, p.all_blocks, p.block));
    COSHARD_TRY(launch_in_group(
        io.world, Coalesced{}.all_to_all(send, recv, static_cast<std::size_t>(p.piece_bytes), DataType::u8).purpose(reduce_purpose)));
    COSHARD_TRY(kernels.dequantize_sum_blocks(cs, p.bits, recv, info.shard_ranks, p.piece_bytes, io.dtype, mine.data(),
                                              p.own, p.own_segments, p.own_blocks, p.block,
                                              1.0f / static_cast<float>(info.shard_ranks)));
    done = cs.record();
  } else {
    done = launch_in_group(
        io.world, Coalesced{}.reduce_scatter(grad_full.data(), mine.data(), n, io.dtype, ReduceOp::avg).purpose(reduce_purpose));
  }
  if (!done || !group->replicate) return done;
  return launch_across_copies(
      io.world, Coalesced{}.all_reduce(mine.data(), mine.data(), n, io.dtype, ReduceOp::avg).purpose(reduce_purpose));
}

Result<void> FetchUnit::allocate_grad_shard(const UnitIo& io, async::Stream& stream, bool zeroed) {
  const auto bytes = static_cast<std::size_t>(info.shard) * sizeof(float);
  COSHARD_TRY_ASSIGN(grad_shard_block, io.ctx.allocator().allocate(bytes, stream));
  grad_shard = Tensor(grad_shard_block.data(), Shape{info.shard}, DataType::f32, io.ctx.device());
  return zeroed ? stream.fill(grad_shard.data(), 0, bytes) : Result<void>{};
}

Result<void> FetchUnit::widen_block(const UnitIo& io, const Tensor& mine, const Tensor& out) const {
  auto& cs = io.world.stream();
  if (io.dtype == DataType::f32) return cs.copy(out.data(), mine.data(), mine.bytes());
  return io.ctx.kernels().cast(cs, io.dtype, mine.data(), DataType::f32, out.data(), info.shard);
}

}  // namespace coshard::zero::detail
