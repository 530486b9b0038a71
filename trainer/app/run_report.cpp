#include "run_report.hpp"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>
#include <thread>

#include "coshard/collectives/nccl.hpp"
#include "coshard/modules/cpu_blas_kernels.hpp"
#include "coshard/modules/cpu_half_products.hpp"
#include "coshard/modules/cpu_threads.hpp"
#include "coshard/modules/layers.hpp"
#include "coshard/zero/memory_estimate.hpp"
#include "run_ranks.hpp"

namespace coshard::train_app {

namespace {

// How oneDNN's OpenMP threads wait between products (coshard-train restarts itself with PASSIVE
// where it is unset: modules::restart_with_passive_openmp).
std::string omp_wait(int threads) {
  if (threads <= 1) return {};
  const char* policy = std::getenv("OMP_WAIT_POLICY");
  if (policy == nullptr || *policy == '\0') return " (OpenMP's idle threads spin a while: OMP_WAIT_POLICY unset)";
  std::string p(policy);
  for (char& ch : p) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  if (p == "PASSIVE") return " (OpenMP's idle threads wait passively)";
  if (p == "ACTIVE")
    return " (OMP_WAIT_POLICY=ACTIVE: OpenMP's idle threads spin, taking cores from the element-wise kernels; "
           "PASSIVE or unset is faster)";
  return {};
}

// A CPU rank's math threads, and a warning where the threads asked for oversubscribe the cores.
std::string math_threads(const Options& o) {
  const int threads = modules::cpu_math_threads();
  const int ranks = ranks_on_this_machine(o);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  std::string line = std::to_string(threads) + " a rank (products, element-wise kernels, optimizer), " +
                     std::to_string(ranks) + " rank(s) on this machine's " + std::to_string(cores) + " cores";
  if (o.blas_threads > 0 && static_cast<long long>(threads) * ranks > cores)
    line += ": --blas-threads " + std::to_string(o.blas_threads) + " puts " +
            std::to_string(static_cast<long long>(threads) * ranks) + " threads on " + std::to_string(cores) +
            " cores, which slows every step (--blas-threads 0 gives each rank the cores over the ranks)";
  return line;
}

// ZeRO++'s lines: the quantized gathers and reduction, the secondary partition (which units, what
// a collective carries, what the slices hold).
std::string load_balancing(double coef) {
  char text[96];
  std::snprintf(text, sizeof text, "load-balancing loss x %g (each rank's micro-batch its own)", coef);
  return text;
}

// A mixture of experts: its shape, what a token runs through, and the load-balancing loss.
void print_experts(const Options& o, int world) {
  const auto& l = o.model.llama;
  if (o.model.kind != ModelChoice::Kind::llama || !l.moe.enabled()) return;
  const double coef = l.moe.aux_loss_coef;
  auto count = [](std::int64_t n) {
    char text[32];
    if (n < 1'000'000) std::snprintf(text, sizeof text, "%lld", static_cast<long long>(n));
    else std::snprintf(text, sizeof text, "%.1fM", static_cast<double>(n) / 1e6);
    return std::string(text);
  };
  std::printf("  mixture of experts: %lld expert%s of %lld in %lld of %lld layer%s, top %lld%s; %s of %s parameters "
              "active a token; %s; %s\n",
              static_cast<long long>(l.moe.experts), l.moe.experts == 1 ? "" : "s", static_cast<long long>(l.expert_width()),
              static_cast<long long>(l.moe_layers()), static_cast<long long>(l.layers), l.layers == 1 ? "" : "s",
              static_cast<long long>(l.moe.top_k), l.moe.renormalize ? " renormalised" : "",
              count(l.active_parameter_count()).c_str(), count(l.parameter_count()).c_str(),
              coef > 0 ? load_balancing(coef).c_str()
                       : "no load-balancing loss (--router-aux-loss-coef to add it)",
              l.moe.every_expert_runs ? "every expert gathered and reduced every pass (--expert-fetch all)"
                                      : "experts gathered and reduced where some rank routed a token");
  if (const int p = o.train.expert_parallel_size; p > 1) {
    const int holders = world / std::max(1, o.train.tensor_parallel_size) / p;
    const std::string held = holders == 1                ? std::string("held whole by one rank each")
                             : o.train.zero_stage == 3 ? "sharded over the " + std::to_string(holders) + " ranks holding them"
                                                       : "ZeRO-" + std::to_string(o.train.zero_stage) + " among the " +
                                                             std::to_string(holders) + " ranks holding them";
    std::printf("  expert parallel: each layer's experts over %d ranks (%lld each, %s), routed tokens by all-to-all\n", p,
                static_cast<long long>(l.moe.experts / p), held.c_str());
  }
}

void print_less_on_the_wire(const Options& o, trainer::Trainer& t, int data_ranks, int tensor) {
  const auto units_info = t.engine().units();
  // Quantized weight gathers: which units, and what a gather carries.
  const auto& quantize = o.train;
  if (quantize.zero_stage == 3 && (quantize.quantize_weights != zero::Quantization::none ||
                                   quantize.quantize_frozen_weights != zero::Quantization::none)) {
    const auto units = static_cast<std::size_t>(std::count_if(units_info.begin(), units_info.end(),
                                                              [](const auto& u) { return u.gather_int8_block > 0; }));
    const double bytes = 1.0 + 4.0 / static_cast<double>(quantize.quantize_weights_block);
    std::printf("  quantized weight gathers: int8 blocks of %lld with an f32 scale (%.3f bytes a weight against %zu in "
                "%s), %zu of %zu units (%s); masters, optimizer, checkpoints and exports exact\n",
                static_cast<long long>(quantize.quantize_weights_block), bytes,
                modules::size_of(quantize.engine_options().dtype),
                std::string(collectives::to_string(quantize.engine_options().dtype)).c_str(), units,
                t.engine().units().size(),
                quantize.quantize_weights != zero::Quantization::none ? "those sharded over more than one rank"
                                                                      : "the frozen ones sharded over more than one rank");
  }
  const bool gradients_quantized = quantize.zero_stage == 2 || quantize.zero_stage == 3;
  const auto reduced_quantized = std::count_if(units_info.begin(), units_info.end(),
                                               [](const auto& u) { return u.reduce_quant_block > 0; });
  if (gradients_quantized && quantize.quantize_gradients != zero::Quantization::none && reduced_quantized == 0) {
    std::printf("  quantized gradient reduction: none (%s: nothing crosses a wire)\n",
                data_ranks == 1 ? "one data rank" : "every trained unit sharded over one rank");
  } else if (gradients_quantized && quantize.quantize_gradients != zero::Quantization::none) {
    const double value_bytes = quantize.quantize_gradients == zero::Quantization::int4 ? 0.5 : 1.0;
    std::printf("  quantized gradient reduction: %s blocks of %lld with an f32 scale, each rank's block summed in f32 "
                "from an all-to-all (%.4g bytes a gradient value against %zu)%s\n",
                std::string(zero::to_string(quantize.quantize_gradients)).c_str(),
                static_cast<long long>(quantize.quantize_gradients_block),
                value_bytes + 4.0 / static_cast<double>(quantize.quantize_gradients_block),
                modules::size_of(quantize.engine_options().dtype),
                data_ranks > 1 && o.train.shard_group_size > 0 ? "; across the copies exact" : "");
  }
  // The secondary partition: its groups, its units, the device memory of its slices.
  if (const int n = t.engine().options().secondary_partition_ranks;
      quantize.zero_stage == 3 && (n > 1 || quantize.secondary_partition_local)) {
    std::size_t units = 0, slice_bytes = 0;
    for (const auto& u : units_info)
      if (u.secondary_ranks > 0) {
        ++units;
        slice_bytes += u.padded_bytes / static_cast<std::size_t>(u.secondary_ranks);
      }
    if (units == 0)
      std::printf("  secondary partition: groups of %d%s: none (no unit is gathered again within a step over more "
                  "ranks: each is sharded over %d or fewer, persistent, or frozen and kept gathered)\n",
                  n, quantize.secondary_partition_local ? " (local: the ranks of a node)" : "", n);
    else
      std::printf("  secondary partition: groups of %d consecutive %srank(s)%s: %zu of %zu units gather a step's later "
                  "uses within them, from slices of %s a rank (1/%d of them)\n",
                  n, tensor > 1 ? "data " : "", quantize.secondary_partition_local ? " (local: the ranks of a node)" : "",
                  units, units_info.size(), zero::format_bytes(slice_bytes).c_str(), n);
  }
}

}  // namespace

void print_run_header(const Options& o, trainer::Trainer& t, const collectives::Communicator& comm,
                      const trainer::TokenSource& data, const trainer::TokenSource* val, std::int64_t first) {
  const int world = comm.size();
  std::printf("coshard-train: %lld-parameter %s, %s\n", static_cast<long long>(o.model.parameter_count()),
              o.model.describe().c_str(), data.describe().c_str());
  if (val)
    std::printf("  validation: %s, %lld batches%s\n", val->describe().c_str(), static_cast<long long>(o.train.eval_batches),
                o.train.eval_every > 0 ? (", every " + std::to_string(o.train.eval_every) + " steps and after the last").c_str()
                                       : ", after the last step");
  if (o.device == "cuda") {
    const bool fused = modules::attention_is_fused(async::Device::cuda(0), o.train.engine_options().dtype,
                                                   o.model.head_dim(), o.train.attention);
    std::string cudnn;
    if (o.train.attention == modules::AttentionKernels::cudnn) {
      auto lib = modules::cudnn_attention_library();
      cudnn = lib ? "cuDNN's fused attention from " + *lib + " where it takes the shape, else "
                  : "cuDNN's fused attention unavailable (" + lib.error().message() + "): ";
    }
    std::printf("  attention: %s%s%s\n", cudnn.c_str(),
                fused ? "fused kernels (one statistic a query row kept)" : "materialized (the T x T probabilities kept)",
                o.attention_chosen ? ": heads of 128 run faster so today, and the run fits with them "
                                     "(--attention fused keeps them off the device)"
                                   : "");
  }
  if (t.cross_entropy_chunked())
    std::printf("  cross-entropy: fused with the output layer, in chunks of at most %lld MiB of logits\n",
                static_cast<long long>(o.train.cross_entropy_chunk_mib));
  if (o.train.activation_checkpointing.enabled())
    std::printf("  activation checkpointing: %s\n", o.train.activation_checkpointing.to_string().c_str());
  if (o.device == "cpu") {
    std::string products = modules::cpu_blas_kernels().describe();
    const modules::DataType dt = o.train.engine_options().dtype;
    if (const auto half = modules::cpu_half_products(); half && (dt == modules::DataType::bf16 || dt == modules::DataType::f16))
      products = half->describe(dt) + (half->native(dt) ? omp_wait(modules::cpu_math_threads()) + "; f32 on " + products
                                                         : "; " + products);
    std::printf("  matrix products: %s\n", products.c_str());
    std::printf("  math threads: %s\n", math_threads(o).c_str());
  }
  std::string ranks = o.launch.launcher == collectives::Launcher::none
                          ? "threads of this process"
                          : "processes started by " + std::string(collectives::to_string(o.launch.launcher));
  if (comm.backend() == "nccl") {  // the library it opened at run time (the communicator holds it open)
    auto nccl = collectives::nccl_library();
    ranks += "; " + (nccl ? *nccl : nccl.error().message());
  }
  std::printf("  ZeRO-%d, %s, %d rank(s) on %s, %s backend (%s), global batch %lld x %lld tokens, %zu fetch units%s\n",
              o.train.zero_stage, std::string(collectives::to_string(o.train.engine_options().dtype)).c_str(), world,
              o.device.c_str(), std::string(comm.backend()).c_str(), ranks.c_str(),
              static_cast<long long>(o.batch),
              static_cast<long long>(o.seq), t.engine().units().size(),
              first > 0 ? (", resumed at step " + std::to_string(first)).c_str() : "");
  if (o.train.lora_rank > 0) {  // (what trains: a LoRA run looks like its base otherwise)
    std::size_t adapters = 0;
    std::int64_t trained = 0;
    for (const auto& u : t.engine().units()) {
      for (const auto& name : u.parameters) adapters += name.find(".lora") != std::string::npos && name.ends_with(".A") ? 1 : 0;
      if (!u.frozen) trained += u.numel;
    }
    std::string targets;
    for (const auto& target : o.train.lora_targets) targets += (targets.empty() ? "" : ", ") + target;
    std::printf("  LoRA: rank %lld, alpha %g, dropout %g, %zu adapters (%s), %lld trained parameters%s%s%s\n",
                static_cast<long long>(o.train.lora_rank), static_cast<double>(o.train.lora_alpha),
                static_cast<double>(o.train.lora_dropout), adapters, targets.empty() ? "the model's defaults" : targets.c_str(),
                static_cast<long long>(trained), o.train.tensor_parallel_size > 1 ? " (this tensor rank's part)" : "",
                o.adapter.empty() ? "" : ", from ", o.adapter.c_str());
  }
  print_experts(o, world);
  const int tensor = o.train.tensor_parallel_size, data_ranks = world / tensor;
  if (tensor > 1)
    std::printf("  tensor parallelism: data %d x tensor %d (heads, MLP and vocabulary split over %d consecutive ranks; "
                "ZeRO over each data group of %d)\n", data_ranks, tensor, tensor, data_ranks);
  print_less_on_the_wire(o, t, data_ranks, tensor);
  const auto units_info = t.engine().units();
  // Hybrid sharding: the groups the units are sharded over (each a copy of every block).
  std::set<int> groups;
  for (const auto& u : units_info)
    if (o.train.zero_stage > 0 && u.shard_ranks < data_ranks / u.expert_parallel) groups.insert(u.shard_ranks);
  for (const int g : groups)
    std::printf("  hybrid sharding: units sharded over groups of %d consecutive %srank(s), %d copies (across them: one "
                "all-reduce of each gradient shard)\n", g, tensor > 1 ? "data " : "", data_ranks / g);
  std::fflush(stdout);
}

}  // namespace coshard::train_app
