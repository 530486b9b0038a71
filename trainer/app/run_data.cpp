#include "run_data.hpp"

#include "run_checks.hpp"

namespace coshard::train_app {
namespace {

// The synthetic task's validation data: its batches far past any step a run reaches, draws of
// the same task that training never sees.
class HeldOutDraws final : public trainer::TokenSource {
 public:
  explicit HeldOutDraws(const trainer::TokenSource& task) : task_(task) {}
  std::int64_t vocab() const noexcept override { return task_.vocab(); }
  std::string describe() const override { return "held-out draws of the same task"; }
  std::string identity() const override { return "held-out draws of " + task_.identity(); }
  trainer::HostBatch batch(std::uint64_t step, std::int64_t rows, std::int64_t seq) const override {
    return task_.batch((std::uint64_t{1} << 62) + step, rows, seq);
  }

 private:
  const trainer::TokenSource& task_;  // (owned by the same RunData, moved with it: a heap object)
};

Result<std::unique_ptr<trainer::TokenSource>> open_files(const Options& o, const std::vector<std::filesystem::path>& files,
                                                         std::string_view flag) {
  auto format = trainer::parse_token_format(o.data_format);
  if (!format) return fail(std::move(format).error().with_context(std::string(flag)));
  auto opened = trainer::open_data(std::span<const std::filesystem::path>(files), *format, o.vocab, o.seq, o.train.seed);
  if (!opened) return fail(std::move(opened).error().with_context(std::string(flag)));
  return std::move(*opened);
}

}  // namespace

Result<bool> data_read_as_bytes(const Options& o, const std::vector<std::filesystem::path>& files,
                                std::string_view flag) {
  auto format = trainer::parse_token_format(o.data_format);
  if (!format) return fail(std::move(format).error().with_context("--data-format"));
  for (const auto& file : files) COSHARD_TRY(check_input_path({std::string(flag), file}));
  auto resolved = trainer::resolve_token_format(files.front(), *format);
  if (!resolved) return fail(std::move(resolved).error().with_context(flag));
  return *resolved == trainer::TokenFormat::bytes;
}

Result<RunData> open_run_data(const Options& o) {
  RunData d;
  if (o.data.empty()) {
    d.train = std::make_unique<trainer::SyntheticTask>(o.vocab, o.train.seed);
  } else {
    COSHARD_TRY_ASSIGN(d.train, open_files(o, o.data_files, "--data"));
  }
  if (!o.val_data.empty()) {
    COSHARD_TRY_ASSIGN(d.validation, open_files(o, o.val_files, "--val-data"));
  } else if (o.validate) {
    d.validation = std::make_unique<HeldOutDraws>(*d.train);
  }
  return d;
}

}  // namespace coshard::train_app
