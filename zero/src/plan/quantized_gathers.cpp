#include "plan/quantized_gathers.hpp"

#include "coshard/modules/tensor.hpp"

namespace coshard::zero {

std::string_view to_string(Quantization q) noexcept {
  switch (q) {
    case Quantization::none: return "none";
    case Quantization::int8: return "int8";
    case Quantization::int4: return "int4";
  }
  return "?";
}

namespace {

// A block of `value` elements a scale, named `name` in the error.
Result<void> check_block(std::string_view name, std::int64_t value) {
  constexpr std::int64_t kLargestBlock = std::int64_t{1} << 30;
  if (value >= 8 && value <= kLargestBlock) return {};
  return fail(ErrorCode::invalid_argument, name, "=", value,
              ": expected 8 to 2^30 elements a scale (below 8 the f32 scales outweigh the bytes int8 saves)");
}

}  // namespace

Result<void> check_quantized_gathers(const EngineOptions& o) {
  for (const auto& [name, q] : {std::pair{"quantize_weights", o.quantize_weights},
                                std::pair{"quantize_frozen_weights", o.quantize_frozen_weights}}) {
    if (q == Quantization::none) continue;
    if (q != Quantization::int8)
      return fail(ErrorCode::invalid_argument, name, "=", to_string(q),
                  ": weight gathers are quantized to int8 blocks only (expected none or int8; int4 is for the "
                  "gradients' reduction)");
    if (o.zero_stage != 3)
      return fail(ErrorCode::invalid_argument, name, "=", to_string(q), " with zero_stage=", o.zero_stage,
                  ": stages 0-2 keep whole copies and gather no weights before a forward (expected zero_stage 3)");
    if (o.fetch_mode != FetchMode::all_gather)
      return fail(ErrorCode::invalid_argument, name, "=", to_string(q),
                  " with fetch_mode=all_reduce: a sum of int8 pieces is no gather (expected fetch_mode all_gather)");
    COSHARD_TRY(check_block("quantize_weights_block", o.quantize_weights_block));
  }
  if (o.quantize_gradients != Quantization::none) {
    const std::string q(to_string(o.quantize_gradients));
    if (o.quantize_gradients != Quantization::int8 && o.quantize_gradients != Quantization::int4)
      return fail(ErrorCode::invalid_argument, "quantize_gradients=", q, ": expected none, int8 or int4");
    if (o.zero_stage != 2 && o.zero_stage != 3)
      return fail(ErrorCode::invalid_argument, "quantize_gradients=", q, " with zero_stage=", o.zero_stage,
                  ": the quantized reduction replaces the reduce-scatter of each unit as its backward ends, which stages 2 "
                  "and 3 do (stage 0 all-reduces, stage 1 reduces once after backward; expected zero_stage 2 or 3)");
    COSHARD_TRY(check_block("quantize_gradients_block", o.quantize_gradients_block));
    if (o.quantize_gradients == Quantization::int4 && o.quantize_gradients_block % 2 != 0)
      return fail(ErrorCode::invalid_argument, "quantize_gradients_block=", o.quantize_gradients_block,
                  " with quantize_gradients=int4: expected an even count (two values a byte; no byte holds two "
                  "blocks' values)");
  }
  return {};
}

namespace detail {

// (a unit sharded over one rank gathers nothing over a wire: quantizing it would only cost)
std::int64_t int8_block_for(const EngineOptions& o, const FetchUnitInfo& info) {
  const bool quantized = o.quantize_weights == Quantization::int8 ||
                         (info.frozen && o.quantize_frozen_weights == Quantization::int8);
  return quantized && o.zero_stage == 3 && info.shard_ranks > 1 ? o.quantize_weights_block : 0;
}

std::int64_t int8_gradient_block_for(const EngineOptions& o, const FetchUnitInfo& info) {
  const bool quantized = o.quantize_gradients != Quantization::none && !info.frozen;
  return quantized && (o.zero_stage == 2 || o.zero_stage == 3) && info.shard_ranks > 1 ? o.quantize_gradients_block : 0;
}

modules::detail::BlockBits gradient_block_bits(const EngineOptions& o) {
  return o.quantize_gradients == Quantization::int4 ? modules::detail::BlockBits::int4 : modules::detail::BlockBits::int8;
}

std::size_t int8_staging_bytes(std::int64_t block, DataType dtype, std::size_t bytes, modules::detail::BlockBits bits) {
  // A value of size_of(dtype) bytes travels as one byte (int4: half of one) and a share of its
  // block's scale; each rank's piece rounds both parts up to 16 bytes (a little slack for that).
  const double value_bytes = bits == modules::detail::BlockBits::int8 ? 1.0 : 0.5;
  const double per_byte = (value_bytes + 4.0 / static_cast<double>(block)) / static_cast<double>(modules::size_of(dtype));
  return static_cast<std::size_t>(static_cast<double>(bytes) * per_byte) + (std::size_t{64} << 10);
}

}  // namespace detail
}  // namespace coshard::zero
