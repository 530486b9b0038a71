// libFuzzer target: the checkpoint manifest parser (outside input: a file on disk that a crash,
// a bad copy or a person may have changed). Properties: no crash, leak, hang or undefined
// behaviour (numbers of any size and type); a manifest that parses is consistent: one file per
// rank, named for its rank, every unit covered by its shards, 32 bytes of optimizer state.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "coshard/zero/checkpoint.hpp"

using namespace coshard::zero;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto m = parse_checkpoint_manifest(text, "fuzz");
  if (!m) return 0;
  if (m->world < 1 || m->files.size() != static_cast<std::size_t>(m->world)) std::abort();
  if (m->optimizer_state.size() != 32) std::abort();
  for (int r = 0; r < m->world; ++r)
    if (m->files[static_cast<std::size_t>(r)].name != checkpoint_rank_file(r)) std::abort();
  for (const auto& u : m->units)
    if (u.numel < 0 || u.shard < 0 || u.shard * m->world < u.numel) std::abort();
  return 0;
}
