// PEFT adapter configs (zero/peft.hpp): PEFT's own adapter_config.json parses, coshard's round
// trips, and what coshard's adapters cannot be (another method, DoRA, rsLoRA, biases, patterns)
// is refused naming the key.
#include <gtest/gtest.h>

#include <string>

#include "coshard/zero/peft.hpp"

namespace coshard::zero {
namespace {

// In the form PEFT writes for a Llama (the keys its checkpoint guide lists; some left out).
constexpr std::string_view kPeftLlama = R"({
  "alpha_pattern": {}, "base_model_name_or_path": "meta-llama/Llama-3.2-1B", "bias": "none",
  "fan_in_fan_out": false, "inference_mode": true, "init_lora_weights": true, "lora_alpha": 32,
  "lora_dropout": 0.05, "modules_to_save": null, "peft_type": "LORA", "r": 16, "rank_pattern": {},
  "revision": null, "target_modules": ["v_proj", "q_proj"], "task_type": "CAUSAL_LM",
  "use_dora": false, "use_rslora": false})";

TEST(PeftConfig, PeftsOwnConfigParsesAndCoshardsRoundTrips) {
  auto c = parse_peft_config(kPeftLlama, "adapter_config.json");
  ASSERT_TRUE(c) << c.error().message();
  EXPECT_EQ(c->r, 16);
  EXPECT_EQ(c->lora_alpha, 32.0);
  EXPECT_DOUBLE_EQ(c->lora_dropout, 0.05);
  EXPECT_EQ(c->target_modules, (std::vector<std::string>{"v_proj", "q_proj"}));
  EXPECT_EQ(c->base_model_name_or_path, "meta-llama/Llama-3.2-1B");
  auto again = parse_peft_config(peft_config_json(*c), "written");
  ASSERT_TRUE(again) << again.error().message();
  EXPECT_EQ(again->r, c->r);
  EXPECT_EQ(again->lora_alpha, c->lora_alpha);
  EXPECT_EQ(again->target_modules, c->target_modules);
  EXPECT_EQ(again->base_model_name_or_path, c->base_model_name_or_path);
  // A string, as PEFT allows: a regular expression matched in full (so "q_proj" names no
  // module of a Llama, whose names are "model.layers.N.self_attn.q_proj").
  auto one = parse_peft_config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "q_proj"})", "x");
  ASSERT_TRUE(one) << one.error().message();
  EXPECT_EQ(one->target_modules, std::vector<std::string>{"q_proj"});
  EXPECT_TRUE(one->target_modules_regex);
  EXPECT_FALSE(peft_targets_module(*one, "model.layers.0.self_attn.q_proj"));
  auto none = peft_llama_targets(*one, 2, false);
  ASSERT_FALSE(none);
  EXPECT_NE(none.error().message().find("target_modules \"q_proj\" selects no module of this Llama (2 blocks)"),
            std::string::npos)
      << none.error().message();
}

