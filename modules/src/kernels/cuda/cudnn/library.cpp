#include "kernels/cuda/cudnn/library.hpp"

#include "coshard/async/detail/shared_library.hpp"

namespace coshard::modules::detail::cudnn {
namespace {

using async::detail::SharedLibrary;

constexpr const char* kFile = "libcudnn_graph.so.9";

// The candidate opened, its graph-API functions bound and its version checked; else why not.
Result<Library> take(const std::string& candidate) {
  COSHARD_TRY_ASSIGN(SharedLibrary file, SharedLibrary::open(candidate));
  Library lib;
  file.bind(lib.get_version, "cudnnGetVersion");
  file.bind(lib.error_string, "cudnnGetErrorString");
  file.bind(lib.last_error_string, "cudnnGetLastErrorString");
  file.bind(lib.create, "cudnnCreate");
  file.bind(lib.destroy, "cudnnDestroy");
  file.bind(lib.set_stream, "cudnnSetStream");
  file.bind(lib.create_descriptor, "cudnnBackendCreateDescriptor");
  file.bind(lib.destroy_descriptor, "cudnnBackendDestroyDescriptor");
  file.bind(lib.set_attribute, "cudnnBackendSetAttribute");
  file.bind(lib.get_attribute, "cudnnBackendGetAttribute");
  file.bind(lib.finalize, "cudnnBackendFinalize");
  file.bind(lib.execute, "cudnnBackendExecute");
  if (!file.missing().empty())
    return fail(ErrorCode::unsupported, "a graph-API function is missing (", file.missing(),
                "): not cuDNN 9's graph library");
  lib.version = lib.get_version();
  if (lib.version < 90000)
    return fail(ErrorCode::unsupported, "cuDNN ", version_string(lib.version), ", older than the 9.0 this needs");
  lib.path = file.file();
  if (lib.path.empty()) lib.path = candidate;
  std::move(file).keep();  // open for the life of the process
  return lib;
}

}  // namespace

Result<Library> open_library(std::span<const std::string> candidates) {
  return async::detail::first_library(candidates, std::string("cuDNN's graph library (") + kFile + ")",
                                      "COSHARD_CUDNN_LIBRARY", take);
}

std::string Library::describe(cudnnStatus_t status) const {
  char message[1024] = {};
  last_error_string(message, sizeof message);
  std::string out = error_string(status);
  if (message[0]) out += std::string(" (") + message + ")";
  return out;
}

Result<const Library*> library() {
#ifdef COSHARD_CUDA_TOOLKIT_LIBRARY_DIR
  constexpr std::string_view toolkit = COSHARD_CUDA_TOOLKIT_LIBRARY_DIR;
#else
  constexpr std::string_view toolkit;
#endif
  static const Result<Library> loaded =
      open_library(async::detail::library_candidates("COSHARD_CUDNN_LIBRARY", kFile, toolkit));
  if (!loaded) return fail(loaded.error());
  return &*loaded;
}

std::string version_string(std::size_t version) { return async::detail::dotted_version(version); }

Result<Descriptor> Descriptor::make(const Library& lib, cudnnBackendDescriptorType_t type) {
  Descriptor d;
  d.lib_ = &lib;
  if (const cudnnStatus_t st = lib.create_descriptor(type, &d.d_); st != CUDNN_STATUS_SUCCESS) {
    d.d_ = nullptr;
    return fail(ErrorCode::device, "cudnnBackendCreateDescriptor(", static_cast<int>(type), "): ", lib.describe(st));
  }
  return d;
}

Result<Descriptor> device_properties_from_json(const Library& lib, std::string_view json) {
  if (lib.version < 90800)
    return fail(ErrorCode::unsupported, "cuDNN ", version_string(lib.version),
                ": device properties from JSON need cuDNN 9.8 or later");
  COSHARD_TRY_ASSIGN(Descriptor d, Descriptor::make(lib, CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR));
  cudnnStatus_t st = lib.set_attribute(d.get(), CUDNN_ATTR_DEVICEPROP_JSON_REPRESENTATION, CUDNN_TYPE_CHAR,
                                       static_cast<std::int64_t>(json.size()), json.data());
  if (st == CUDNN_STATUS_SUCCESS) st = lib.finalize(d.get());
  if (st != CUDNN_STATUS_SUCCESS) return fail(ErrorCode::invalid_argument, "cuDNN device properties: ", lib.describe(st));
  return d;
}

}  // namespace coshard::modules::detail::cudnn
