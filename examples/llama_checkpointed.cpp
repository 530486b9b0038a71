// A Llama of your own shape, sharded with ZeRO-3 and its blocks checkpointed, trained in a plain
// loop, then written as a Hugging Face folder and read back: two ranks as threads on the CPU.
// The folder is what transformers.LlamaForCausalLM.from_pretrained loads. Exits 1 unless the
// loss falls and the weights come back bit for bit.
#include <coshard/coshard.hpp>

#include <cstdio>
#include <filesystem>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

using namespace coshard;

constexpr int kWorld = 2, kSteps = 40;
constexpr std::int64_t kRows = 4, kSeq = 16;  // per rank
constexpr modules::LlamaConfig kLlama{.vocab = 64, .max_seq = kSeq, .dim = 64, .layers = 4, .heads = 4, .kv_heads = 2,
                                      .intermediate = 160, .rope_theta = 10000.0, .tie_embeddings = true};

async::Task<Result<std::vector<double>>> train(collectives::Communicator& comm, const std::filesystem::path& folder) {
  COSHARD_CO_TRY_ASSIGN(auto model, modules::make_llama(kLlama));
  modules::apply_activation_checkpointing(*model, modules::ActivationCheckpointing{1});  // every block
  trainer::TrainerBuilder builder;
  builder.communicator(comm).zero_stage(3).adamw(3e-3f);
  COSHARD_CO_TRY_ASSIGN(auto trainer, co_await builder.build(*model));
  trainer::SyntheticTask data(kLlama.vocab, /*seed=*/3);
  std::vector<double> losses;
  for (int step = 0; step < kSteps; ++step) {
    const auto global = data.batch(static_cast<std::uint64_t>(step), kRows * kWorld, kSeq);
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await trainer.step(global.rank_rows(comm.rank(), kWorld)));
    losses.push_back(stats.loss);
  }
  // Out in transformers' layout (rank 0 writes; every rank takes part), then back in.
  COSHARD_CO_TRY_ASSIGN(auto trained, co_await trainer.engine().gather_parameters());
  modules::SafetensorsFolderOptions files;  // named: GCC 12 mishandles braced temporaries in co_await
  COSHARD_CO_TRY(co_await zero::export_hf_llama(trainer.engine(), folder, kLlama, std::move(files)));
  COSHARD_CO_TRY_ASSIGN(const modules::LlamaConfig read, zero::read_hf_llama_config(folder));
  COSHARD_CO_TRY(co_await zero::load_hf_llama(trainer.engine(), folder, read));
  COSHARD_CO_TRY_ASSIGN(auto loaded, co_await trainer.engine().gather_parameters());
  for (std::size_t i = 0; i < trained.size(); ++i)
    if (loaded[i].bytes != trained[i].bytes) co_return fail(ErrorCode::internal, loaded[i].name, " changed on its way back");
  co_return losses;
}

}  // namespace

int main() {
  const auto folder = std::filesystem::temp_directory_path() / ("coshard_example_llama_" + std::to_string(::getpid()));
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
  std::filesystem::remove_all(folder);
  for (const auto& r : results)
    if (!r) return std::fprintf(stderr, "%s\n", r.error().message().c_str()), 1;
  const auto& losses = *results[0];
  std::printf("Llama (%lld parameters, every block checkpointed): loss %.4f -> %.4f\n",
              static_cast<long long>(kLlama.parameter_count()), losses.front(), losses.back());
  return losses.back() < 0.7 * losses.front() ? 0 : 1;
}