// #60 item 5: PEFT's selection (tuners_utils.check_target_module_exists), key for key: a list entry
// equal to the name or its last names, narrowed by layers_to_transform under layers_pattern; a
// string matched in full; exclude_modules first; "all-linear" every linear layer but lm_head.
TEST(PeftConfig, ModulesAreSelectedAsPeftSelectsThem) {
  auto config = [](std::string_view json) {
    auto c = parse_peft_config(json, "adapter_config.json");
    EXPECT_TRUE(c) << json << ": " << c.error().message();
    return c ? *c : PeftAdapterConfig{};
  };
  const std::string q0 = "model.layers.0.self_attn.q_proj", q1 = "model.layers.1.self_attn.q_proj";
  const std::string v1 = "model.layers.1.self_attn.v_proj", up1 = "model.layers.1.mlp.up_proj";
  auto list = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "mlp.up_proj"]})");
  EXPECT_TRUE(peft_targets_module(list, q0));
  EXPECT_TRUE(peft_targets_module(list, up1));
  EXPECT_FALSE(peft_targets_module(list, v1));
  EXPECT_FALSE(peft_targets_module(list, "model.layers.1.self_attn.xq_proj")) << "a suffix after a dot only";
  auto layers = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"],
                           "layers_to_transform": [1], "layers_pattern": "layers"})");
  EXPECT_FALSE(peft_targets_module(layers, q0));
  EXPECT_TRUE(peft_targets_module(layers, q1));
  EXPECT_EQ(*peft_llama_targets(layers, 3, true), (std::vector<std::string>{q1, v1}));
  auto one_layer = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "layers_to_transform": 0})");
  EXPECT_TRUE(peft_targets_module(one_layer, q0)) << "no pattern: any name before the index";
  EXPECT_FALSE(peft_targets_module(one_layer, q1));
  auto other_pattern = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                  "layers_to_transform": [0], "layers_pattern": ["h"]})");
  EXPECT_FALSE(peft_targets_module(other_pattern, q0)) << "no index under that pattern: not adapted";
  // An exact name in the list is taken whatever layers_to_transform says (PEFT checks it first).
  auto exact = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["model.layers.0.self_attn.q_proj"],
                          "layers_to_transform": [1]})");
  EXPECT_TRUE(peft_targets_module(exact, q0));
  auto regex = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ".*\\.layers\\.1\\.self_attn\\.(q|v)_proj"})");
  EXPECT_EQ(*peft_llama_targets(regex, 2, true), (std::vector<std::string>{q1, v1}));
  auto excluded = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "exclude_modules": ["layers.0.self_attn.q_proj"]})");
  EXPECT_EQ(*peft_llama_targets(excluded, 2, true), (std::vector<std::string>{q1}));
  auto all = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "all-linear"})");
  const auto every = *peft_llama_targets(all, 1, true);
  EXPECT_EQ(every.size(), 7u) << "q, k, v, o, gate, up, down; not lm_head";
  // Values PEFT would refuse, refused by name.
  EXPECT_FALSE(parse_peft_config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "(q"})", "x"));
  EXPECT_FALSE(parse_peft_config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "layers_to_transform": [-1]})", "x"));
  EXPECT_FALSE(parse_peft_config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "layers_pattern": 3})", "x"));
  // Outside regular expressions cannot hang or overflow a run: a pattern that backtracks
  // exponentially answers at once, a back-reference or deep nesting is refused by name.
  auto slow = config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "(m*.*)*x"})");
  EXPECT_FALSE(peft_targets_module(slow, "model.layers.1000.self_attn.q_proj_q_proj_q_proj"));
  auto refused = [](std::string_view json) {
    auto r = parse_peft_config(json, "adapter_config.json");
    return r ? std::string("(accepted)") : r.error().message();
  };
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "(q)\\1_proj"})").find("target_modules="),
            std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ")" + std::string(40, '(') +
                    std::string(40, ')') + R"("})")
                .find("at most 1024 characters and 16 nested groups"),
            std::string::npos);
}

TEST(PeftConfig, WhatCoshardCannotLoadIsRefusedNamingTheKey) {
  auto refused = [](std::string_view json) {
    auto r = parse_peft_config(json, "adapter_config.json");
    return r ? std::string("(accepted)") : r.error().message();
  };
  EXPECT_NE(refused("[1, 2]").find("not a JSON object"), std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "IA3", "r": 8, "lora_alpha": 8})").find("peft_type=\"IA3\""), std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 0, "lora_alpha": 8})").find("r=0"), std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "lora_alpha": 8})").find("r=(missing)"), std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 8, "lora_alpha": "8"})").find("lora_alpha=\"8\""), std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "lora_dropout": 1})").find("lora_dropout=1"),
            std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "use_dora": true})").find("use_dora=true"),
            std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "use_rslora": true})").find("use_rslora=true"),
            std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "bias": "all"})").find("bias=\"all\""),
            std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "rank_pattern": {"q_proj": 4}})").find("rank_pattern="),
            std::string::npos);
  EXPECT_NE(refused(R"({"peft_type": "LORA", "r": 8, "lora_alpha": 8, "target_modules": [1]})").find("target_modules="),
            std::string::npos);
}

}  // namespace
}  // namespace coshard::zero
