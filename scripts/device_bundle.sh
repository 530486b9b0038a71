#!/usr/bin/env bash
# Packs a CUDA-enabled build for a lent GPU machine (a developer tool; CI never runs it):
# the test build's binaries and CTest files, the release build's benchmarks and trainer, and the
# shared libraries they need that a CUDA image may lack (OpenBLAS, liburing, ...), into
# .device/bundle.tar.xz (ignored by git; carried by the device tool). scripts/device_check.sh
# unpacks and runs it there.
#   scripts/device_bundle.sh [TEST_BUILD=build/test] [RELEASE_BUILD=build/release]
# One build may serve as both (a test build configured with -DCOSHARD_BUILD_BENCH=ON), and it may
# live in another checkout of the same commit: .device/source_dir names the source folder the
# build was made from, which scripts/device_env.sh links to the unpacked tree there. The bundle is
# written to this checkout's .device/ (the one the device tool sends).
set -euo pipefail
cd "$(dirname "$0")/.."
here=$PWD
test_build=$(realpath "${1:-build/test}")
release_build=$(realpath "${2:-build/release}")
builds=$(printf '%s\n' "$test_build" "$release_build" | sort -u)
source_dir=$(sed -n 's/^CMAKE_HOME_DIRECTORY:INTERNAL=//p' "$test_build/CMakeCache.txt")
for b in $builds; do cmake --build "$b" -j2; done

stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
cd "$source_dir"
# Binaries keep their paths (tests name helper programs by absolute path); debug info stripped.
while IFS= read -r f; do
  mkdir -p "$stage/$(dirname "$f")"
  if file -b "$f" | grep ELF >/dev/null; then strip --strip-debug -o "$stage/$f" "$f"; else cp "$f" "$stage/$f"; fi
done < <(find $(for b in $builds; do realpath --relative-to="$source_dir" "$b"; done) -type f \( -perm -u+x -o -name '*.cmake' -o -name 'CTestTestfile.cmake' \) \
           -not -path '*/CMakeFiles/*' -not -name '*.so*' -not -name '*.a' | grep -v '_deps' )
# Libraries outside glibc and the CUDA toolkit (which the image has). cuBLAS, cuBLASLt, NCCL and
# cuDNN are not among what ldd lists (coshard opens them at run time): device_env.sh finds the
# image's or PyTorch's.
mkdir -p "$stage/.device/lib"
echo "$source_dir" >"$stage/.device/source_dir"
# The Python and CMake the tests name by absolute path (device_env.sh links the machine's own there).
sed -n 's/^_Python3_EXECUTABLE:INTERNAL=//p' "$test_build/CMakeCache.txt" >"$stage/.device/python"
sed -n 's/^CMAKE_COMMAND:INTERNAL=//p' "$test_build/CMakeCache.txt" >"$stage/.device/cmake"
for bin in $(find "$stage" -type f -perm -u+x); do
  file -b "$bin" | grep ELF >/dev/null || continue
  ldd "$bin" 2>/dev/null | awk '/=> \//{print $3}'
done | sort -u | grep -Ev '/(libc|libm|libdl|librt|libpthread|libgcc_s|libstdc\+\+)\.so|/usr/local/cuda' |
  while IFS= read -r lib; do cp -L "$lib" "$stage/.device/lib/"; done
mkdir -p "$here/.device"
# xz: a test build with its libraries is ~75 MB gzipped, over what the device tool carries (64 MiB).
rm -f "$here/.device/bundle.tar.gz"
tar -C "$stage" -cf - . | xz -T0 -6 >"$here/.device/bundle.tar.xz"
ls -la "$here/.device/bundle.tar.xz"
