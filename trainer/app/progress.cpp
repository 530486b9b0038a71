#include "progress.hpp"

#include <unistd.h>

#include <algorithm>

namespace coshard::trainer {

Progress::Progress(std::int64_t first_step, std::int64_t last_step, std::FILE* out)
    : first_(first_step), last_(last_step), every_(std::max<std::int64_t>(1, (last_step - first_step) / 20)),
      out_(out), tty_(::isatty(::fileno(out)) != 0) {}

void Progress::update(const StepStats& s) {
  if (s.optimizer.last_skipped) {  // always said, on a terminal or not
    std::fprintf(out_, "%sstep %lld skipped: non-finite gradients (norm %g, loss scale %g)\n", tty_ && open_line_ ? "\n" : "",
                 static_cast<long long>(s.step), static_cast<double>(s.optimizer.grad_norm), static_cast<double>(s.optimizer.loss_scale));
    open_line_ = false;
  }
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  const auto done = s.step - first_;
  const double eta = done > 0 ? elapsed / static_cast<double>(done) * static_cast<double>(last_ - s.step) : 0;
  if (tty_) {
    std::fprintf(out_, "\r\033[Kstep %lld/%lld  loss %.4f  %.0f tok/s  %.1f ms/step  ETA %.0fs",
                 static_cast<long long>(s.step), static_cast<long long>(last_), s.loss, s.tokens_per_s, s.step_ms, eta);
    open_line_ = true;
    if (s.val_loss) {  // kept: a line of its own under the step's
      std::fprintf(out_, "\n  validation loss %.4f after step %lld\n", *s.val_loss, static_cast<long long>(s.step));
      open_line_ = false;
    }
  } else if (s.step == first_ + 1 || s.step == last_ || (s.step - first_) % every_ == 0 || s.val_loss) {
    std::fprintf(out_, "step %lld/%lld  loss %.4f  %.0f tok/s  %.1f ms/step  hit rate %.2f  comm wait %s ms  ETA %.0fs\n",
                 static_cast<long long>(s.step), static_cast<long long>(last_), s.loss, s.tokens_per_s, s.step_ms,
                 s.hit_rate(), s.exposed_comm_ms ? std::to_string(*s.exposed_comm_ms).substr(0, 5).c_str() : "-",
                 eta);
    if (s.time_split.nvme) {  // out of core: where the step went, against what the disk moved
      const auto& t = s.time_split;
      std::fprintf(out_, "  compute %s ms, optimizer %s ms, nvme read %.2f GB in %.0f ms, written %.2f GB in %.0f ms, busy %.0f ms\n",
                   t.compute_ms ? std::to_string(static_cast<long long>(*t.compute_ms)).c_str() : "-",
                   t.optimizer_ms ? std::to_string(static_cast<long long>(*t.optimizer_ms)).c_str() : "-",
                   static_cast<double>(t.nvme_read_bytes) * 1e-9, t.nvme_read_ms, static_cast<double>(t.nvme_written_bytes) * 1e-9,
                   t.nvme_write_ms, t.nvme_busy_ms);
    }
    if (s.val_loss) std::fprintf(out_, "  validation loss %.4f after step %lld\n", *s.val_loss, static_cast<long long>(s.step));
  }
  std::fflush(out_);
}

void Progress::finish() {
  if (open_line_) std::fputc('\n', out_);
  open_line_ = false;
  std::fflush(out_);
}

}  // namespace coshard::trainer
