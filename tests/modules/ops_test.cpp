// The public ops (coshard/modules/ops.hpp) on the CPU: each against a direct computation in
// double, in f64 (exact up to rounding) and bf16 (each output rounded once), and each misuse
// named. The same ops on CUDA are compared with these in CudaLayers (the GatedLinear case).
#include "coshard/modules/ops.hpp"

#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "module_fixture.hpp"

namespace coshard::modules {
namespace {

using testing::random_values;

double gelu_of(double v) {
  const double c = std::sqrt(2.0 / 3.14159265358979323846);
  return 0.5 * v * (1.0 + std::tanh(c * (v + 0.044715 * v * v * v)));
}

class Ops : public testing::ModuleFixture {
 protected:
  // The tensor's values once the stream has produced them.
  std::vector<double> values(const Result<Tensor>& t) {
    EXPECT_TRUE(t) << t.error().message();
    if (!t) return {};
    auto v = rt_.block_on(ctx_->read(*t));
    EXPECT_TRUE(v) << v.error().message();
    return v ? *v : std::vector<double>{};
  }
  std::vector<double> values(const Tensor& t) { return values(Result<Tensor>(t)); }
  Tensor input(Shape shape, std::uint64_t seed, DataType dt) {
    // rounded to dt first, so the reference starts from the values the op sees
    auto v = decode_values(encode_values(random_values(static_cast<std::size_t>(shape.numel()), seed), dt), dt);
    return host_tensor(v, shape, dt);
  }
  static double tolerance(DataType dt) { return dt == DataType::f64 ? 1e-12 : 1e-2; }
};

// op(a)[i, p] for a stored [rows, cols].
double at(const std::vector<double>& a, std::int64_t cols, bool trans, std::int64_t i, std::int64_t p) {
  return trans ? a[static_cast<std::size_t>(p * cols + i)] : a[static_cast<std::size_t>(i * cols + p)];
}

TEST_F(Ops, MatmulInEveryTransposeAndAccumulating) {
  for (DataType dt : {DataType::f64, DataType::bf16}) {
    for (bool ta : {false, true}) {
      for (bool tb : {false, true}) {
        SCOPED_TRACE(std::string(to_string(dt)) + (ta ? " a^T" : " a") + (tb ? " b^T" : " b"));
        const std::int64_t M = 3, N = 4, K = 5;
        Tensor a = input(ta ? Shape{K, M} : Shape{M, K}, 1, dt);
        Tensor b = input(tb ? Shape{N, K} : Shape{K, N}, 2, dt);
        const auto av = values(a), bv = values(b);
        const auto c = values(ops::matmul(*ctx_, a, b, {.trans_a = ta, .trans_b = tb}));
        ASSERT_EQ(c.size(), static_cast<std::size_t>(M * N));
        Tensor acc = input(Shape{M, N}, 3, dt);
        const auto before = values(acc);
        ASSERT_TRUE(ops::matmul_into(*ctx_, a, b, acc, {.trans_a = ta, .trans_b = tb, .alpha = 0.5f, .beta = 1.0f}));
        const auto after = values(acc);
        for (std::int64_t i = 0; i < M; ++i)
          for (std::int64_t j = 0; j < N; ++j) {
            double want = 0;
            for (std::int64_t p = 0; p < K; ++p)
              want += at(av, ta ? M : K, ta, i, p) * at(bv, tb ? K : N, tb, p, j);
            const auto ij = static_cast<std::size_t>(i * N + j);
            EXPECT_NEAR(c[ij], want, tolerance(dt)) << i << "," << j;
            EXPECT_NEAR(after[ij], before[ij] + 0.5 * want, 2 * tolerance(dt)) << i << "," << j;
          }
      }
    }
  }
}

TEST_F(Ops, MatmulTakesRowsOfAnyLeadingShape) {
  Tensor a = input(Shape{2, 3, 4}, 4, DataType::f64);
  Tensor w = input(Shape{5, 4}, 5, DataType::f64);  // a Linear's weight, used transposed
  auto y = ops::matmul(*ctx_, a, w, {.trans_b = true});
  ASSERT_TRUE(y) << y.error().message();
  EXPECT_EQ(y->shape(), (Shape{2, 3, 5}));
  const auto av = values(a), wv = values(w), yv = values(y);
  for (std::int64_t r = 0; r < 6; ++r)
    for (std::int64_t o = 0; o < 5; ++o) {
      double want = 0;
      for (std::int64_t p = 0; p < 4; ++p) want += av[static_cast<std::size_t>(r * 4 + p)] * wv[static_cast<std::size_t>(o * 4 + p)];
      EXPECT_NEAR(yv[static_cast<std::size_t>(r * 5 + o)], want, 1e-12);
    }
}

TEST_F(Ops, ElementwiseOpsMatchTheirDefinitions) {
  for (DataType dt : {DataType::f64, DataType::f32, DataType::bf16, DataType::f16}) {
    SCOPED_TRACE(std::string(to_string(dt)));
    const Shape shape{3, 7};
    Tensor a = input(shape, 6, dt), b = input(shape, 7, dt);
    const auto av = values(a), bv = values(b);
    const auto sum = values(ops::add(*ctx_, a, b));
    const auto product = values(ops::mul(*ctx_, a, b));
    const auto g = values(ops::gelu(*ctx_, a));
    const auto dg = values(ops::gelu_backward(*ctx_, a, b));
    const auto copied = values(ops::copy(*ctx_, a));
    const auto wide = values(ops::cast(*ctx_, a, DataType::f32));
    Tensor acc = input(shape, 8, dt);
    const auto acc0 = values(acc);
    ASSERT_TRUE(ops::add_into(*ctx_, acc, a));
    const auto added = values(acc);
    ASSERT_TRUE(ops::mul_into(*ctx_, acc, b));
    const auto multiplied = values(acc);
    ASSERT_TRUE(ops::scale_in_place(*ctx_, acc, -2.0f));
    const auto scaled = values(acc);
    const double tol = tolerance(dt) * 4;
    for (std::size_t i = 0; i < av.size(); ++i) {
      EXPECT_NEAR(sum[i], av[i] + bv[i], tol);
      EXPECT_NEAR(product[i], av[i] * bv[i], tol);
      EXPECT_NEAR(g[i], gelu_of(av[i]), dt == DataType::f64 ? 1e-12 : tol);
      const double h = 1e-6;  // gelu' by a central difference in double
      EXPECT_NEAR(dg[i], bv[i] * (gelu_of(av[i] + h) - gelu_of(av[i] - h)) / (2 * h), dt == DataType::f64 ? 1e-8 : tol);
      EXPECT_EQ(copied[i], av[i]);
      EXPECT_EQ(wide[i], static_cast<double>(static_cast<float>(av[i])));
      EXPECT_NEAR(added[i], acc0[i] + av[i], tol);
      EXPECT_NEAR(multiplied[i], added[i] * bv[i], tol);
      EXPECT_NEAR(scaled[i], -2.0 * multiplied[i], tol);
    }
  }
}

TEST_F(Ops, RowsAndColumnsAndTheWholeSum) {
  for (DataType dt : {DataType::f64, DataType::bf16}) {
    SCOPED_TRACE(std::string(to_string(dt)));
    Tensor x = input(Shape{2, 3, 5}, 9, dt);
    Tensor bias = input(Shape{5}, 10, dt);
    const auto xv = values(x), bv = values(bias);
    Tensor col = input(Shape{5}, 11, dt);
    const auto col0 = values(col);
    ASSERT_TRUE(ops::sum_rows_into(*ctx_, x, col));  // accumulates
    const auto cols = values(col);
    const auto total = values(ops::sum(*ctx_, x));
    ASSERT_TRUE(ops::add_bias(*ctx_, x, bias));
    const auto biased = values(x);
    double all = 0;
    for (std::size_t c = 0; c < 5; ++c) {
      double s = 0;
      for (std::size_t r = 0; r < 6; ++r) s += xv[r * 5 + c];
      all += s;
      EXPECT_NEAR(cols[c], col0[c] + s, tolerance(dt) * 8);
      for (std::size_t r = 0; r < 6; ++r) EXPECT_NEAR(biased[r * 5 + c], xv[r * 5 + c] + bv[c], tolerance(dt) * 4);
    }
    ASSERT_EQ(total.size(), 1u);
    EXPECT_NEAR(total[0], all, tolerance(dt) * 8);
  }
}

TEST_F(Ops, TheSumOfManyElementsIsAccurateAndRepeats) {
  // 3000 = 1000 * 3: two passes over 1000 columns; bf16 inputs are summed in f32.
  for (DataType dt : {DataType::f32, DataType::bf16}) {
    Tensor x = input(Shape{3000}, 12, dt);
    const auto xv = values(x);
    double want = 0;
    for (double v : xv) want += v;
    const auto first = values(ops::sum(*ctx_, x));
    const auto second = values(ops::sum(*ctx_, x));
    ASSERT_EQ(first.size(), 1u);
    EXPECT_NEAR(first[0], want, dt == DataType::f32 ? 1e-3 : 0.25) << to_string(dt);
    EXPECT_EQ(first, second);
  }
}

TEST_F(Ops, MisuseIsNamedAndEnqueuesNothing) {
  Tensor a = input(Shape{2, 3}, 13, DataType::f32);
  Tensor b = input(Shape{3, 2}, 14, DataType::f32);
  Tensor d = input(Shape{2, 3}, 15, DataType::f64);
  auto message = [](const auto& r) { return r ? std::string("(no error)") : r.error().message(); };
  auto expect = [&](const auto& r, std::initializer_list<const char*> parts,
                    ErrorCode code = ErrorCode::invalid_argument) {
    ASSERT_FALSE(r);
    EXPECT_EQ(r.error().code(), code) << message(r);
    for (const char* p : parts) EXPECT_NE(message(r).find(p), std::string::npos) << message(r) << " lacks " << p;
  };
  expect(ops::add(*ctx_, a, b), {"ops::add", "b is f32[3, 2]", "expected f32[2, 3]"});
  expect(ops::mul(*ctx_, a, d), {"ops::mul", "f64", "expected f32[2, 3]"});
  expect(ops::add_into(*ctx_, a, Tensor{}), {"ops::add_into", "a is empty"});
  expect(ops::matmul(*ctx_, a, a), {"ops::matmul", "3 columns", "2 rows"});
  expect(ops::matmul(*ctx_, a, d.view(Shape{3, 2})), {"ops::matmul", "expected f32"});
  expect(ops::matmul(*ctx_, a, input(Shape{3}, 16, DataType::f32)), {"ops::matmul", "b is f32[3]", "at least two dimensions"});
  Tensor out = input(Shape{2, 3}, 17, DataType::f32);
  expect(ops::matmul_into(*ctx_, a, b, out), {"ops::matmul_into", "out is f32[2, 3]", "2 rows of 2"});
  expect(ops::add_bias(*ctx_, a, input(Shape{2}, 18, DataType::f32)), {"ops::add_bias", "bias is f32[2]", "[3]"});
  expect(ops::sum_rows_into(*ctx_, a, input(Shape{3}, 19, DataType::f64)), {"ops::sum_rows_into", "out is f64[3]"});
  // A tensor of another device: refused before anything touches its (here, absent) memory.
  Tensor elsewhere(reinterpret_cast<void*>(0x1000), Shape{2, 3}, DataType::f32, async::Device::cuda(0));
  expect(ops::add(*ctx_, a, elsewhere), {"ops::add", "on cuda:0", "expected a tensor on cpu"});
  expect(ops::gelu(*ctx_, elsewhere), {"ops::gelu", "cuda:0"});
  // i32 is no compute dtype of the kernels
  Tensor ids = tokens({1, 2, 3, 4, 5, 6}, Shape{2, 3});
  expect(ops::scale_in_place(*ctx_, ids, 2.0f), {"ops::scale_in_place", "i32"}, ErrorCode::unsupported);
  // Nothing was written: the operands keep their values.
  EXPECT_EQ(values(out), values(input(Shape{2, 3}, 17, DataType::f32)));
}

}  // namespace
}  // namespace coshard::modules
