// An awaitable over one Asio asynchronous operation whose completion handler takes
// (error_code, size_t): socket and file reads/writes. The handler runs on the reactor and
// resumes the coroutine inline. Shared by async::net and offload's NvmeStore.
#pragma once

#include <coroutine>
#include <cstddef>
#include <system_error>
#include <utility>

namespace coshard::async::detail {

// One Asio operation whose handler takes (error_code, size_t).
template <class Initiate>
class TransferAwaiter {
 public:
  explicit TransferAwaiter(Initiate initiate) : initiate_(std::move(initiate)) {}
  bool await_ready() const noexcept { return false; }
  void await_suspend(std::coroutine_handle<> awaiting) {
    initiate_([this, awaiting](const std::error_code& ec, std::size_t n) {
      ec_ = ec;
      n_ = n;
      awaiting.resume();
    });
  }
  std::pair<std::error_code, std::size_t> await_resume() const noexcept { return {ec_, n_}; }

 private:
  Initiate initiate_;
  std::error_code ec_;
  std::size_t n_ = 0;
};

}  // namespace coshard::async::detail
