#!/usr/bin/env bash
# Packs a CUDA-enabled build for a lent GPU machine (a developer tool; CI never runs it):
# the test build's binaries and CTest files, the release build's benchmarks and trainer, and the
# shared libraries they need that a CUDA image may lack (OpenBLAS, liburing, ...), into
# .device/bundle.tar.gz (ignored by git; carried by the device tool). scripts/device_check.sh
# unpacks and runs it there.
#   scripts/device_bundle.sh [TEST_BUILD=build/test] [RELEASE_BUILD=build/release]
set -euo pipefail
cd "$(dirname "$0")/.."
test_build=${1:-build/test}
release_build=${2:-build/release}
cmake --build "$test_build" -j2
cmake --build "$release_build" -j2

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
# Binaries keep their paths (tests name helper programs by absolute path); debug info stripped.
while IFS= read -r f; do
  mkdir -p "$stage/$(dirname "$f")"
  if file -b "$f" | grep -q ELF; then strip --strip-debug -o "$stage/$f" "$f"; else cp "$f" "$stage/$f"; fi
done < <(find "$test_build" "$release_build" -type f \( -perm -u+x -o -name '*.cmake' -o -name 'CTestTestfile.cmake' \) \
           -not -path '*/CMakeFiles/*' -not -name '*.so*' -not -name '*.a' | grep -v '_deps' )
# Libraries outside glibc and the CUDA toolkit (which the image has).
mkdir -p "$stage/.device/lib"
for bin in $(find "$stage" -type f -perm -u+x); do
  file -b "$bin" | grep -q ELF || continue
  ldd "$bin" 2>/dev/null | awk '/=> \//{print $3}'
done | sort -u | grep -Ev '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+)\.so|/usr/local/cuda' |
  while IFS= read -r lib; do cp -L "$lib" "$stage/.device/lib/"; done
mkdir -p .device
tar -C "$stage" -czf .device/bundle.tar.gz .
ls -la .device/bundle.tar.gz
