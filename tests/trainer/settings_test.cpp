// The settings table (trainer/settings.hpp) against every path made from it: each setting, the
// ones added later included, is reached through the builder, the JSON config (its own name and
// its DeepSpeed key) and coshard-train's flag (--print-config), and refused out of range by name
// on each. Nothing here names a setting except where its neighbours must make a value valid.
#include <gtest/gtest.h>

#include <charconv>
#include <cmath>
#include <sstream>
#include <map>
#include <set>
#include <string>

#include "../support/on_ranks.hpp"
#include "binary_harness.hpp"
#include "coshard/modules/gpt.hpp"
#include "coshard/trainer/settings.hpp"
#include "coshard/trainer/trainer.hpp"

namespace coshard::trainer {
namespace {

using nlohmann::json;
using testing::run;
using testing::scratch;

// What must hold beside a setting's new value for the whole config to be valid (by name).
const std::map<std::string, std::vector<std::pair<std::string, std::string>>> kContext = {
    {"step_in_backward", {{"offload_optimizer", "cpu"}, {"max_grad_norm", "0"}}},
    {"decay", {{"decay_steps", "10"}}},
    {"offload_params", {{"offload_optimizer", "cpu"}}},
    {"swap_gradients", {{"offload_optimizer", "nvme:swap"}}},
};

TrainerConfig base_for(const Setting& s) {
  TrainerConfig c;
  if (auto it = kContext.find(std::string(s.name)); it != kContext.end())
    for (const auto& [name, text] : it->second) EXPECT_TRUE(find_setting(name)->set(c, text)) << name;
  return c;
}

// A valid value other than the default, as text in the setting's own form.
std::string other_value(const Setting& s, const TrainerConfig& c) {
  const std::string now = s.value(c);
  switch (s.kind) {
    case SettingKind::integer:
      return std::to_string(static_cast<long long>(std::stold(now) == s.min ? s.min + 1 : s.min));
    case SettingKind::bytes:
      return now == "auto" ? "4096" : std::to_string(std::stoull(now) + 4096);
    case SettingKind::real: {
      const double v = now.empty() ? 0.0 : std::stod(now);
      char text[64];
      const auto end = std::to_chars(text, text + sizeof text, v == 0 ? 1e-4f : static_cast<float>(v * 0.5)).ptr;
      return std::string(text, end);
    }
    case SettingKind::boolean:
      return now == "true" ? "false" : "true";
    case SettingKind::choice:
      for (const auto choice : s.choices)
        if (choice != now) return std::string(choice);
      return s.name == "activation_checkpointing" ? "full" : "cpu";  // the forms of their own
  }
  return {};
}

// The value as the JSON config takes it (numbers as numbers, switches as true/false).
json as_json(const Setting& s, const std::string& text) {
  if (s.kind == SettingKind::boolean) return text == "true";
  if (s.kind == SettingKind::integer || s.kind == SettingKind::real) return json::parse(text);
  if (s.kind == SettingKind::bytes && text != "auto") return json::parse(text);
  return text;
}

TEST(Settings, NamesFlagsAndDeepSpeedKeysAreEachOnceAndFound) {
  std::set<std::string_view> seen;
  for (const auto& s : settings()) {
    for (const auto key : {s.name, s.flag, s.deepspeed}) {
      if (key.empty() || (key == s.deepspeed && key == s.name)) continue;  // (DeepSpeed's name is coshard's)
      EXPECT_TRUE(seen.insert(key).second) << key << " twice";
      EXPECT_EQ(find_setting(key), &s) << key;
    }
    EXPECT_FALSE(s.help.empty()) << s.name;
    EXPECT_TRUE(s.get && s.parse && s.check) << s.name;
  }
  EXPECT_EQ(find_setting("no_such_setting"), nullptr);
}

TEST(Settings, EachDefaultIsInRangeAndReadsBackAsItself) {
  const TrainerConfig defaults;
  for (const auto& s : settings()) {
    EXPECT_TRUE(s.validate(defaults)) << s.name;
    const std::string text = s.value(defaults);
    if (text.empty()) continue;  // an optional left unset
    TrainerConfig c;
    ASSERT_TRUE(s.set(c, text)) << s.name << "=" << text;
    EXPECT_EQ(s.value(c), text) << s.name;
    EXPECT_EQ(settings_json(c), settings_json(defaults)) << s.name;
  }
}

// The builder and the JSON config (coshard's name, and DeepSpeed's key where there is one) set
// the same value into the same field as the setting itself does.
TEST(Settings, EverySettingReachesItsFieldThroughTheBuilderAndTheJsonConfig) {
  for (const auto& s : settings()) {
    const TrainerConfig base = base_for(s);
    const std::string text = other_value(s, base);
    TrainerConfig want = base;
    ASSERT_TRUE(s.set(want, text)) << s.name << "=" << text;
    ASSERT_NE(s.value(want), s.value(base)) << s.name << ": " << text << " changes nothing";
    ASSERT_TRUE(want.validate()) << s.name << "=" << text << ": " << want.validate().error().message();
    const std::string expected = settings_json(want);

    TrainerBuilder builder(base);
    builder.set(s.name, text);
    EXPECT_EQ(settings_json(builder.config()), expected) << "builder: " << s.name;

    json own = json::object();
    own[std::string(s.name)] = as_json(s, text);
    auto from_own = TrainerConfig::from_json(own.dump(), base);
    ASSERT_TRUE(from_own) << own.dump() << ": " << from_own.error().message();
    EXPECT_EQ(settings_json(*from_own), expected) << own.dump();

    if (s.deepspeed.empty() || text == "auto") continue;
    json deepspeed = json::object();
    json* at = &deepspeed;
    std::string_view path = s.deepspeed;
    for (auto dot = path.find('.'); dot != std::string_view::npos; dot = path.find('.')) {
      at = &(*at)[std::string(path.substr(0, dot))];
      path.remove_prefix(dot + 1);
    }
    // DeepSpeed counts these sizes in elements: 4 bytes each in f32.
    (*at)[std::string(path)] = s.deepspeed_elements ? json(std::stoull(text) / 4) : as_json(s, text);
    auto from_deepspeed = TrainerConfig::from_json(deepspeed.dump(), base);
    ASSERT_TRUE(from_deepspeed) << deepspeed.dump() << ": " << from_deepspeed.error().message();
    EXPECT_EQ(settings_json(*from_deepspeed), expected) << deepspeed.dump();
  }
}

// Values just past a bound, as text: below the least allowed, above the most (where finite).
std::vector<std::string> out_of_range(const Setting& s) {
  std::vector<std::string> out;
  if (s.kind != SettingKind::integer && s.kind != SettingKind::real) return out;
  auto text = [&](long double v) {
    std::ostringstream o;
    o.precision(s.kind == SettingKind::integer ? 21 : 9);
    o << (s.kind == SettingKind::integer ? std::floor(v) : v);
    return o.str();
  };
  out.push_back(text(s.min_open ? s.min : s.min - 1));
  if (std::isfinite(s.max)) out.push_back(text(s.max_open ? s.max : s.max + (s.kind == SettingKind::integer ? 1 : s.max)));
  return out;
}

TEST(Settings, OutOfRangeIsRefusedByNameOnEveryPath) {
  int cases = 0;
  for (const auto& s : settings()) {
    for (const auto& bad : out_of_range(s)) {
      ++cases;
      const TrainerConfig base = base_for(s);
      TrainerConfig c = base;
      auto set = s.set(c, bad);
      ASSERT_FALSE(set) << s.name << "=" << bad;
      EXPECT_NE(set.error().message().find(std::string(s.name)), std::string::npos) << set.error().message();
      EXPECT_EQ(settings_json(c), settings_json(base)) << s.name << ": a refused value changed the config";
      // Placed into the field without the range check, validate() names it.
      TrainerConfig placed = base;
      if (s.parse(s, placed, bad)) {
        auto valid = placed.validate();
        ASSERT_FALSE(valid) << s.name << "=" << bad;
        EXPECT_NE(valid.error().message().find(std::string(s.name) + "="), std::string::npos) << valid.error().message();
      }
      json own = json::object();
      own[std::string(s.name)] = json::parse(bad);
      auto from = TrainerConfig::from_json(own.dump(), base);
      ASSERT_FALSE(from) << own.dump();
      EXPECT_NE(from.error().message().find(std::string(s.name)), std::string::npos) << from.error().message();
    }
  }
  EXPECT_GT(cases, 30);
}

TEST(Settings, TheBuilderNamesABadSettingWhenItBuilds) {
  auto errors = testing::on_ranks(1, [](int, collectives::Communicator& comm) -> async::Task<Result<void>> {
    COSHARD_CO_TRY_ASSIGN(auto model, modules::make_gpt({.vocab = 16, .max_seq = 8, .dim = 8, .layers = 1, .heads = 2}));
    struct Case {
      std::string name, value, expect;
    };
    const Case cases[] = {
        {"zero_stage", "4", "zero_stage=4: expected 0, 1, 2 or 3"},
        {"no_such_setting", "1", "no_such_setting\"): no such setting (expected one of zero_stage, "},
        {"max_live_bytes", "12parsecs", "max_live_bytes=12parsecs: size '12parsecs': unknown unit"},
        {"fetch_mode", "broadcast", "fetch_mode=broadcast: expected all_gather or all_reduce"},
    };
    for (const auto& k : cases) {
      TrainerBuilder b;
      b.communicator(comm).set(k.name, k.value).set("zero_stage", 2);  // (the first one is named)
      auto t = co_await b.build(*model);
      EXPECT_FALSE(t) << k.name;
      if (!t) EXPECT_NE(t.error().message().find(k.expect), std::string::npos) << t.error().message();
    }
    TrainerBuilder good;
    good.communicator(comm).set("zero_stage", 2).set("lr", 1e-3).set("timing", false).set("max_live_bytes", "64MiB");
    EXPECT_EQ(good.config().zero_stage, 2);
    EXPECT_FLOAT_EQ(good.config().lr, 1e-3f);
    EXPECT_FALSE(good.config().timing);
    EXPECT_EQ(good.config().max_live_bytes, std::size_t{64} << 20);
    EXPECT_FALSE(good.config().max_live_follows_model);
    COSHARD_CO_TRY(co_await good.build(*model));
    co_return Result<void>{};
  });
  EXPECT_TRUE(errors.empty()) << errors.front();
}

// coshard-train's flag for each setting sets what the setting does (--print-config shows the
// run's settings as JSON), and that JSON, given back as --config, is the same run.
TEST(Settings, EveryFlagReachesItsSettingAndPrintConfigReadsBack) {
  const auto dir = scratch("settings_flags");
  int flags = 0;
  for (const auto& s : settings()) {
    if (s.flag.empty()) continue;
    ++flags;
    const TrainerConfig base = base_for(s);
    const std::string text = other_value(s, base);
    TrainerConfig want = base;
    ASSERT_TRUE(s.set(want, text)) << s.name;
    std::vector<std::string> args = {"--print-config"};
    if (auto it = kContext.find(std::string(s.name)); it != kContext.end())
      for (const auto& [name, value] : it->second) args.insert(args.end(), {std::string(find_setting(name)->flag), value});
    args.push_back(std::string(s.flag));
    if (s.kind != SettingKind::boolean) args.push_back(text);
    else ASSERT_EQ(text, s.switch_sets ? "true" : "false") << s.flag << " cannot set " << text;
    const auto r = run(args, dir);
    ASSERT_EQ(r.code, 0) << s.flag << " " << text << ": " << r.output;
    const json printed = json::parse(r.output, nullptr, false);
    ASSERT_FALSE(printed.is_discarded()) << r.output;
    EXPECT_EQ(printed, json::parse(settings_json(want))) << s.flag << " " << text;

    std::ofstream(dir / "printed.json") << r.output;
    const auto again = run({"--config", (dir / "printed.json").string(), "--print-config"}, dir);
    ASSERT_EQ(again.code, 0) << again.output;
    EXPECT_EQ(json::parse(again.output, nullptr, false), printed) << s.flag;
  }
  EXPECT_GT(flags, 25);
  const auto bad = run({"--print-config", "--eval-batches", "0"}, dir);
  EXPECT_EQ(bad.code, 2);
  EXPECT_NE(bad.output.find("--eval-batches: eval_batches=0: expected 1 to 2^30"), std::string::npos) << bad.output;
}

}  // namespace
}  // namespace coshard::trainer
