#include "kernels/cuda/cudnn/library.hpp"

#include <dlfcn.h>

#include <cstdlib>
#include <filesystem>
#include <vector>

namespace coshard::modules::detail::cudnn {
namespace {

constexpr const char* kFile = "libcudnn_graph.so.9";

template <class Fn>
bool bind(void* handle, Fn& fn, const char* name) {
  fn = reinterpret_cast<Fn>(dlsym(handle, name));
  return fn != nullptr;
}

std::vector<std::string> default_candidates() {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv("COSHARD_CUDNN_LIBRARY"); env && *env) {
    std::error_code ec;
    candidates.push_back(std::filesystem::is_directory(env, ec) ? (std::filesystem::path(env) / kFile).string()
                                                                 : std::string(env));
  }
  candidates.emplace_back(kFile);
#ifdef COSHARD_CUDNN_TOOLKIT_DIR
  candidates.push_back((std::filesystem::path(COSHARD_CUDNN_TOOLKIT_DIR) / kFile).string());
#endif
  return candidates;
}

}  // namespace

Result<Library> open_library(std::span<const std::string> candidates) {
  std::string tried;
  for (const std::string& path : candidates) {
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
      const char* why = dlerror();
      tried += "\n  " + path + ": " + (why ? why : "not found");
      continue;
    }
    Library lib;
    const bool bound =
        bind(handle, lib.get_version, "cudnnGetVersion") && bind(handle, lib.error_string, "cudnnGetErrorString") &&
        bind(handle, lib.last_error_string, "cudnnGetLastErrorString") && bind(handle, lib.create, "cudnnCreate") &&
        bind(handle, lib.destroy, "cudnnDestroy") && bind(handle, lib.set_stream, "cudnnSetStream") &&
        bind(handle, lib.create_descriptor, "cudnnBackendCreateDescriptor") &&
        bind(handle, lib.destroy_descriptor, "cudnnBackendDestroyDescriptor") &&
        bind(handle, lib.set_attribute, "cudnnBackendSetAttribute") &&
        bind(handle, lib.get_attribute, "cudnnBackendGetAttribute") &&
        bind(handle, lib.finalize, "cudnnBackendFinalize") && bind(handle, lib.execute, "cudnnBackendExecute");
    if (!bound) {
      tried += "\n  " + path + ": a graph-API function is missing (not cuDNN 9's graph library)";
      dlclose(handle);
      continue;
    }
    lib.version = lib.get_version();
    if (lib.version < 90000) {
      tried += "\n  " + path + ": cuDNN " + version_string(lib.version) + ", older than the 9.0 this needs";
      dlclose(handle);
      continue;
    }
    lib.path = path;
    return lib;  // the handle stays open for the life of the process
  }
  return fail(ErrorCode::unsupported, "cuDNN's graph library (", kFile,
              ") could not be used; set COSHARD_CUDNN_LIBRARY to it or its folder. Tried:", tried);
}

std::string Library::describe(cudnnStatus_t status) const {
  char message[1024] = {};
  last_error_string(message, sizeof message);
  std::string out = error_string(status);
  if (message[0]) out += std::string(" (") + message + ")";
  return out;
}

Result<const Library*> library() {
  static const Result<Library> loaded = open_library(default_candidates());
  if (!loaded) return fail(loaded.error());
  return &*loaded;
}

std::string version_string(std::size_t version) {
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." +
         std::to_string(version % 100);
}

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
