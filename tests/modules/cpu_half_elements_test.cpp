// The CPU's element-wise kernels on bf16/f16 tensors in place (kernels/cpu/elements.hpp: each value
// widened to f32 where read, rounded once where written, no f32 copies): every kernel's output
// has the bits of the f32 kernel on the widened values, rounded once (what the copies gave),
// weight and bias gradients accumulated into (summed in f32 over the rows, rounded once) included,
// at sizes off every vector width and split across threads; and the half cross-entropy (its
// exponentials approximated) within its rounding of f64.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "coshard/async/dtype.hpp"
#include "coshard/async/stream.hpp"
#include "kernels/kernels.hpp"

namespace coshard::modules::detail {
namespace {

// A tensor held both ways: in dt (bf16/f16) and as the f32 values those hold.
struct Held {
  DataType dt = DataType::bf16;
  std::vector<std::uint16_t> half;
  std::vector<float> wide;
  void* at(DataType as) { return as == DataType::f32 ? static_cast<void*>(wide.data()) : static_cast<void*>(half.data()); }
};

std::uint16_t round_to(DataType dt, float v) {
  return dt == DataType::bf16 ? async::float_to_bf16(v) : async::float_to_f16(v);
}
float widened(DataType dt, std::uint16_t h) {
  return dt == DataType::bf16 ? async::bf16_to_float(h) : async::f16_to_float(h);
}

Held random_held(DataType dt, std::int64_t n, unsigned seed, float scale = 1.0f, float mean = 0.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(mean, scale);
  Held h{dt, {}, {}};
  for (std::int64_t i = 0; i < n; ++i) {
    h.half.push_back(round_to(dt, normal(rng)));
    h.wide.push_back(widened(dt, h.half.back()));
  }
  return h;
}
Held zeros(DataType dt, std::int64_t n) { return Held{dt, std::vector<std::uint16_t>(static_cast<std::size_t>(n)), std::vector<float>(static_cast<std::size_t>(n))}; }

// The half kernel's output equals the f32 kernel's, rounded once.
void expect_rounded(const Held& out, const std::string& what) {
  int wrong = 0;
  for (std::size_t i = 0; i < out.half.size(); ++i) {
    if (out.half[i] != round_to(out.dt, out.wide[i]) && ++wrong <= 3)
      ADD_FAILURE() << what << "[" << i << "]: " << widened(out.dt, out.half[i]) << ", the f32 kernel's rounded "
                    << widened(out.dt, round_to(out.dt, out.wide[i]));
  }
  EXPECT_EQ(wrong, 0) << what;
}

class CpuHalfElements : public ::testing::TestWithParam<DataType> {
 protected:
  void SetUp() override {
    auto s = async::Stream::create(async::Device::cpu(), {.name = "elements"});
    ASSERT_TRUE(s) << s.error().message();
    stream_ = std::make_unique<async::Stream>(std::move(*s));
  }
  // launch(dt) in the half type and in f32, each run to its end.
  template <class Launch>
  void both(Launch launch) {
    for (const DataType as : {GetParam(), DataType::f32}) {
      const Result<void> r = launch(as);
      ASSERT_TRUE(r) << r.error().message();
      ASSERT_TRUE(stream_->synchronize());
    }
  }
  const Kernels& k_ = cpu_kernels();
  std::unique_ptr<async::Stream> stream_;
};

// Rows and widths off every vector width, enough rows to split across the math threads.
constexpr std::int64_t N = 301, C = 203, I = 77;

TEST_P(CpuHalfElements, NormsHaveTheF32KernelsBitsRoundedOnce) {
  const DataType dt = GetParam();
  Held x = random_held(dt, N * C, 1, 2.0f, 0.5f), w = random_held(dt, C, 2, 0.3f, 1.0f), b = random_held(dt, C, 3);
  Held dout = random_held(dt, N * C, 4);
  // LayerNorm: out, then dx, dw and db accumulated into (from values already there).
  Held out = zeros(dt, N * C), dx = zeros(dt, N * C), dw = random_held(dt, C, 5), db = random_held(dt, C, 6);
  std::vector<float> mean_half(N), rstd_half(N), mean(N), rstd(N);
  both([&](DataType as) -> Result<void> {
    const bool h = as != DataType::f32;
    COSHARD_TRY(k_.layernorm_forward(*stream_, as, x.at(as), w.at(as), b.at(as), out.at(as),
                                     h ? mean_half.data() : mean.data(), h ? rstd_half.data() : rstd.data(), N, C, 1e-5f));
    return k_.layernorm_backward(*stream_, as, dout.at(as), x.at(as), w.at(as), h ? mean_half.data() : mean.data(),
                                 h ? rstd_half.data() : rstd.data(), dx.at(as), dw.at(as), db.at(as), nullptr, N, C);
  });
  EXPECT_EQ(mean_half, mean);
  EXPECT_EQ(rstd_half, rstd);
  expect_rounded(out, "layernorm out");
  expect_rounded(dx, "layernorm dx");
  expect_rounded(dw, "layernorm dw");
  expect_rounded(db, "layernorm db");
  // RMSNorm.
  Held rout = zeros(dt, N * C), rdx = zeros(dt, N * C), rdw = random_held(dt, C, 7);
  both([&](DataType as) -> Result<void> {
    float* r = as == DataType::f32 ? rstd.data() : rstd_half.data();
    COSHARD_TRY(k_.rmsnorm_forward(*stream_, as, x.at(as), w.at(as), rout.at(as), r, N, C, 1e-6f));
    return k_.rmsnorm_backward(*stream_, as, dout.at(as), x.at(as), w.at(as), r, rdx.at(as), rdw.at(as), nullptr, N, C);
  });
  EXPECT_EQ(rstd_half, rstd);
  expect_rounded(rout, "rmsnorm out");
  expect_rounded(rdx, "rmsnorm dx");
  expect_rounded(rdw, "rmsnorm dw");
}

TEST_P(CpuHalfElements, ActivationsAndRotaryHaveTheF32KernelsBitsRoundedOnce) {
  const DataType dt = GetParam();
  Held x = random_held(dt, N * C, 11, 2.0f), dout = random_held(dt, N * C, 12);
  Held gout = zeros(dt, N * C), gdx = zeros(dt, N * C);
  both([&](DataType as) -> Result<void> {
    COSHARD_TRY(k_.gelu_forward(*stream_, as, x.at(as), gout.at(as), N * C));
    return k_.gelu_backward(*stream_, as, x.at(as), dout.at(as), gdx.at(as), N * C);
  });
  expect_rounded(gout, "gelu out");
  expect_rounded(gdx, "gelu dx");
  Held gate_up = random_held(dt, N * 2 * I, 13, 2.0f), sdout = random_held(dt, N * I, 14);
  Held sout = zeros(dt, N * I), sdx = zeros(dt, N * 2 * I);
  both([&](DataType as) -> Result<void> {
    COSHARD_TRY(k_.swiglu_forward(*stream_, as, gate_up.at(as), sout.at(as), N, I));
    return k_.swiglu_backward(*stream_, as, gate_up.at(as), sdout.at(as), sdx.at(as), N, I);
  });
  expect_rounded(sout, "swiglu out");
  expect_rounded(sdx, "swiglu dgate_up");
  // Rotary: 3 of 5 heads rotated (the others copied), from position 7, and its inverse.
  constexpr std::int64_t B = 3, T = 41, heads = 5, hd = 24;
  std::vector<float> inv_freq(hd / 2);
  for (std::size_t i = 0; i < inv_freq.size(); ++i) inv_freq[i] = std::pow(10000.0f, -2.0f * static_cast<float>(i) / hd);
  Held q = random_held(dt, B * T * heads * hd, 15), rot = zeros(dt, B * T * heads * hd), back = zeros(dt, B * T * heads * hd);
  both([&](DataType as) -> Result<void> {
    COSHARD_TRY(k_.rope(*stream_, as, q.at(as), rot.at(as), inv_freq.data(), B, T, heads, 3, hd, false, 7));
    return k_.rope(*stream_, as, q.at(as), back.at(as), inv_freq.data(), B, T, heads, 3, hd, true, 7);
  });
  expect_rounded(rot, "rope");
  expect_rounded(back, "rope inverse");
}

TEST_P(CpuHalfElements, SumsProductsBiasesAndEmbeddingsHaveTheF32KernelsBitsRoundedOnce) {
  const DataType dt = GetParam();
  Held a = random_held(dt, N * C, 21), b = random_held(dt, N * C, 22), bias = random_held(dt, C, 23);
  Held sum = zeros(dt, N * C), product = zeros(dt, N * C), scaled = random_held(dt, N * C, 24);
  Held biased = random_held(dt, N * C, 25), dbias = random_held(dt, C, 26);
  both([&](DataType as) -> Result<void> {
    COSHARD_TRY(k_.add(*stream_, as, a.at(as), b.at(as), sum.at(as), N * C));
    COSHARD_TRY(k_.mul(*stream_, as, a.at(as), b.at(as), product.at(as), N * C));
    COSHARD_TRY(k_.scale(*stream_, as, scaled.at(as), 0.37f, N * C));
    COSHARD_TRY(k_.bias_add(*stream_, as, biased.at(as), bias.at(as), N, C));
    return k_.bias_grad(*stream_, as, a.at(as), dbias.at(as), N, C);
  });
  expect_rounded(sum, "add");
  expect_rounded(product, "mul");
  expect_rounded(scaled, "scale");
  expect_rounded(biased, "bias_add");
  expect_rounded(dbias, "bias_grad");
  // Token and position embeddings, rows [first, first + rows) of a vocabulary-parallel table.
  constexpr std::int64_t B = 2, T = 17, vocab = 50, first = 10, rows = 25;
  std::vector<std::int32_t> tokens(B * T);
  for (std::size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<std::int32_t>((i * 7) % 23 + 5);  // repeats; some below `first`
  Held wte = random_held(dt, rows * C, 27), wpe = random_held(dt, T * C, 28), emb = zeros(dt, B * T * C);
  both([&](DataType as) -> Result<void> {
    return k_.embedding_forward(*stream_, as, tokens.data(), wte.at(as), wpe.at(as), emb.at(as), B, T, C, vocab, first,
                                rows);
  });
  expect_rounded(emb, "embedding");
  // Their gradients, accumulated into (a row its tokens' sum in token order, rounded once).
  Held g = random_held(dt, B * T * C, 29), dwte = random_held(dt, rows * C, 30), dwpe = random_held(dt, T * C, 31);
  both([&](DataType as) -> Result<void> {
    return k_.embedding_backward(*stream_, as, tokens.data(), g.at(as), dwte.at(as), dwpe.at(as), B, T, C, first, rows);
  });
  expect_rounded(dwte, "embedding's table gradient");
  expect_rounded(dwpe, "embedding's position gradient");
}

// The half types' cross-entropy (exponentials by a vectorised approximation, relative error ~2e-7):
// the loss within 1e-6 of f64's on the same logits, each gradient within its rounding.
TEST_P(CpuHalfElements, CrossEntropyIsWithinItsRoundingOfF64) {
  const DataType dt = GetParam();
  constexpr std::int64_t rows = 37, V = 1001;  // (a width off every vector's)
  Held logits = random_held(dt, rows * V, 41, 3.0f);
  std::vector<std::int32_t> targets(rows);
  for (std::size_t i = 0; i < targets.size(); ++i) targets[i] = static_cast<std::int32_t>((i * 131) % V);
  float loss = 0;
  const float seed = 1.5f;
  Held grad = zeros(dt, rows * V);
  ASSERT_TRUE(k_.cross_entropy_forward(*stream_, dt, logits.at(dt), targets.data(), &loss, nullptr, rows, V));
  ASSERT_TRUE(k_.cross_entropy_backward(*stream_, dt, logits.at(dt), targets.data(), &seed, grad.at(dt), rows, V));
  ASSERT_TRUE(stream_->synchronize());
  double want = 0;
  int wrong = 0;
  for (std::int64_t i = 0; i < rows; ++i) {
    const float* row = logits.wide.data() + i * V;
    const double mx = *std::max_element(row, row + V);
    double sum = 0;
    for (std::int64_t j = 0; j < V; ++j) sum += std::exp(static_cast<double>(row[j]) - mx);
    want += std::log(sum) + mx - row[targets[static_cast<std::size_t>(i)]];
    const double g = static_cast<double>(seed) / rows;
    for (std::int64_t j = 0; j < V; ++j) {
      const double ref = g * (std::exp(row[j] - mx) / sum - (j == targets[static_cast<std::size_t>(i)] ? 1.0 : 0.0));
      const double got = widened(dt, grad.half[static_cast<std::size_t>(i * V + j)]);
      if (std::abs(got - ref) > std::ldexp(std::abs(ref), dt == DataType::bf16 ? -8 : -11) + 1e-6 * g && ++wrong <= 3)
        ADD_FAILURE() << "gradient [" << i << ", " << j << "]: " << got << ", want " << ref;
    }
  }
  want /= rows;
  EXPECT_NEAR(loss, want, 1e-6 * want);
  EXPECT_EQ(wrong, 0);
}

INSTANTIATE_TEST_SUITE_P(HalfTypes, CpuHalfElements, ::testing::Values(DataType::bf16, DataType::f16),
                         [](const auto& info) { return std::string(async::to_string(info.param)); });

}  // namespace
}  // namespace coshard::modules::detail
