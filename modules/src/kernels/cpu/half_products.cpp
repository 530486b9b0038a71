// The CPU's native bf16/f16 matrix products through oneDNN's matmul primitive (the same library,
// and the same 2.6 line, as PyTorch's CPU autocast). A product is a 3-d matmul: [batch, m, k] x
// [batch, k, n] -> [batch, m, n], transposes and leading dimensions given as strides, alpha as
// the output scale and beta as a sum post-op (C read and rounded once, in its own dtype). The
// primitives are kept per thread by shape (each rank's stream worker multiplies on its own
// thread; creating one takes far longer than a small product).
#include <cstdlib>
#include <new>
#include <string>
#include <string_view>
#include <unordered_map>

#include <dnnl.hpp>


#include "coshard/modules/cpu_blas_kernels.hpp"
#include "coshard/modules/cpu_half_products.hpp"
#include "coshard/modules/cpu_threads.hpp"
#include "kernels/cpu/half_products.hpp"
#include "kernels/cpu/restart_self.hpp"
#include "kernels/cpu/thread_sanitizer.hpp"

extern "C" void omp_set_num_threads(int threads);  // libgomp's: the runtime Debian's oneDNN runs on

namespace coshard::modules {

namespace {

using detail::kThreadSanitizer;

using dnnl::memory;

struct IsaName {
  std::string_view name;
  dnnl::cpu_isa isa;
};
constexpr IsaName kIsas[] = {
    {"all", dnnl::cpu_isa::all},
    {"avx2", dnnl::cpu_isa::avx2},
    {"avx512_core", dnnl::cpu_isa::avx512_core},
    {"avx512_core_bf16", dnnl::cpu_isa::avx512_core_bf16},
    {"avx512_core_amx", dnnl::cpu_isa::avx512_core_amx},
};

bool has(dnnl::cpu_isa effective, dnnl::cpu_isa wanted) {
  const auto e = static_cast<unsigned>(effective), w = static_cast<unsigned>(wanted);
  return (e & w) == w;
}

std::string isa_name(dnnl::cpu_isa effective) {
  // The largest named set the effective ISA holds (the names are nested sets of bits).
  std::string_view best = "sse41";
  for (const IsaName& n : kIsas)
    if (n.isa != dnnl::cpu_isa::all && has(effective, n.isa)) best = n.name;
  if (has(effective, dnnl::cpu_isa::avx512_core_vnni) && best == "avx512_core") best = "avx512_core_vnni";
  return std::string(best);
}

memory::data_type onednn_type(DataType dt) {
  return dt == DataType::bf16 ? memory::data_type::bf16 : dt == DataType::f16 ? memory::data_type::f16 : memory::data_type::f32;
}

// The descriptors of one product: [batch, rows, cols] of a row-major matrix at leading dimension
// `ld` (transposed: stored cols x rows), matrices `stride` apart (0 with a batch: the same one,
// which oneDNN takes as a broadcast batch of 1).
memory::desc matrix(memory::data_type t, std::int64_t batch, std::int64_t stride, std::int64_t rows, std::int64_t cols,
                    std::int64_t ld, bool transposed) {
  const std::int64_t b = stride == 0 ? 1 : batch;
  const std::int64_t step = stride == 0 ? (transposed ? cols : rows) * ld : stride;
  return memory::desc({b, rows, cols}, t, transposed ? memory::dims{step, 1, ld} : memory::dims{step, ld, 1});
}

dnnl::matmul::primitive_desc describe_product(const dnnl::engine& engine, DataType dt, const detail::GemmArgs& g) {
  const memory::data_type t = onednn_type(dt), tc = g.c_in_stat_dtype ? memory::data_type::f32 : t;
  const auto a = matrix(t, g.batch, g.stride_a, g.m, g.k, g.lda, g.trans_a);
  const auto b = matrix(t, g.batch, g.stride_b, g.k, g.n, g.ldb, g.trans_b);
  const auto c = memory::desc({g.batch, g.m, g.n}, tc, memory::dims{g.stride_c == 0 ? g.m * g.ldc : g.stride_c, g.ldc, 1});
  dnnl::primitive_attr attr;
  if (g.alpha != 1.0f) attr.set_output_scales(0, {g.alpha});
  if (g.beta != 0.0f) {
    dnnl::post_ops ops;
    ops.append_sum(g.beta);
    attr.set_post_ops(ops);
  }
  return dnnl::matmul::primitive_desc(dnnl::matmul::desc(a, b, c), attr, engine);
}

// Whether oneDNN multiplies `dt` with its own kernels for these instructions (not its reference
// loops, which it also has for every type).
bool native(const dnnl::engine& engine, DataType dt) {
  try {
    const detail::GemmArgs probe{.m = 64, .n = 64, .k = 64, .lda = 64, .ldb = 64, .ldc = 64};
    const auto pd = describe_product(engine, dt, probe);
    return !std::string_view(pd.impl_info_str()).starts_with("ref");
  } catch (const dnnl::error&) {
    return false;
  }
}

Result<CpuHalfProducts> probe() noexcept {
  try {
    CpuHalfProducts p;
    p.built = true;
    bool asked = false;  // COSHARD_CPU_ISA names bf16's instructions: native products wanted
    if (const char* cap = std::getenv("COSHARD_CPU_ISA"); cap != nullptr && *cap != '\0') {
      const std::string_view want(cap);
      const IsaName* found = nullptr;
      for (const IsaName& n : kIsas)
        if (n.name == want) found = &n;
      if (found == nullptr)
        return fail(ErrorCode::invalid_argument, "COSHARD_CPU_ISA=", want.substr(0, 64),
                    ": expected one of all, avx2, avx512_core, avx512_core_bf16, avx512_core_amx");
      asked = found->isa != dnnl::cpu_isa::all && has(found->isa, dnnl::cpu_isa::avx512_core_bf16);
      p.cap = std::string(want);
      if (dnnl::set_max_cpu_isa(found->isa) != dnnl::status::success)
        return fail(ErrorCode::internal, "COSHARD_CPU_ISA=", want, ": oneDNN had chosen its instructions already");
    }
    const dnnl::engine engine(dnnl::engine::kind::cpu, 0);
    const dnnl::cpu_isa effective = dnnl::get_effective_cpu_isa();
    p.isa = isa_name(effective);
    p.amd = cpu_vector_support().amd;
    // By default native with AMX, and with AVX512-BF16 on AMD's CPUs (Zen 4 and later): there
    // oneDNN 2.6's bf16 products ran at four times OpenBLAS's f32 (a 2-vCPU EPYC, Zen 5: 820-945
    // GFLOP/s against 231-245; the Llama's bf16 step 2446 ms against f32's 2900-3040 and
    // 4520 on copies). On Intel's with AVX512-BF16 but no AMX they ran slower than OpenBLAS's f32
    // on the copies (a 2-vCPU Xeon, model 207: 145-150 against 227-235; a dim-512 Llama's bf16 step
    // 2623 ms against 2298): copies there, unless COSHARD_CPU_ISA=avx512_core_bf16 asks. A rule by
    // CPU rather than a timing at start, so that a machine's runs always take the same path (bits).
    // Under ThreadSanitizer only where asked: oneDNN is not instrumented, and its primitive cache's
    // own synchronisation, unseen, reads as races between ranks (the CI's TSan build on an EPYC).
    p.amx = has(effective, dnnl::cpu_isa::avx512_core_amx);
    const bool full_rate = asked || (!kThreadSanitizer && (p.amx || p.amd));
    p.bf16 = has(effective, dnnl::cpu_isa::avx512_core_bf16) && full_rate && native(engine, DataType::bf16);
    p.f16 = (asked || (!kThreadSanitizer && p.amx)) && native(engine, DataType::f16);
    return p;
  } catch (const std::bad_alloc&) {
    return fail(ErrorCode::out_of_memory, "oneDNN: no memory to choose the CPU's matrix products");
  } catch (const dnnl::error& e) {
    return fail(ErrorCode::device, "oneDNN: ", std::string_view(e.what()).substr(0, 256));
  }
}

}  // namespace

std::string CpuHalfProducts::describe(DataType dt) const {
  const std::string name(to_string(dt));
  // (where COSHARD_CPU_ISA capped the instructions, the header says so rather than "here")
  const std::string runs = "oneDNN runs " + isa + (cap.empty() ? " here" : " under COSHARD_CPU_ISA=" + cap);
  if (native(dt)) return "oneDNN " + isa + " " + name + " with f32 accumulation";
  if (dt != DataType::bf16 && dt != DataType::f16) return {};
  if (!built) return name + " on f32 copies through OpenBLAS (this build has no oneDNN)";
  // (f16 is native with AMX or where asked, and only where oneDNN has its own kernels for it: not
  // on AVX512-BF16 alone, whatever COSHARD_CPU_ISA says)
  if (dt == DataType::f16 && !amx)
    return name + " on f32 copies through OpenBLAS (" + runs + ", without native f16 products)";
  if (kThreadSanitizer && (amx || isa.starts_with("avx512_core_bf16")))
    return name + " on f32 copies through OpenBLAS (under ThreadSanitizer, which cannot see into oneDNN; "
                  "COSHARD_CPU_ISA=avx512_core_bf16 takes its products)";
  if (isa.starts_with("avx512_core_bf16"))
    return name + " on f32 copies through OpenBLAS (oneDNN's " + isa + " " + name +
           " products measured slower than f32 on Intel CPUs without AMX; COSHARD_CPU_ISA=avx512_core_bf16 takes "
           "them)";
  return name + " on f32 copies through OpenBLAS (" + runs + ", without native " + name + " products)";
}

Result<CpuHalfProducts> cpu_half_products() noexcept {
  static const Result<CpuHalfProducts> once = probe();
  return once;
}

void restart_with_passive_openmp(char** argv) noexcept {
  if (std::getenv("OMP_WAIT_POLICY") != nullptr) return;
  detail::restart_self_with(argv, {{"OMP_WAIT_POLICY", "PASSIVE"}});  // (failing: OpenMP's default)
}

namespace detail {

namespace {

struct ProductKey {
  DataType dt;
  bool trans_a, trans_b, c_in_stat_dtype;
  std::int64_t m, n, k, lda, ldb, ldc, batch, stride_a, stride_b, stride_c;
  float alpha, beta;
  bool operator==(const ProductKey&) const = default;
};
struct ProductKeyHash {
  std::size_t operator()(const ProductKey& key) const noexcept {
    std::size_t h = static_cast<std::size_t>(key.dt) | (std::size_t{key.trans_a} << 8) | (std::size_t{key.trans_b} << 9) |
                    (std::size_t{key.c_in_stat_dtype} << 10);
    for (const std::int64_t v : {key.m, key.n, key.k, key.lda, key.ldb, key.ldc, key.batch, key.stride_a, key.stride_b,
                                 key.stride_c})
      h = h * 1000003u ^ static_cast<std::size_t>(v);
    return h * 1000003u ^ std::hash<float>{}(key.alpha) ^ (std::hash<float>{}(key.beta) << 1);
  }
};

// Each thread's engine, stream and primitives (a training step has a few dozen shapes; the
// bound only keeps a run of ever-changing shapes, like sampling's growing sequence, from piling up).
struct Product {
  dnnl::matmul::primitive_desc pd;
  dnnl::matmul primitive;
};
struct ThreadProducts {
  dnnl::engine engine{dnnl::engine::kind::cpu, 0};
  dnnl::stream stream{engine};
  std::unordered_map<ProductKey, Product, ProductKeyHash> primitives;
  int threads = 0;
};
constexpr std::size_t kMaxPrimitives = 512;

}  // namespace

bool native_half_products(DataType dt) noexcept {
  const auto p = cpu_half_products();
  return p && p->native(dt);
}

Result<void> half_gemm(DataType dt, const GemmArgs& g) noexcept {
  if (g.batch <= 0 || g.m <= 0 || g.n <= 0) return {};
  try {
    thread_local ThreadProducts mine;
    const int threads = kThreadSanitizer ? 1 : cpu_math_threads();
    if (threads != mine.threads) {
      omp_set_num_threads(threads);  // (this thread's teams only: each rank's worker sets its own)
      mine.threads = threads;
    }
    const ProductKey key{dt, g.trans_a, g.trans_b, g.c_in_stat_dtype, g.m, g.n, g.k, g.lda, g.ldb, g.ldc, g.batch,
                         g.stride_a, g.stride_b, g.stride_c, g.alpha, g.beta};
    auto it = mine.primitives.find(key);
    if (it == mine.primitives.end()) {
      if (mine.primitives.size() >= kMaxPrimitives) mine.primitives.clear();
      auto pd = describe_product(mine.engine, dt, g);
      dnnl::matmul primitive(pd);
      it = mine.primitives.emplace(key, Product{std::move(pd), std::move(primitive)}).first;
    }
    const dnnl::matmul::primitive_desc& pd = it->second.pd;
    memory a(pd.src_desc(), mine.engine, const_cast<void*>(g.a));
    memory b(pd.weights_desc(), mine.engine, const_cast<void*>(g.b));
    memory c(pd.dst_desc(), mine.engine, g.c);
    it->second.primitive.execute(mine.stream, {{DNNL_ARG_SRC, a}, {DNNL_ARG_WEIGHTS, b}, {DNNL_ARG_DST, c}});
    mine.stream.wait();
    return {};
  } catch (const std::bad_alloc&) {
    return fail(ErrorCode::out_of_memory, "oneDNN matmul ", g.m, "x", g.n, "x", g.k, " (batch ", g.batch, "): out of memory");
  } catch (const dnnl::error& e) {
    return fail(ErrorCode::device, "oneDNN matmul ", g.m, "x", g.n, "x", g.k, " (batch ", g.batch,
                "): ", std::string_view(e.what()).substr(0, 256));
  }
}

}  // namespace detail
}  // namespace coshard::modules
