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
  // A single module name as a string, as PEFT allows.
  auto one = parse_peft_config(R"({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": "q_proj"})", "x");
  ASSERT_TRUE(one) << one.error().message();
  EXPECT_EQ(one->target_modules, std::vector<std::string>{"q_proj"});
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
