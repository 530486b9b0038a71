#include "coshard/async/detail/shared_library.hpp"

#include <dlfcn.h>
#include <link.h>

#include <cstdlib>
#include <filesystem>

namespace coshard::async::detail {

Result<SharedLibrary> SharedLibrary::open(const std::string& file) {
  SharedLibrary lib;
  lib.handle_ = dlopen(file.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib.handle_ == nullptr) {
    const char* why = dlerror();
    return fail(ErrorCode::unsupported, why ? why : "dlopen failed");
  }
  return lib;
}

void* SharedLibrary::symbol(const char* name) {
  void* address = handle_ ? dlsym(handle_, name) : nullptr;
  if (address == nullptr && missing_.empty()) missing_ = name;
  return address;
}

std::string SharedLibrary::file() const {
  link_map* map = nullptr;
  if (handle_ == nullptr || dlinfo(handle_, RTLD_DI_LINKMAP, &map) != 0 || map == nullptr || map->l_name == nullptr)
    return {};
  return map->l_name;
}

void SharedLibrary::close() noexcept {
  if (handle_ != nullptr) dlclose(handle_);
  handle_ = nullptr;
}

std::string dotted_version(std::size_t version) {
  return std::to_string(version / 10000) + "." + std::to_string(version / 100 % 100) + "." + std::to_string(version % 100);
}

std::vector<std::string> library_candidates(const char* env_var, std::string_view file,
                                            std::string_view fallback_folder) {
  std::vector<std::string> candidates;
  if (const char* env = std::getenv(env_var); env && *env) {
    std::error_code ec;
    candidates.push_back(std::filesystem::is_directory(env, ec) ? (std::filesystem::path(env) / file).string()
                                                                 : std::string(env));
  }
  candidates.emplace_back(file);
  if (!fallback_folder.empty()) candidates.push_back((std::filesystem::path(fallback_folder) / file).string());
  return candidates;
}

}  // namespace coshard::async::detail
