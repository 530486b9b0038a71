// Builds against the installed coshard package and runs one awaited stream round trip.
#include <coshard/coshard.hpp>

#include <cstdio>

int main() {
  using namespace coshard::async;
  Runtime rt;
  auto stream = Stream::create(Device::cpu());
  if (!stream) {
    std::fprintf(stderr, "%s\n", stream.error().message().c_str());
    return 1;
  }
  int value = 0;
  auto r = rt.block_on([](Stream& s, int& value) -> Task<coshard::Result<int>> {
    COSHARD_CO_TRY(s.launch([&value] { value = 42; }));
    COSHARD_CO_TRY_ASSIGN(Event done, s.record());
    COSHARD_CO_TRY(co_await done);
    co_return value;
  }(*stream, value));
  if (!r || *r != 42) {
    std::fprintf(stderr, "consumer: unexpected result\n");
    return 1;
  }
  std::puts("consumer: ok");
  return 0;
}
