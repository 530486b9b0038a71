// libFuzzer target: a flight recorder dump as --flight-report reads it (outside input: a file a
// crash or a person may have cut or edited). Properties: no crash, leak, hang or undefined
// behaviour; a dump that parses names a rank inside its size and survives its own round trip.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "coshard/collectives/flight_recorder.hpp"

using namespace coshard::collectives;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto r = parse_flight_record(text, "fuzz");
  if (!r) return 0;
  if (r->rank < 0 || r->size < 1 || r->rank >= r->size) std::abort();
  auto again = parse_flight_record(flight_record_json(*r), "again");
  if (!again || again->rank != r->rank || again->size != r->size || again->reason != r->reason ||
      again->entries.size() != r->entries.size() || again->last_completed() != r->last_completed())
    std::abort();
  for (std::size_t i = 0; i < r->entries.size(); ++i)
    if (again->entries[i].seq != r->entries[i].seq || again->entries[i].ops != r->entries[i].ops ||
        again->entries[i].state != r->entries[i].state)
      std::abort();
  (void)diagnose(std::span<const FlightRecord>(&*r, 1), r->size);
  return 0;
}
