// An intrusive FIFO of suspended coroutines, shared by Semaphore, Channel and CPU events.
//
// A Waiter lives inside the awaiter object, i.e. inside the waiting coroutine's frame, so linking
// allocates nothing. The list is not synchronised: its owner guards it with its own mutex. An
// awaiter whose frame is destroyed while still linked (runtime shutdown) must unlink itself
// under that mutex; after it does, nobody can resume the destroyed coroutine.
#pragma once

#include <cassert>
#include <coroutine>

namespace coshard::async {
class Runtime;
}

namespace coshard::async::detail {

struct Waiter {
  std::coroutine_handle<> handle;
  Runtime* runtime = nullptr;  // where to resume; null resumes inline on the waking thread
  void* context = nullptr;     // the awaiter that owns this node, for the list's owner
  Waiter* prev = nullptr;
  Waiter* next = nullptr;
  bool linked = false;
};

// Resumes the waiter on its runtime's reactor (defined in runtime.cpp).
void wake(Waiter& waiter);

class WaitList {
 public:
  bool empty() const noexcept { return head_ == nullptr; }
  Waiter* front() const noexcept { return head_; }

  void push_back(Waiter& w) noexcept {
    assert(!w.linked);
    w.prev = tail_;
    w.next = nullptr;
    if (tail_) tail_->next = &w; else head_ = &w;
    tail_ = &w;
    w.linked = true;
  }

  void remove(Waiter& w) noexcept {
    assert(w.linked);
    if (w.prev) w.prev->next = w.next; else head_ = w.next;
    if (w.next) w.next->prev = w.prev; else tail_ = w.prev;
    w.prev = w.next = nullptr;
    w.linked = false;
  }

  Waiter* pop_front() noexcept {
    Waiter* w = head_;
    if (w) remove(*w);
    return w;
  }

 private:
  Waiter* head_ = nullptr;
  Waiter* tail_ = nullptr;
};

}  // namespace coshard::async::detail
