// The trainer binary's progress display: one live line on a terminal (step, loss, tokens/s,
// ETA), plain lines at intervals otherwise.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>

#include "coshard/trainer/trainer.hpp"

namespace coshard::trainer {

class Progress {
 public:
  Progress(std::int64_t first_step, std::int64_t last_step, std::FILE* out);
  void update(const StepStats& s);
  void finish();

 private:
  std::int64_t first_, last_, every_;
  std::FILE* out_;
  bool tty_;
  bool open_line_ = false;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
};

}  // namespace coshard::trainer
