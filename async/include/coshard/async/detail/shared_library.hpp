// Libraries opened at run time (dlopen) instead of linked, so that a program pays for one (its
// load time, its memory, its constructors) only once it uses it: cuDNN, cuBLAS and cuBLASLt (the
// CUDA kernels of coshard::modules) and NCCL (coshard::collectives), over 1 GB that a run on the
// CPU never touches. Each library's loader lists where to look (library_candidates), tries them
// in order (first_library) and binds its functions into a table (SharedLibrary::bind).
#pragma once

#include <cstddef>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "coshard/async/result.hpp"

namespace coshard::async::detail {

// The owner of one dlopen handle: closed when dropped, unless kept.
class SharedLibrary {
 public:
  // `file` is a path (it has a '/') or a name the loader looks for on its search path
  // (LD_LIBRARY_PATH, ld.so.cache). Every symbol is resolved now (RTLD_NOW), and none is made
  // visible to libraries opened later (RTLD_LOCAL). The error is the loader's message.
  static Result<SharedLibrary> open(const std::string& file);

  SharedLibrary() = default;
  SharedLibrary(SharedLibrary&& o) noexcept
      : handle_(std::exchange(o.handle_, nullptr)), missing_(std::move(o.missing_)) {}
  SharedLibrary& operator=(SharedLibrary&& o) noexcept {
    if (this != &o) {
      close();
      handle_ = std::exchange(o.handle_, nullptr);
      missing_ = std::move(o.missing_);
    }
    return *this;
  }
  SharedLibrary(const SharedLibrary&) = delete;
  SharedLibrary& operator=(const SharedLibrary&) = delete;
  ~SharedLibrary() { close(); }

  // fn = the function exported as `name` (null where there is none: missing() names the first).
  template <class Fn>
  void bind(Fn& fn, const char* name) {
    fn = reinterpret_cast<Fn>(symbol(name));
  }
  // The first name bind() did not find; empty while every one was found.
  const std::string& missing() const noexcept { return missing_; }
  // The file the loader opened, as a full path (also when opened by name).
  std::string file() const;
  // Leaves the library open for the life of the process: the functions bound from it live in
  // tables that last as long (unloading a library whose functions may still be called is unsafe).
  void keep() && noexcept { handle_ = nullptr; }

 private:
  void* symbol(const char* name);
  void close() noexcept;

  void* handle_ = nullptr;
  std::string missing_;
};

// Where to look for the library `file` (a soname: "libnccl.so.2"), in order: the environment
// variable `env_var` when set (the file, or the folder holding it), the loader's search path
// (`file` alone), then `fallback_folder` when not empty (where the build found the library).
std::vector<std::string> library_candidates(const char* env_var, std::string_view file,
                                            std::string_view fallback_folder);

// "9.19.0" of 91900: a version as cuDNN 9, cuBLAS and NCCL since 2.9 report it (major * 10000 +
// minor * 100 + patch).
std::string dotted_version(std::size_t version);

// The first candidate that `take(candidate)` accepts: take opens it and checks that it is the
// library wanted (its functions, its version), returning the bound table or why not. When none
// is taken, an error says so: "<what> could not be used; set <env_var> to it or its folder.
// Tried:" and a line "<candidate>: <why>" for each.
template <class Take>
auto first_library(std::span<const std::string> candidates, std::string_view what, std::string_view env_var,
                   Take&& take) -> decltype(take(std::string())) {
  std::string tried;
  for (const std::string& candidate : candidates) {
    auto taken = take(candidate);
    if (taken) return taken;
    tried += "\n  " + candidate + ": " + taken.error().message();
  }
  return fail(ErrorCode::unsupported, what, " could not be used; set ", env_var, " to it or its folder. Tried:", tried);
}

}  // namespace coshard::async::detail
