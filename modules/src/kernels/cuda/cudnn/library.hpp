// cuDNN's graph (backend) API, linked at run time: libcudnn_graph.so.9 is opened with dlopen on
// first use, so the library builds and runs where cuDNN is absent (attention then keeps its own
// kernels) and a device machine can bring its own cuDNN (PyTorch's nvidia/cudnn folder) without
// coshard carrying 490 MB of it. Where it looks, in order: COSHARD_CUDNN_LIBRARY (the file, or
// the folder holding it), the loader's search path, then the toolkit's lib folder this build saw.
//
// Descriptor is the move-only owner of one backend descriptor. Setting attributes goes through
// GraphBuilder (sdpa_graph.hpp), which keeps the first error with what was being set.
#pragma once

#include <cudnn_graph.h>

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <utility>

#include "coshard/async/result.hpp"

namespace coshard::modules::detail::cudnn {

struct Library {
  decltype(&cudnnGetVersion) get_version = nullptr;
  decltype(&cudnnGetErrorString) error_string = nullptr;
  decltype(&cudnnGetLastErrorString) last_error_string = nullptr;
  decltype(&cudnnCreate) create = nullptr;
  decltype(&cudnnDestroy) destroy = nullptr;
  decltype(&cudnnSetStream) set_stream = nullptr;
  decltype(&cudnnBackendCreateDescriptor) create_descriptor = nullptr;
  decltype(&cudnnBackendDestroyDescriptor) destroy_descriptor = nullptr;
  decltype(&cudnnBackendSetAttribute) set_attribute = nullptr;
  decltype(&cudnnBackendGetAttribute) get_attribute = nullptr;
  decltype(&cudnnBackendFinalize) finalize = nullptr;
  decltype(&cudnnBackendExecute) execute = nullptr;

  std::string path;          // the file opened
  std::size_t version = 0;   // cudnnGetVersion: 91900 is 9.19.0

  // "CUDNN_STATUS_BAD_PARAM (the library's last message)".
  std::string describe(cudnnStatus_t status) const;
};

// The first of `candidates` (files, or names for the loader) that is cuDNN 9's graph library;
// else an error naming each and why it was not (not found, a graph-API function missing, a
// version before 9.0). A library opened stays open for the life of the process.
Result<Library> open_library(std::span<const std::string> candidates);

// The library, opened once per process; the error says where it looked and why each failed, or
// that its version is older than 9.0.
Result<const Library*> library();

// The version as "9.19.0".
std::string version_string(std::size_t version);

class Descriptor {
 public:
  Descriptor() = default;
  static Result<Descriptor> make(const Library& lib, cudnnBackendDescriptorType_t type);
  Descriptor(Descriptor&& o) noexcept : lib_(o.lib_), d_(std::exchange(o.d_, nullptr)) {}
  Descriptor& operator=(Descriptor&& o) noexcept {
    if (this != &o) {
      reset();
      lib_ = o.lib_;
      d_ = std::exchange(o.d_, nullptr);
    }
    return *this;
  }
  Descriptor(const Descriptor&) = delete;
  Descriptor& operator=(const Descriptor&) = delete;
  ~Descriptor() { reset(); }

  cudnnBackendDescriptor_t get() const noexcept { return d_; }
  explicit operator bool() const noexcept { return d_ != nullptr; }

 private:
  void reset() noexcept {
    if (d_) lib_->destroy_descriptor(d_);
    d_ = nullptr;
  }
  const Library* lib_ = nullptr;
  cudnnBackendDescriptor_t d_ = nullptr;
};

// A device described by cuDNN's JSON form of its properties (cuDNN 9.8 and later), for plans
// built without that device present (the tests build plans for an H100 on a CPU machine).
Result<Descriptor> device_properties_from_json(const Library& lib, std::string_view json);

}  // namespace coshard::modules::detail::cudnn
