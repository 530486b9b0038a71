// StepClock (step_clock.hpp): differences of the streams' and the store's counters.
#include "schedule/step_clock.hpp"

namespace coshard::zero::detail {
namespace {

double ms(std::chrono::nanoseconds d) { return std::chrono::duration<double, std::milli>(d).count(); }

std::optional<double> minus(const std::optional<double>& now, const std::optional<double>& then) {
  if (!now || !then) return std::nullopt;
  return *now - *then;
}

}  // namespace

StepClock::Reading StepClock::read(const Sources& from) noexcept {
  Reading r;
  r.at = std::chrono::steady_clock::now();
  if (from.compute) r.compute_ms = from.compute->busy_ms();
  if (from.optimizer) r.optimizer_ms = from.optimizer->busy_ms();
  if (from.store) r.nvme = from.store->stats();
  return r;
}

StepTimeSplit StepClock::lap(const Sources& from) noexcept {
  const Reading now = read(from);
  const Reading then = last_ ? *last_ : now;
  last_ = now;
  StepTimeSplit split;
  split.wall_ms = ms(now.at - then.at);
  split.compute_ms = minus(now.compute_ms, then.compute_ms);
  split.optimizer_ms = minus(now.optimizer_ms, then.optimizer_ms);
  if (now.nvme) {
    const offload::NvmeStoreStats before = then.nvme.value_or(offload::NvmeStoreStats{});
    split.nvme = true;
    split.nvme_read_bytes = now.nvme->bytes_read - before.bytes_read;
    split.nvme_written_bytes = now.nvme->bytes_written - before.bytes_written;
    split.nvme_read_ms = ms(now.nvme->read_busy - before.read_busy);
    split.nvme_write_ms = ms(now.nvme->write_busy - before.write_busy);
    split.nvme_busy_ms = ms(now.nvme->busy - before.busy);
  }
  return split;
}

}  // namespace coshard::zero::detail
