// The order of a pass's fetches, recorded per phase ("train", "eval") and followed the next time
// the phase runs: prefetch, reads ahead and reuse look along it. Private: not installed.
#pragma once

#include <map>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace coshard::zero::detail {

class FetchTrace {
 public:
  // A new pass: the order recorded for `phase` last time, if any, is followed.
  void begin(std::string_view phase) {
    phase_ = std::string(phase);
    auto it = traces_.find(phase_);
    followed_ = it == traces_.end() ? nullptr : &it->second;
    pos_ = 0;
    recording_.clear();
  }
  // Unit `unit` is fetched: its position in this pass's order. False in `on_trace` when it is not
  // the next one the followed order has (the caller then abandons it).
  std::size_t record(std::size_t unit, bool& on_trace) {
    recording_.push_back(unit);
    on_trace = true;
    if (followed_) {
      on_trace = pos_ < followed_->size() && (*followed_)[pos_] == unit;
      if (on_trace) ++pos_;
    }
    return recording_.size() - 1;
  }
  // The followed order is left: nothing ahead from here on.
  void abandon() noexcept { followed_ = nullptr; }
  // The end of the pass: this pass's order becomes the phase's; true if it had another before.
  bool end() {
    followed_ = nullptr;
    auto [it, added] = traces_.try_emplace(phase_, recording_);
    if (added || it->second == recording_) return false;
    it->second = recording_;
    return true;
  }
  // Whether an order is followed (none yet for the phase, or left this pass).
  bool following() const noexcept { return followed_ != nullptr; }
  // The followed order whole, and the position of the next fetch in it.
  std::span<const std::size_t> order() const noexcept {
    return followed_ ? std::span<const std::size_t>(*followed_) : std::span<const std::size_t>{};
  }
  std::size_t pos() const noexcept { return pos_; }
  // The units fetched so far this pass.
  std::size_t recorded() const noexcept { return recording_.size(); }
  const std::string& phase() const noexcept { return phase_; }

 private:
  std::string phase_ = "train";
  std::map<std::string, std::vector<std::size_t>> traces_;
  std::vector<std::size_t> recording_;
  const std::vector<std::size_t>* followed_ = nullptr;
  std::size_t pos_ = 0;
};

}  // namespace coshard::zero::detail
