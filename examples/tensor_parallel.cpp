// Two-dimensional parallelism in a program of your own: four ranks as threads on the CPU, a mesh
// of data 2 x tensor 2, a Llama split over each tensor pair (its heads, MLP and vocabulary) and
// sharded with ZeRO-3 over each data pair, trained in a plain loop, then written as one whole
// Hugging Face folder. Exits 1 unless the loss falls and the folder holds the whole model.
#include <coshard/coshard.hpp>

#include <cstdio>
#include <filesystem>
#include <string>
#include <thread>
#include <utility>
#include <unistd.h>
#include <vector>

namespace {

using namespace coshard;

constexpr int kWorld = 4, kTensor = 2, kSteps = 40;
constexpr std::int64_t kRows = 4, kSeq = 16;  // per data rank
constexpr modules::LlamaConfig kLlama{.vocab = 64, .max_seq = kSeq, .dim = 64, .layers = 2, .heads = 4, .kv_heads = 2,
                                      .intermediate = 128, .rope_theta = 10000.0, .tie_embeddings = true};

async::Task<Result<std::vector<double>>> train(collectives::Communicator& world, const std::filesystem::path& folder) {
  // The mesh splits the world once: tensor ranks {0,1} {2,3}, data ranks {0,2} {1,3}.
  COSHARD_CO_TRY_ASSIGN(auto mesh, collectives::Mesh::create(world, {.tensor = kTensor}));
  COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama(kLlama, mesh.tensor()));  // this rank's part
  trainer::TrainerBuilder builder;
  builder.mesh(mesh).zero_stage(3).adamw(3e-3f);
  COSHARD_CO_TRY_ASSIGN(auto trainer, co_await builder.build(*model));
  trainer::SyntheticTask data(kLlama.vocab, /*seed=*/3);
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    // The data ranks split the batch; the two ranks of a tensor pair read the same rows.
    const auto global = data.batch(static_cast<std::uint64_t>(step), kRows * mesh.data_size(), kSeq);
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await trainer.step(global.rank_rows(mesh.data_rank(), mesh.data_size())));
    losses.push_back(stats.loss);
  }
  // Whole weights out (the parts put together over each tensor pair; world rank 0 writes).
  modules::SafetensorsFolderOptions files;  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY(co_await zero::export_hf_llama(trainer.engine(), folder, kLlama, std::move(files)));
  co_return losses;
}

}  // namespace

int main() {
  const auto folder = std::filesystem::temp_directory_path() / ("coshard_example_tp_" + std::to_string(::getpid()));
  auto comms = collectives::make_local_communicators(kWorld);
  if (!comms) return std::fprintf(stderr, "%s\n", comms.error().message().c_str()), 1;
  std::vector<Result<std::vector<double>>> results(kWorld, fail(ErrorCode::internal, "not run"));
  std::vector<std::thread> ranks;
  for (int r = 0; r < kWorld; ++r)
    ranks.emplace_back([&, r] {
      async::Runtime rt;
      results[static_cast<std::size_t>(r)] = rt.block_on(train(*(*comms)[static_cast<std::size_t>(r)], folder));
    });
  for (auto& t : ranks) t.join();
  for (const auto& r : results)
    if (!r) return std::filesystem::remove_all(folder), std::fprintf(stderr, "%s\n", r.error().message().c_str()), 1;
  // The folder holds the whole model: its config, and transformers' whole shapes (q_proj: every
  // query head; k_proj: every key/value head; the whole vocabulary).
  auto config = zero::read_hf_llama_config(folder);
  auto file = modules::SafetensorsFile::load(folder / "model.safetensors");
  std::filesystem::remove_all(folder);
  if (!config || config->heads != kLlama.heads || config->vocab != kLlama.vocab || !file)
    return std::fprintf(stderr, "the folder is not the whole model's\n"), 1;
  const std::int64_t hd = kLlama.dim / kLlama.heads;
  const std::vector<std::pair<std::string, std::vector<std::int64_t>>> whole = {
      {"model.embed_tokens.weight", {kLlama.vocab, kLlama.dim}},
      {"model.layers.0.self_attn.q_proj.weight", {kLlama.heads * hd, kLlama.dim}},
      {"model.layers.0.self_attn.k_proj.weight", {kLlama.kv_heads * hd, kLlama.dim}},
      {"model.layers.0.mlp.down_proj.weight", {kLlama.dim, kLlama.intermediate}}};
  for (const auto& [name, dims] : whole) {
    bool found = false;
    for (const auto& t : file->tensors()) found = found || (t.name == name && t.shape == dims);
    if (!found) return std::fprintf(stderr, "%s: not whole in the folder\n", name.c_str()), 1;
  }
  const auto& losses = *results[0];
  std::printf("Llama (%lld parameters) over data 2 x tensor 2: loss %.4f -> %.4f\n",
              static_cast<long long>(kLlama.parameter_count()), losses.front(), losses.back());
  return losses.back() < 0.7 * losses.front() ? 0 : 1;
}
