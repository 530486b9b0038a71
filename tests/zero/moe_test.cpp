// Mixture-of-experts Llamas under the engine (modules/moe.hpp): make_llama with experts, the
// load-balancing loss on, trained at every stage, worlds 1-4, coalesced and one-unit experts, cpu
// and nvme offload, accumulation and activation checkpointing, against the unsharded single-rank
// run of the same micro-batches (each rank's micro-batch one of the reference's: the auxiliary
// loss is per micro-batch, as transformers computes it inside a DDP or FSDP step). And ranks whose
// tokens route to disjoint experts: none hangs, each runs the union, and experts nobody chose
// keep their bits (no decay, no moments).
#include <gtest/gtest.h>

#include "moe_harness.hpp"

namespace coshard::zero {
namespace {

using namespace moe_testing;

TEST(MixtureOfExperts, EveryStageAndWorldTrainsTheUnshardedModel) {
  std::vector<Layout> cases;
  for (int stage = 0; stage <= 3; ++stage)
    for (int world = 1; world <= 4; ++world) cases.push_back({.world = world, .stage = stage});
  cases.push_back({.world = 3, .stage = 3, .variant = Variant::qwen});
  cases.push_back({.world = 2, .stage = 1, .variant = Variant::qwen});
  for (const auto& k : cases) {
    auto got = train(k);
    ASSERT_TRUE(got) << k.name() << ": " << got.error().message();
    expect_close(*got, reference(k), k.name());
  }
}

TEST(MixtureOfExperts, ComposesWithCoalescingOffloadAccumulationAndCheckpointing) {
  const std::vector<Layout> cases = {
      {.world = 2, .stage = 3, .coalesced = true},
      {.world = 4, .stage = 3, .variant = Variant::qwen, .coalesced = true},
      {.world = 2, .stage = 3, .micro_batches = 2},
      {.world = 2, .stage = 2, .micro_batches = 2, .variant = Variant::qwen},
      {.world = 2, .stage = 3, .checkpointed = true},
      {.world = 2, .stage = 3, .micro_batches = 2, .coalesced = true, .checkpointed = true},
      {.world = 2, .stage = 3, .optimizer = OffloadTarget::cpu, .params = OffloadTarget::cpu},
      {.world = 2, .stage = 3, .optimizer = OffloadTarget::nvme},
      {.world = 2, .stage = 2, .variant = Variant::qwen, .optimizer = OffloadTarget::cpu},
  };
  for (const auto& k : cases) {
    auto got = train(k);
    ASSERT_TRUE(got) << k.name() << ": " << got.error().message();
    expect_close(*got, reference(k), k.name());
  }
}

// Rank 0's tokens go to experts 0-1, rank 1's to 2-3, nobody's to 4-5: every stage finishes (each
// rank runs the union, 2 of its 4 experts on no rows), equals the reference, and experts 4-5 keep
// their bits through three AdamW steps with weight decay, while the others train.
TEST(MixtureOfExperts, RanksRoutingToDisjointExpertsAgreeAndLeaveUnusedExpertsUntouched) {
  for (int stage = 0; stage <= 3; ++stage)
    for (bool coalesced : {false, true}) {
      const Layout k{.world = 2, .stage = stage, .coalesced = coalesced, .disjoint = true};
      auto got = train(k);
      ASSERT_TRUE(got) << k.name() << ": " << got.error().message();
      expect_close(*got, reference(k), k.name());
      EXPECT_EQ(got->most_experts_used, 2) << k.name() << ": rank 0 routes to experts 0 and 1 alone";
      for (const auto& [name, values] : got->whole) {
        if (name.find(".experts.") == std::string::npos) continue;
        const bool unused = name.find(".experts.4.") != std::string::npos || name.find(".experts.5.") != std::string::npos;
        const bool same = values == got->initial.at(name);
        EXPECT_EQ(same, unused) << k.name() << ": " << name << (unused ? " changed, though no rank routed to it" : " did not train");
      }
    }
}

// At stage 3 the experts nobody routed to are never gathered: every step gathers exactly their
// bytes (both layers' experts 4 and 5, in forward and in backward) fewer than the same run with
// every expert running; each expert is a unit of its own, coalesced or not (a unit spanning two
// experts would be gathered for either).
TEST(MixtureOfExperts, AtStageThreeOnlyTheRoutedExpertsAreGathered) {
  for (bool coalesced : {false, true}) {
    const Layout routed{.world = 2, .stage = 3, .coalesced = coalesced, .disjoint = true};
    Layout every = routed;
    every.every_expert = true;
    auto a = train(routed), b = train(every);
    ASSERT_TRUE(a) << a.error().message();
    ASSERT_TRUE(b) << b.error().message();
    std::size_t unused = 0;
    for (const auto& u : a->units) {
      const bool expert = u.name.find(".experts.") != std::string::npos;
      EXPECT_EQ(u.routed, expert) << u.name;
      for (const auto& p : u.parameters)
        if (expert) {
          EXPECT_EQ(p.substr(0, p.find(".experts.") + 10), u.name.substr(0, u.name.find(".experts.") + 10))
              << u.name << " holds " << p << ": a unit spans two experts";
        }
      if (u.name.find(".experts.4.") != std::string::npos || u.name.find(".experts.5.") != std::string::npos)
        unused += u.padded_bytes;
    }
    ASSERT_GT(unused, 0u);
    ASSERT_EQ(a->gathered_bytes.size(), b->gathered_bytes.size());
    for (std::size_t i = 0; i < a->gathered_bytes.size(); ++i)
      EXPECT_EQ(a->gathered_bytes[i] + 2 * unused, b->gathered_bytes[i]) << routed.name() << ": step " << i;
  }
}

TEST(MixtureOfExperts, BadSettingsAreRefusedByName) {
  auto refused = [](modules::LlamaConfig c, const std::string& expected) {
    auto model = modules::make_llama(c);
    ASSERT_FALSE(model) << expected;
    EXPECT_NE(model.error().message().find(expected), std::string::npos) << model.error().message();
  };
  auto c = moe_llama(Variant::qwen);
  c.moe.top_k = 0;
  refused(c, "top_k=0");
  c = moe_llama(Variant::qwen);
  c.moe.top_k = 7;
  refused(c, "top_k=7");
  c = moe_llama(Variant::qwen);
  c.moe.dense_layers = {3};
  refused(c, "layer 3");
  c = moe_llama(Variant::qwen);
  c.moe.dense_layers = {0, 1, 2};
  refused(c, "no layer takes them");
  c = moe_llama(Variant::qwen);
  c.moe.sparse_step = 0;
  refused(c, "sparse_step=0");
  c = moe_llama(Variant::qwen);
  c.moe.aux_loss_coef = -1;
  refused(c, "aux_loss_coef=-1");
  c = moe_llama(Variant::mixtral);
  c.moe.renormalize = false;
  refused(c, "renormalize=false: a Mixtral renormalises");
  c = moe_llama(Variant::mixtral);
  c.moe.experts = 0;
  refused(c, "a Mixtral has experts");
  EXPECT_FALSE(modules::check_tensor_parallel(moe_llama(Variant::mixtral), 2));
}

}  // namespace
}  // namespace coshard::zero
