// libFuzzer target: the rendezvous store's wire messages (outside input from the network).
// Properties: no crash, no leak, no hang on any input; whatever decodes re-encodes to a frame
// that decodes to the same request (the codec is a bijection on valid messages).
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <span>

#include "coshard/collectives/store_protocol.hpp"

using namespace coshard::collectives::store;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto bytes = std::as_bytes(std::span(data, size));
  if (size >= 4) (void)frame_length(bytes.first<4>(), kDefaultMaxFrameBytes);

  auto request = decode_request(bytes);
  if (request) {
    const auto frame = encode(*request);
    auto again = decode_request(std::span(frame).subspan(4));
    if (!again || again->op != request->op || again->key != request->key || again->value != request->value ||
        again->timeout_ms != request->timeout_ms || again->delta != request->delta) {
      std::abort();  // a valid request did not survive its own round trip
    }
  }
  for (Op op : {Op::set, Op::get, Op::add}) {
    auto response = decode_response(bytes, op);
    if (response) {
      const auto frame = encode(*response, op);
      if (!decode_response(std::span(frame).subspan(4), op)) std::abort();
    }
  }
  return 0;
}
