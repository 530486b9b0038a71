#include "coshard/async/stream_budget.hpp"

#include "coshard/async/runtime.hpp"

namespace coshard::async {

Result<void> StreamBudget::release_after(Event passed, Semaphore::Permit permit) {
  Runtime* rt = Runtime::current();
  if (!rt) {
    permit.release();
    return fail(ErrorCode::internal, "StreamBudget::release_after outside a coshard Runtime");
  }
  pending_ += permit.count();
  returns_.push_back({std::move(passed), std::move(permit)});
  if (draining_) return {};
  draining_ = true;
  rt->spawn(drain(shared_from_this())).detach();
  return {};
}

Task<void> StreamBudget::drain(std::shared_ptr<StreamBudget> self) {
  while (!self->returns_.empty()) {
    auto& front = self->returns_.front();
    if (!front.passed.ready()) {
      Event passed = front.passed;
      (void)co_await passed;  // a failed stream's error is reported where the stream is awaited
      continue;
    }
    self->pending_ -= front.permit.count();
    front.permit.release();
    self->returns_.pop_front();
  }
  self->draining_ = false;
}

}  // namespace coshard::async
