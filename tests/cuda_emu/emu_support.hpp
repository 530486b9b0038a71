// What the emulated-kernel tests share: values held in a storage type, references' errors.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda_emu.hpp"
#include "support/reference_math.hpp"

namespace coshard::cuda_emu_test {

using coshard::testing::normwise_error;
using coshard::testing::random_values;

inline constexpr int kF32 = 0, kF16 = 2, kBF16 = 3;

// Values held in the storage type of `dt` (f32, f16 or bf16), and read back as f64.
struct Stored {
  int dt;
  std::vector<float> f32;
  std::vector<__half> f16;
  std::vector<__nv_bfloat16> bf16;

  Stored(int dtype, const std::vector<double>& v) : dt(dtype) {
    for (double x : v) {
      if (dt == kF32) f32.push_back(static_cast<float>(x));
      if (dt == kF16) f16.push_back(emu_from_float<__half>(static_cast<float>(x)));
      if (dt == kBF16) bf16.push_back(emu_from_float<__nv_bfloat16>(static_cast<float>(x)));
    }
  }
  void* data() {
    if (dt == kF16) return f16.data();
    if (dt == kBF16) return bf16.data();
    return f32.data();
  }
  std::vector<double> values() const {
    std::vector<double> out;
    auto read = [&out](const auto& held) {
      for (auto x : held) out.push_back(emu_to_float(x));
    };
    read(f32);
    read(f16);
    read(bf16);
    return out;
  }
};

inline double tolerance(int dt) { return dt == kBF16 ? 3e-2 : dt == kF16 ? 5e-3 : 1e-5; }

inline const char* dtype_name(int dt) { return dt == kBF16 ? "bf16" : dt == kF16 ? "f16" : "f32"; }

}  // namespace coshard::cuda_emu_test
