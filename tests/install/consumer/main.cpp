// Builds against the installed coshard package and runs one awaited stream round trip.
#include <coshard/coshard.hpp>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

int main() {
  using namespace coshard::async;
  Runtime rt;
  auto stream = Stream::create(Device::cpu());
  if (!stream) {
    std::fprintf(stderr, "%s\n", stream.error().message().c_str());
    return 1;
  }
  int value = 0;
  auto r = rt.block_on([](Stream& s, int& value) -> Task<coshard::Result<int>> {
    COSHARD_CO_TRY(s.launch([&value] { value = 42; }));
    COSHARD_CO_TRY_ASSIGN(Event done, s.record());
    COSHARD_CO_TRY(co_await done);
    co_return value;
  }(*stream, value));
  if (!r || *r != 42) {
    std::fprintf(stderr, "consumer: unexpected result\n");
    return 1;
  }
  // The modules link too (OpenBLAS comes through the installed config): one GPT forward.
  namespace m = coshard::modules;
  auto allocator = CachingAllocator::create(Device::cpu());
  if (!allocator) return 1;
  auto logits = rt.block_on([](Stream& s, CachingAllocator& a) -> Task<coshard::Result<std::size_t>> {
    COSHARD_CO_TRY_ASSIGN(auto ctx, m::Context::create(s, a));
    m::GptConfig config;
    config.vocab = 32;
    config.max_seq = 8;
    config.dim = 16;
    config.layers = 1;
    config.heads = 2;
    COSHARD_CO_TRY_ASSIGN(auto model, m::make_gpt(config));
    COSHARD_CO_TRY_ASSIGN(auto store, m::ParameterStore::create(ctx, *model, m::DataType::f32));
    COSHARD_CO_TRY(co_await store.initialize(ctx, 1));
    const std::vector<double> ids{1, 2, 3, 4};
    const auto bytes = m::encode_values(ids, m::DataType::i32);
    COSHARD_CO_TRY_ASSIGN(m::Tensor tokens, ctx.upload(bytes, m::Shape{1, 4}, m::DataType::i32));
    COSHARD_CO_TRY_ASSIGN(m::Tensor out, co_await ctx.forward(*model, tokens));
    COSHARD_CO_TRY_ASSIGN(auto values, co_await ctx.read(out));
    co_return values.size();
  }(*stream, **allocator));
  if (!logits || *logits != 4 * 32) {
    std::fprintf(stderr, "consumer: GPT forward failed: %s\n", logits ? "wrong size" : logits.error().message().c_str());
    return 1;
  }
  // The trainer and the memory estimate through the umbrella: one ZeRO-3 step on one Local rank.
  namespace t = coshard::trainer;
  auto comms = coshard::collectives::make_local_communicators(1);
  if (!comms) return 1;
  auto trained = rt.block_on([](coshard::collectives::Communicator& comm) -> Task<coshard::Result<double>> {
    m::GptConfig config{.vocab = 32, .max_seq = 8, .dim = 16, .layers = 1, .heads = 2};
    COSHARD_CO_TRY_ASSIGN(auto model, m::make_gpt(config));
    t::TrainerConfig c;
    c.zero_stage = 3;
    COSHARD_CO_TRY_ASSIGN(auto estimate, t::estimate_memory(c, *model, 1, {.rows_per_rank = 2, .seq = 8}));
    if (estimate.bytes(coshard::zero::MemoryPlace::device) == 0) co_return coshard::fail(coshard::ErrorCode::internal, "no estimate");
    t::TrainerBuilder builder(c);
    builder.communicator(comm);
    COSHARD_CO_TRY_ASSIGN(t::Trainer trainer, co_await builder.build(*model));
    const t::SyntheticTask task(config.vocab, 1);
    COSHARD_CO_TRY_ASSIGN(auto stats, co_await trainer.step(task.batch(0, 2, 8)));
    co_return stats.loss;
  }(*comms->front()));
  if (!trained || !(*trained > 0)) {
    std::fprintf(stderr, "consumer: trainer step failed: %s\n", trained ? "no loss" : trained.error().message().c_str());
    return 1;
  }
  // A mixture of experts with its experts over 2 ranks (threads, each its own runtime): the mesh's
  // expert groups, make_llama_expert_parallel and the trainer over the mesh, from the installed headers.
  auto pair = coshard::collectives::make_local_communicators(2);
  if (!pair) return 1;
  std::vector<double> moe_losses(2, 0.0);
  std::vector<std::string> moe_errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r)
    ranks.emplace_back([&, r] {
      Runtime own;
      auto done = own.block_on([](coshard::collectives::Communicator& comm) -> Task<coshard::Result<double>> {
        COSHARD_CO_TRY_ASSIGN(auto mesh, coshard::collectives::Mesh::create(comm, {.expert = 2}));
        m::LlamaConfig config;
        config.vocab = 32;
        config.max_seq = 8;
        config.dim = 16;
        config.heads = 2;
        config.kv_heads = 1;
        config.intermediate = 16;
        config.family = m::HfFamily::qwen3_moe;
        config.moe.experts = 4;
        config.moe.top_k = 2;
        COSHARD_CO_TRY_ASSIGN(auto model, m::make_llama_expert_parallel(config, mesh.expert()));
        t::TrainerConfig c;
        c.zero_stage = 3;
        t::TrainerBuilder builder(c);
        builder.mesh(mesh);
        COSHARD_CO_TRY_ASSIGN(t::Trainer trainer, co_await builder.build(*model));
        const t::SyntheticTask task(config.vocab, 1);
        const auto global = task.batch(0, 4, 8);
        COSHARD_CO_TRY_ASSIGN(auto stats, co_await trainer.step(global.rank_rows(mesh.data_rank(), mesh.data_size())));
        co_return stats.loss;
      }(*(*pair)[static_cast<std::size_t>(r)]));
      if (done) moe_losses[static_cast<std::size_t>(r)] = *done;
      else moe_errors[static_cast<std::size_t>(r)] = done.error().message();
    });
  for (auto& t : ranks) t.join();
  if (!moe_errors[0].empty() || !moe_errors[1].empty() || !(moe_losses[0] > 0)) {
    std::fprintf(stderr, "consumer: expert-parallel step failed: %s %s\n", moe_errors[0].c_str(), moe_errors[1].c_str());
    return 1;
  }
  std::printf("consumer: ok (C++ %ld)\n", static_cast<long>(__cplusplus));
  return 0;
}
