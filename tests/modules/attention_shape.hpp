// An attention layer's shape for the kernels' tests (the CUDA kernels', the CPU's native bf16),
// printed into the test's name.
#pragma once

#include <cstdint>
#include <ostream>

namespace coshard::modules::testing {

struct AttentionShape {
  std::int64_t B, T, H, KVH, hd;
  friend std::ostream& operator<<(std::ostream& os, const AttentionShape& s) {
    return os << "B" << s.B << "_T" << s.T << "_H" << s.H << "_KVH" << s.KVH << "_hd" << s.hd;
  }
};

}  // namespace coshard::modules::testing
