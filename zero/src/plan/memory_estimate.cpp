#include "coshard/zero/memory_estimate.hpp"

#include "gradient_reduction.hpp"
#include "parameter_residence.hpp"
#include "placement/optimizer_placement.hpp"

#include <algorithm>
#include <cstdio>
#include <system_error>

#include "coshard/async/memory.hpp"
#include "coshard/offload/pinned_pool.hpp"
#include "plan/fetch_units.hpp"
#include "plan/quantized_gathers.hpp"
#include "plan/secondary_partition.hpp"

namespace coshard::zero {

using namespace modules;

std::string_view to_string(MemoryPlace p) noexcept {
  switch (p) {
    case MemoryPlace::device: return "device";
    case MemoryPlace::pinned_host: return "pinned host";
    case MemoryPlace::pageable_host: return "pageable host";
    case MemoryPlace::nvme: return "nvme";
  }
  return "?";
}

std::string format_bytes(std::size_t bytes) {
  static constexpr const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  double v = static_cast<double>(bytes);
  std::size_t u = 0;
  while (v >= 1024.0 && u + 1 < std::size(units)) {
    v /= 1024.0;
    ++u;
  }
  char text[32];
  if (u == 0) std::snprintf(text, sizeof text, "%zu B", bytes);
  else std::snprintf(text, sizeof text, v < 10 ? "%.2f %s" : v < 100 ? "%.1f %s" : "%.0f %s", v, units[u]);
  return text;
}

void MemoryEstimate::add(MemoryPlace place, std::string what, std::size_t bytes) {
  if (bytes > 0) items.push_back({place, std::move(what), bytes});
}

std::size_t MemoryEstimate::bytes(MemoryPlace place) const noexcept {
  std::size_t sum = 0;
  for (const auto& i : items)
    if (i.place == place) sum += i.bytes;
  return sum;
}

namespace {

constexpr MemoryPlace kPlaces[] = {MemoryPlace::device, MemoryPlace::pinned_host, MemoryPlace::pageable_host,
                                   MemoryPlace::nvme};

std::string padded(std::string_view text, std::size_t width) {
  std::string out(text);
  if (out.size() < width) out.append(width - out.size(), ' ');
  return out;
}

}  // namespace

std::string MemoryEstimate::describe() const {
  std::string out;
  for (const MemoryPlace place : kPlaces) {
    const std::size_t total = bytes(place);
    if (total == 0) continue;
    out += "  " + padded(to_string(place), 15) + format_bytes(total) + "\n";
    for (const auto& i : items)
      if (i.place == place) out += "    " + padded(i.what, 50) + " " + format_bytes(i.bytes) + "\n";
  }
  for (const auto& note : notes) out += "  (" + note + ")\n";
  return out;
}

Result<std::vector<FetchUnitInfo>> plan_units(Module& model, int world_size, const EngineOptions& o,
                                              std::size_t optimizer_states) {
  if (world_size < 1) return fail(ErrorCode::invalid_argument, "plan_units: world_size=", world_size, ": expected >= 1");
  COSHARD_TRY_ASSIGN(const auto plan, detail::plan_fetch_units(model, world_size, o, optimizer_states));
  return detail::infos_of(plan.units);
}

Result<MemoryEstimate> estimate_engine_memory(Module& model, int world_size, const EngineOptions& o,
                                              std::size_t optimizer_states) {
  if (o.zero_stage < 0 || o.zero_stage > 3)
    return fail(ErrorCode::invalid_argument, "memory estimate: zero_stage=", o.zero_stage, ": expected 0, 1, 2 or 3");
  COSHARD_TRY_ASSIGN(const auto units, plan_units(model, world_size, o, optimizer_states));
  return detail::estimate_for_units(units, o, optimizer_states);
}

MemoryEstimate detail::estimate_for_units(std::span<const FetchUnitInfo> units, const EngineOptions& o,
                                          std::size_t optimizer_states) {
  const std::size_t e = size_of(o.dtype);
  // (trained_*: the units that train; a frozen unit has no gradient, master or state)
  std::size_t whole = 0, largest_unit = 0, largest_padded = 0;
  std::size_t trained_whole = 0, trained_f32 = 0, largest_trained = 0, frozen_f32 = 0;
  std::size_t shards_on_device = 0, units_on_device = 0, largest_trained_f32 = 0;
  // With the optimizer offloaded and a device budget: the units stepped on the device all the
  // same (their gradient shards resident, their state beside them), and the largest of the rest.
  const bool offloaded = o.offload_optimizer != OffloadTarget::none;
  std::size_t kept_f32 = 0, units_kept = 0, largest_offloaded_f32 = 0;
  std::size_t quantized_whole = 0, largest_quantized_trained = 0;  // (the units whose collectives carry int8)
  for (const auto& u : units) {
    if (int8_block_for(o, u) > 0) quantized_whole += u.padded_bytes;
    if (int8_gradient_block_for(o, u) > 0) largest_quantized_trained = std::max(largest_quantized_trained, u.padded_bytes);
    whole += u.padded_bytes;
    if (!u.shard_offloaded) {
      shards_on_device += static_cast<std::size_t>(u.shard) * e;
      ++units_on_device;
    }
    largest_unit = std::max(largest_unit, u.padded_bytes);
    largest_padded = std::max(largest_padded, static_cast<std::size_t>(u.padded));
    if (u.frozen) {
      frozen_f32 += static_cast<std::size_t>(u.shard) * sizeof(float);
      continue;
    }
    const auto f32_bytes = static_cast<std::size_t>(u.shard) * sizeof(float);
    trained_whole += u.padded_bytes;
    trained_f32 += f32_bytes;
    largest_trained_f32 = std::max(largest_trained_f32, f32_bytes);
    largest_trained = std::max(largest_trained, u.padded_bytes);
    if (offloaded && !u.optimizer_offloaded) {
      kept_f32 += f32_bytes;
      ++units_kept;
    } else {
      largest_offloaded_f32 = std::max(largest_offloaded_f32, f32_bytes);
    }
  }
  const std::string dtype(collectives::to_string(o.dtype));

  MemoryEstimate m;
  using P = MemoryPlace;
  // Parameters and gradients: the residence's and the reduction's own lines, as the engine they
  // would make holds them.
  make_parameter_residence(o.zero_stage)->estimate(m, {whole, shards_on_device}, o);
  if (quantized_whole > 0)
    m.add(P::device,
          std::string(o.quantize_weights != Quantization::none ? "int8 weight pieces" : "int8 frozen weight pieces"),
          int8_staging_bytes(o.quantize_weights_block, o.dtype, std::min(quantized_whole, o.max_live_bytes)));
  if (largest_quantized_trained > 0)  // (each reduction's pieces sent and received, two units' reductions in flight)
    m.add(P::device,
          std::string(to_string(o.quantize_gradients)) + " gradient pieces (two largest units)",
          int8_staging_bytes(o.quantize_gradients_block, o.dtype, 2 * 2 * largest_quantized_trained,
                             gradient_block_bits(o)));
  if (const std::size_t slices = secondary_partition_bytes(o, units); slices > 0)
    m.add(P::device,
          "secondary partition (1/" + std::to_string(o.secondary_partition_ranks) + " of its units)", slices);
  if (o.device_memory_budget > 0 && o.offload_params == OffloadTarget::cpu)
    m.notes.push_back("device_memory_budget " + format_bytes(o.device_memory_budget) + ": the parameter shards of " +
                      std::to_string(units_on_device) + " of " + std::to_string(units.size()) +
                      " units on the device, the rest in pinned host memory");
  if (o.device_memory_budget > 0 && o.offload_optimizer == OffloadTarget::cpu)
    m.notes.push_back("device_memory_budget " + format_bytes(o.device_memory_budget) + ": the optimizer state of " +
                      std::to_string(units_kept) + " of " + std::to_string(units.size()) +
                      " units on the device (stepped there), the rest stepped on the host");
  const bool in_flight = offloaded && o.expected_micro_batches == 1;
  GradientSizes gradients{.whole = trained_whole,
                          .largest_whole = largest_trained,
                          .shards_f32 = trained_f32,
                          .largest_shard_f32 = largest_trained_f32,
                          .shards_in_flight = in_flight};
  if (offloaded) {  // (the units stepped on the device keep theirs apart)
    gradients.shards_f32 = trained_f32 - kept_f32;
    gradients.largest_shard_f32 = largest_offloaded_f32;
    gradients.resident_shards_f32 = kept_f32;
  }
  make_gradient_reduction(o.zero_stage)->estimate(m, gradients, o.dtype);
  // The optimizer's: its masters and state, and the pinned pool of an offloaded one.
  if (auto placement = make_optimizer_placement(o.offload_optimizer))
    placement->estimate(m, {trained_f32, frozen_f32, kept_f32}, units, o, optimizer_states);
  // Frozen units are in the parameters' lines only: the estimate says so.
  if (frozen_f32 > 0)
    m.notes.push_back("frozen: " + format_bytes(frozen_f32 / sizeof(float) * e) + " of parameter shards (" + dtype +
                      ") without gradients, fp32 masters or optimizer state");
  // initialize(): a unit's values in double, then encoded (one unit at a time, whatever the
  // shards' place: nvme parameters are made unit by unit as their swap files are written).
  m.add(P::pageable_host, "initial values (at start)", largest_padded * sizeof(double) + largest_unit);
  return m;
}

std::string MachineMemory::describe() const {
  std::string out = "host " + format_bytes(host_bytes) + " available";
  out += device_bytes ? ", " + device + " " + format_bytes(*device_bytes) + " free"
                      : ", device " + device + " (its memory is the host's)";
  if (nvme_free_bytes) out += ", nvme " + format_bytes(*nvme_free_bytes) + " free at " + nvme_path.string();
  return out;
}

Result<MachineMemory> machine_memory(async::Device device, const std::filesystem::path& nvme_path) {
  MachineMemory m;
  m.host_bytes = async::available_host_memory_bytes();
  m.device = device.to_string();
  if (device.is_cuda()) {
    COSHARD_TRY_ASSIGN(auto free, async::cuda_free_memory_bytes(device));
    m.device_bytes = free;
  }
  if (!nvme_path.empty()) {
    // The folder may not exist yet: its nearest existing parent is where the files will go.
    std::filesystem::path at = std::filesystem::absolute(nvme_path);
    std::error_code ec;
    while (!std::filesystem::exists(at, ec) && at.has_parent_path() && at != at.parent_path()) at = at.parent_path();
    const auto space = std::filesystem::space(at, ec);
    if (ec) return fail(ErrorCode::io, "free space at ", nvme_path.string(), ": ", ec.message());
    m.nvme_free_bytes = static_cast<std::size_t>(space.available);
    m.nvme_path = nvme_path;
  }
  return m;
}

namespace {

// ", the largest line: what (bytes)" among `places`, for a refusal to point at.
std::string largest_line(const MemoryEstimate& m, std::initializer_list<MemoryPlace> places) {
  const MemoryItem* largest = nullptr;
  for (const auto& item : m.items)
    if (std::find(places.begin(), places.end(), item.place) != places.end() && (!largest || item.bytes > largest->bytes))
      largest = &item;
  if (!largest) return "";
  return "; the largest line: " + largest->what + " (" + std::string(to_string(largest->place)) + ", " +
         format_bytes(largest->bytes) + " a rank)";
}

}  // namespace

Result<void> check_fits(const MemoryEstimate& per_rank, int ranks, const MachineMemory& machine) {
  const auto n = static_cast<std::size_t>(std::max(ranks, 1));
  const std::string who = n == 1 ? "one rank" : std::to_string(n) + " ranks of this process";
  const std::size_t device = per_rank.bytes(MemoryPlace::device) * n;
  const std::size_t host = (per_rank.bytes(MemoryPlace::pinned_host) + per_rank.bytes(MemoryPlace::pageable_host)) * n;
  const std::size_t nvme = per_rank.bytes(MemoryPlace::nvme) * n;
  if (machine.device_bytes && device > *machine.device_bytes)
    return fail(ErrorCode::out_of_memory, "memory estimate: ", who, " need ", format_bytes(device), " (", device,
                " bytes) on ", machine.device, ", which has ", format_bytes(*machine.device_bytes), " (",
                *machine.device_bytes, " bytes) free", largest_line(per_rank, {MemoryPlace::device}));
  const std::size_t host_total = machine.device_bytes ? host : host + device;
  if (host_total > machine.host_bytes)
    return fail(ErrorCode::out_of_memory, "memory estimate: ", who, " need ", format_bytes(host_total), " (", host_total,
                " bytes) of host memory", machine.device_bytes ? "" : " (the device is the CPU: its memory counted too)",
                ", and this process may take ", format_bytes(machine.host_bytes), " (", machine.host_bytes, " bytes)",
                machine.device_bytes ? largest_line(per_rank, {MemoryPlace::pinned_host, MemoryPlace::pageable_host})
                                     : largest_line(per_rank, {MemoryPlace::device, MemoryPlace::pinned_host,
                                                               MemoryPlace::pageable_host}));
  if (nvme > 0 && machine.nvme_free_bytes && nvme > *machine.nvme_free_bytes)
    return fail(ErrorCode::out_of_memory, "memory estimate: ", who, " need ", format_bytes(nvme), " (", nvme,
                " bytes) of swap files under ", machine.nvme_path.string(), ", which has ",
                format_bytes(*machine.nvme_free_bytes), " (", *machine.nvme_free_bytes, " bytes) free");
  return {};
}

}  // namespace coshard::zero
