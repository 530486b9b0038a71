// libFuzzer target: token files for --data (llm.c's header, raw uint16/uint32). Properties: no
// crash or undefined behaviour; an accepted file's every token is below the vocabulary, and its
// batches are windows of it.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "coshard/trainer/data.hpp"

using namespace coshard::trainer;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  if (size < 2) return 0;
  // The first byte picks the format and the vocabulary; the rest is the file.
  const TokenFormat formats[] = {TokenFormat::automatic, TokenFormat::u16, TokenFormat::u32, TokenFormat::bytes};
  const TokenFormat format = formats[data[0] % 4];
  const std::int64_t vocab = 1 + (data[0] >> 2) * 1031;
  std::vector<std::byte> bytes(reinterpret_cast<const std::byte*>(data + 1), reinterpret_cast<const std::byte*>(data + size));
  auto f = TokenFile::from_bytes(std::move(bytes), "fuzz", format, vocab, 1);
  if (!f) return 0;
  if ((*f)->vocab() != vocab) std::abort();
  const std::int64_t seq = 4;
  if (!(*f)->check(seq)) return 0;
  const HostBatch b = (*f)->batch(3, 2, seq);
  for (std::size_t i = 0; i < b.tokens.size(); ++i) {
    if (b.tokens[i] < 0 || b.tokens[i] >= vocab || b.targets[i] < 0 || b.targets[i] >= vocab) std::abort();
  }
  return 0;
}
