#include "samples.hpp"

#include <algorithm>
#include <cstdio>

namespace coshard::train_app {

std::vector<std::int32_t> sample_prompt(const Options& o, const trainer::TokenSource& data) {
  if (!o.prompt.empty()) return o.prompt;
  const trainer::HostBatch first = data.batch(0, 1, std::min<std::int64_t>(4, o.seq));
  return first.tokens;
}

std::string render_tokens(std::span<const std::int32_t> ids, bool bytes) {
  std::string out;
  for (const std::int32_t id : ids) {
    if (!bytes) {
      out += (out.empty() ? "" : " ") + std::to_string(id);
    } else if (id == '\n') {
      out += "\\n";
    } else if (id == '\\') {
      out += "\\\\";
    } else if (id >= 32 && id < 127) {
      out += static_cast<char>(id);
    } else {
      char escaped[8];
      std::snprintf(escaped, sizeof escaped, "\\x%02x", static_cast<unsigned>(id) & 0xffu);
      out += escaped;
    }
  }
  return out;
}

async::Task<Result<void>> sample_after(trainer::Trainer& t, const Options& o, const trainer::TokenSource& data,
                                       std::int64_t step, bool quiet) {
  const std::vector<std::int32_t> prompt = sample_prompt(o, data);
  trainer::SampleOptions options = o.sample;
  options.seed = o.train.seed + static_cast<std::uint64_t>(step);  // reproducible, another draw each time
  options.vocab = o.model.vocab();
  COSHARD_CO_TRY_ASSIGN(auto tokens, co_await t.generate(prompt, options));
  if (t.world_rank() == 0 && !quiet) {
    // Text (data read as bytes, or a --prompt) in quotes; ids as ids: the prompt, then what the
    // model added.
    const bool bytes = dynamic_cast<const trainer::ByteCorpus*>(&data) != nullptr || o.prompt_is_text;
    std::string how = options.temperature == 0.0f ? "greedy" : "temperature " + std::to_string(options.temperature).substr(0, 4);
    if (options.top_k > 0 && options.temperature != 0.0f) how += ", top-k " + std::to_string(options.top_k);
    const std::string line = bytes ? "\"" + render_tokens(prompt, true) + "\" -> \"" + render_tokens(tokens, true) + "\""
                                   : "[" + render_tokens(prompt, false) + "] -> " + render_tokens(tokens, false);
    std::printf("sample after step %lld (%s): %s\n", static_cast<long long>(step), how.c_str(), line.c_str());
    std::fflush(stdout);
  }
  co_return Result<void>{};
}

}  // namespace coshard::train_app
