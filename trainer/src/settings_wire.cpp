// The settings of ZeRO++'s three ways to put fewer bytes on the wire (#63): quantized weight gathers,
// a quantized gradient reduction, a secondary weight partition; in --help's order, where
// add_parallelism_settings (settings_table.cpp) puts them.
#include <cstdint>
#include <string_view>
#include <vector>

#include "coshard/trainer/config.hpp"
#include "coshard/trainer/settings.hpp"
#include "setting_kinds.hpp"

namespace coshard::trainer::detail {

namespace {

constexpr std::string_view kWeightQuantization[] = {"none", "int8"};            // (zero::Quantization's first two)
constexpr std::string_view kGradientQuantization[] = {"none", "int8", "int4"};  // (zero::Quantization's order)

using T = TrainerConfig;

Setting secondary_partition_setting() {
  return ranks_or_local_setting<&T::secondary_partition_ranks, &T::secondary_partition_local, 1>(
      {.name = "secondary_partition_ranks", .flag = "--secondary-partition",
       .deepspeed = "zero_optimization.zero_hpz_partition_size",
       .help = "stage 3: keep each rank's 1/N slice of a unit's first gather of a step, and gather the step's later "
               "uses (backward, checkpointing's replay, the next micro-batch) within groups of N consecutive ranks "
               "(ZeRO++'s hpZ: across nodes only once a step; the same values, bit for bit; 1/N of the gathered "
               "model more on the device); local: the ranks of one node; 1: none",
       .expected = "a whole number that divides the world size (the ranks of a node), 1 (none) or local"},
      1);
}

}  // namespace

void add_less_on_the_wire_settings(std::vector<Setting>& t) {
  t.push_back(choice<&T::quantize_weights>(
      {.name = "quantize_weights", .flag = "--quantize-weights",
       .help = "stage 3: gather the weights as int8 blocks (ZeRO++'s quantized weights: each rank quantizes its shard, "
               "every rank dequantizes every piece into the compute dtype; a quarter of f32's bytes on the wire, half "
               "of bf16's). The masters, the optimizer, checkpoints and exports stay exact",
       .expected = "none or int8"},
      kWeightQuantization));
  t.push_back(choice<&T::quantize_frozen_weights>(
      {.name = "quantize_frozen_weights", .flag = "--quantize-frozen-weights",
       .help = "stage 3: the same for frozen units alone (a fine-tuned base, LoRA's); the units that train gather "
               "exactly",
       .expected = "none or int8"},
      kWeightQuantization));
  t.push_back(integer<&T::quantize_weights_block>(
      {.name = "quantize_weights_block", .flag = "--quantize-weights-block",
       .help = "the elements one f32 scale covers in a quantized gather (8 or more; smaller: closer weights, more "
               "scales)",
       .expected = "a whole number from 8 to 2^30"},
      8, std::int64_t{1} << 30));
  t.push_back(choice<&T::quantize_gradients>(
      {.name = "quantize_gradients", .flag = "--quantize-gradients",
       .help = "stages 2-3: reduce each unit's gradient as int8 or int4 blocks (ZeRO++'s quantized gradients: each rank "
               "quantizes every rank's block of its gradient, an all-to-all sends each its own, which it sums in f32; "
               "a quarter of f32's bytes with int8, an eighth with int4, DeepSpeed's format). The norm, clipping and "
               "the optimizer see what the reduction gave",
       .expected = "none, int8 or int4"},
      kGradientQuantization));
  t.push_back(integer<&T::quantize_gradients_block>(
      {.name = "quantize_gradients_block", .flag = "--quantize-gradients-block",
       .help = "the elements one f32 scale covers in a quantized gradient reduction (8 or more; even for int4)",
       .expected = "a whole number from 8 to 2^30"},
      8, std::int64_t{1} << 30));
  t.push_back(secondary_partition_setting());
}

}  // namespace coshard::trainer::detail
