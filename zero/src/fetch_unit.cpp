// A fetch unit's own operations (fetch_unit.hpp): its bindings, its gather, its gradient's
// reduction, each through the UnitIo it is given.
#include "fetch_unit.hpp"

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

Result<async::Event> FetchUnit::gather_into(const UnitIo& io, FetchMode mode, const Tensor& whole, const void* source,
                                            bool source_on_device) const {
  auto& cs = io.world.stream();
  const auto n = static_cast<std::size_t>(info.shard);
  void* mine = whole.slice(block_offset, Shape{info.shard}).data();
  Coalesced g;
  if (mode == FetchMode::all_gather && source_on_device) {
    g.all_gather(source, whole.data(), n, io.dtype);
  } else if (mode == FetchMode::all_gather) {
    COSHARD_TRY(cs.copy(mine, source, n * io.element_size()));
    g.all_gather(mine, whole.data(), n, io.dtype);
  } else {
    COSHARD_TRY(cs.fill(whole.data(), 0, info.padded_bytes));
    COSHARD_TRY(cs.copy(mine, source, n * io.element_size()));
    g.all_reduce(whole.data(), whole.data(), static_cast<std::size_t>(info.padded), io.dtype, ReduceOp::sum);
  }
  return launch_in_group(io.world, g.purpose(gather_purpose));
}

std::size_t FetchUnit::int8_gather_bytes() const noexcept {
  return static_cast<std::size_t>(modules::detail::int8_packed_bytes(info.shard, int8_block)) *
         static_cast<std::size_t>(info.shard_ranks);
}

Result<async::Event> FetchUnit::gather_int8_into(const UnitIo& io, const Tensor& whole, const void* source,
                                                 bool source_on_device, void* staging) const {
  auto& cs = io.world.stream();
  const auto& kernels = io.ctx.kernels();
  const std::int64_t n = info.shard;
  const auto piece = static_cast<std::size_t>(modules::detail::int8_packed_bytes(n, int8_block));
  void* mine = static_cast<std::byte*>(staging) + static_cast<std::size_t>(group->rank) * piece;
  if (!source_on_device) {  // (host memory: into its place in `whole` first, quantized from there)
    void* place = whole.slice(block_offset, Shape{n}).data();
    COSHARD_TRY(cs.copy(place, source, static_cast<std::size_t>(n) * io.element_size()));
    source = place;
  }
  COSHARD_TRY(kernels.quantize_int8(cs, io.dtype, source, mine, n, int8_block));
  COSHARD_TRY(launch_in_group(io.world, Coalesced{}.all_gather(mine, staging, piece, DataType::u8).purpose(gather_purpose)));
  COSHARD_TRY(kernels.dequantize_int8(cs, staging, info.shard_ranks, io.dtype, whole.data(), n, int8_block));
  return cs.record();
}

Result<async::Event> FetchUnit::all_reduce_gradient(const UnitIo& io) const {
  return io.world.all_reduce(grad_full.data(), grad_full.data(), static_cast<std::size_t>(info.padded), io.dtype,
                             ReduceOp::avg, reduce_purpose);
}

Result<async::Event> FetchUnit::reduce_scatter_gradient(const UnitIo& io, const Tensor& mine) const {
  const auto n = static_cast<std::size_t>(info.shard);
  auto done = launch_in_group(
      io.world, Coalesced{}.reduce_scatter(grad_full.data(), mine.data(), n, io.dtype, ReduceOp::avg).purpose(reduce_purpose));
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
