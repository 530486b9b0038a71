#include "coshard/modules/decoding.hpp"

namespace coshard::modules {

Result<void> Decoding::advance(std::int64_t tokens) {
  if (tokens < 0 || position_ + tokens > max_length_)
    return fail(ErrorCode::invalid_argument, "Decoding: advancing ", tokens, " tokens from position ", position_,
                " passes max_length ", max_length_);
  position_ += tokens;
  return {};
}

Result<void> Decoding::check(std::int64_t rows, std::int64_t tokens, std::string_view layer) const {
  if (rows != rows_)
    return fail(ErrorCode::invalid_argument, layer, ": decoding ", rows_, " rows, given a batch of ", rows);
  if (tokens < 1 || position_ + tokens > max_length_)
    return fail(ErrorCode::invalid_argument, layer, ": ", tokens, " new tokens at position ", position_,
                " pass the decoding's max_length ", max_length_);
  return {};
}

Result<Tensor> Decoding::cache(Context& ctx, const Module& layer, std::int64_t width, DataType dtype) {
  if (rows_ < 1 || max_length_ < 1 || width < 1)
    return fail(ErrorCode::invalid_argument, "Decoding: ", rows_, " rows of ", max_length_, " tokens, width ", width,
                ": expected each at least 1");
  auto it = caches_.find(&layer);
  if (it != caches_.end()) {
    const Tensor& t = it->second;
    if (t.dtype() != dtype || t.shape()[2] != width || !(t.device() == ctx.device()))
      return fail(ErrorCode::invalid_argument, "Decoding: layer ", layer.type_name(), "'s cache is ", t.describe(),
                  ", asked for width ", width, " of another dtype or device");
    return t;
  }
  COSHARD_TRY_ASSIGN(Tensor t, ctx.zeros(Shape{rows_, max_length_, width}, dtype));
  caches_.emplace(&layer, t);
  return t;
}

}  // namespace coshard::modules
