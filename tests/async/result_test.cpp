// coshard::Result (coshard's own value-or-error, the same type in C++20 and C++23 consumers) and
// UniqueFunction (the move-only callable of stream launches, inline for small closures).
#include <gtest/gtest.h>

#include "support/sanitizers.hpp"

#include <memory>
#include <string>

#include "coshard/async/detail/unique_function.hpp"
#include "coshard/async/result.hpp"

namespace coshard {
namespace {

struct Base {
  virtual ~Base() = default;
  virtual int id() const { return 1; }
};
struct Derived final : Base {
  int id() const override { return 2; }
};

Result<int> parse(const std::string& s) {
  if (s.empty()) return fail(ErrorCode::invalid_argument, "value '", s, "': expected digits");
  return std::stoi(s);
}

Result<int> twice(const std::string& s) {
  COSHARD_TRY_ASSIGN(const int v, parse(s));
  return 2 * v;
}

Result<void> check(int v) {
  if (v < 0) return fail(ErrorCode::out_of_range, "v=", v);
  return {};
}

TEST(Result, HoldsAValueOrANamedError) {
  auto ok = twice("21");
  ASSERT_TRUE(ok);
  EXPECT_TRUE(ok.has_value());
  EXPECT_EQ(*ok, 42);
  EXPECT_EQ(ok.value(), 42);
  EXPECT_EQ(ok.value_or(7), 42);

  auto bad = twice("");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.error().code(), ErrorCode::invalid_argument);
  EXPECT_EQ(bad.error().message(), "value '': expected digits");
  EXPECT_EQ(bad.value_or(7), 7);
  Error moved = std::move(bad).error().with_context("reading --steps");
  EXPECT_EQ(moved.message(), "reading --steps: value '': expected digits");

  EXPECT_TRUE(check(1));
  auto negative = check(-1);
  ASSERT_FALSE(negative);
  EXPECT_EQ(negative.error().message(), "v=-1");
  Result<void> cleared = std::move(negative);
  cleared.emplace();
  EXPECT_TRUE(cleared);
}

TEST(Result, MovesOnlyValuesAndConvertsThem) {
  Result<std::unique_ptr<Base>> base = std::make_unique<Derived>();  // converts unique_ptr<Derived>
  ASSERT_TRUE(base);
  EXPECT_EQ((*base)->id(), 2);
  Result<std::unique_ptr<Derived>> derived = std::make_unique<Derived>();
  Result<std::unique_ptr<Base>> from_result = std::move(derived);  // a Result of another value type
  ASSERT_TRUE(from_result);
  EXPECT_EQ(from_result.value()->id(), 2);
  Result<std::unique_ptr<Derived>> failed = fail(ErrorCode::io, "disk");
  Result<std::unique_ptr<Base>> failed_too = std::move(failed);
  ASSERT_FALSE(failed_too);
  EXPECT_EQ(failed_too.error().message(), "disk");
  std::unique_ptr<Base> taken = *std::move(from_result);
  EXPECT_EQ(taken->id(), 2);
  Result<std::string> text;  // a default value, as std::expected
  ASSERT_TRUE(text);
  EXPECT_EQ(text->size(), 0u);
  text.emplace(3, 'x');
  EXPECT_EQ(*text, "xxx");
  Result<std::string> copy = text;  // copyable when the value is
  EXPECT_EQ(*copy, "xxx");
}

// What a stream does when memory runs out mid-message: it stops writing and sets badbit.
struct StreamThatRunsOutOfMemory {};
std::ostream& operator<<(std::ostream& out, StreamThatRunsOutOfMemory) {
  out.setstate(std::ios::badbit);
  return out;
}

// A cut message ("worker thre") named nothing (CI's address-space test): such an error says that
// memory ran out instead, through fail() and detail::concat alike.
TEST(Result, AMessageCutForWantOfMemorySaysSo) {
  const Result<int> r = fail(ErrorCode::out_of_memory, "worker thre", StreamThatRunsOutOfMemory{}, "ad died");
  ASSERT_FALSE(r);
  EXPECT_EQ(r.error().code(), ErrorCode::out_of_memory);
  EXPECT_EQ(r.error().message(), *detail::message_lost_for_memory());
  EXPECT_EQ(detail::concat("a", StreamThatRunsOutOfMemory{}, "b"), *detail::message_lost_for_memory());
  EXPECT_EQ(detail::concat("a", 1, "b"), "a1b");
}

#if !defined(COSHARD_TEST_TSAN)
TEST(ResultDeathTest, ValueOfAnErrorAbortsNamingIt) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_DEATH((void)twice("").value(), "Result::value\\(\\) on an error: value '': expected digits");
  EXPECT_DEATH((void)twice("3").error(), "Result::error\\(\\) on a value");
}
#endif

TEST(UniqueFunction, CallsSmallAndLargeClosuresAndDestroysEachOnce) {
  auto alive = std::make_shared<int>(0);
  struct Counted {
    std::shared_ptr<int> alive;
    explicit Counted(std::shared_ptr<int> a) : alive(std::move(a)) { ++*alive; }
    Counted(Counted&& o) noexcept : alive(o.alive) { ++*alive; }
    ~Counted() { --*alive; }
  };
  {
    auto owned = std::make_unique<int>(5);
    async::detail::UniqueFunction<int(int)> small = [p = std::move(owned), c = Counted(alive)](int x) { return *p + x; };
    char big_state[256] = {3};
    async::detail::UniqueFunction<int(int)> large = [big_state, c = Counted(alive)](int x) { return big_state[0] + x; };
    EXPECT_EQ(*alive, 2);
    EXPECT_EQ(small(1), 6);
    EXPECT_EQ(large(1), 4);
    auto moved_small = std::move(small);
    auto moved_large = std::move(large);
    EXPECT_FALSE(small);  // NOLINT(bugprone-use-after-move): moved-from is empty
    EXPECT_FALSE(large);  // NOLINT(bugprone-use-after-move)
    EXPECT_EQ(*alive, 2) << "a move leaves one closure each";
    EXPECT_EQ(moved_small(2), 7);
    EXPECT_EQ(moved_large(2), 5);
    moved_small = std::move(moved_large);  // the small one is destroyed, the large one moves over
    EXPECT_EQ(*alive, 1);
    EXPECT_EQ(moved_small(0), 3);
  }
  EXPECT_EQ(*alive, 0) << "every closure destroyed exactly once";
  async::detail::UniqueFunction<Result<void>()> fallible = [] { return check(-2); };
  EXPECT_EQ(fallible().error().message(), "v=-2");
}

}  // namespace
}  // namespace coshard
