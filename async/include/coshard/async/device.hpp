// Device: where a stream runs and memory lives: the CPU, or a CUDA ordinal.
#pragma once

#include <cstdint>
#include <string>

namespace coshard::async {

enum class DeviceKind : std::uint8_t { cpu, cuda };

class Device {
 public:
  constexpr Device() = default;
  static constexpr Device cpu() { return Device(DeviceKind::cpu, 0); }
  static constexpr Device cuda(int index = 0) { return Device(DeviceKind::cuda, index); }

  constexpr DeviceKind kind() const noexcept { return kind_; }
  constexpr int index() const noexcept { return index_; }
  constexpr bool is_cpu() const noexcept { return kind_ == DeviceKind::cpu; }
  constexpr bool is_cuda() const noexcept { return kind_ == DeviceKind::cuda; }
  std::string to_string() const { return is_cpu() ? "cpu" : "cuda:" + std::to_string(index_); }

  friend constexpr bool operator==(Device, Device) = default;

 private:
  constexpr Device(DeviceKind kind, int index) : kind_(kind), index_(index) {}
  DeviceKind kind_ = DeviceKind::cpu;
  int index_ = 0;
};

// True when this build has the CUDA backend compiled in (COSHARD_CUDA).
bool cuda_compiled() noexcept;
// CUDA devices visible to this process: 0 without the backend, a driver or a GPU.
int cuda_device_count() noexcept;

}  // namespace coshard::async
