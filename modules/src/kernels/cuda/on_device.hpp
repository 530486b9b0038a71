// Runs fn with `device` as the calling thread's current CUDA device, then makes the device that
// was current before current again: for the library handles and buffers a (device, stream) entry
// makes on first use, whichever device the calling thread had.
#pragma once

#include <cuda_runtime.h>

#include <utility>

namespace coshard::modules::detail {

template <class Fn>
auto on_device(int device, Fn&& fn) -> decltype(std::forward<Fn>(fn)()) {
  int previous = 0;
  cudaGetDevice(&previous);
  cudaSetDevice(device);
  struct Restore {
    int device;
    ~Restore() { cudaSetDevice(device); }
  } restore{previous};
  return std::forward<Fn>(fn)();
}

}  // namespace coshard::modules::detail
