#!/usr/bin/env bash
# Installs the build tree into a temporary prefix, moves the prefix elsewhere (the package must be
# relocatable), then configures, builds and runs an outside project against it.
set -euo pipefail
build_dir=$1
consumer_src=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
mv "$work/prefix" "$work/moved-prefix"
# As the consumer leaves it (the package's cxx_std_20), then as a C++23 project: one Result type
# and one ABI in both.
for standard in "" 23; do
  build="$work/build${standard}"
  cmake -S "$consumer_src" -B "$build" -G Ninja -DCMAKE_PREFIX_PATH="$work/moved-prefix" \
        -DCMAKE_BUILD_TYPE=Release ${standard:+-DCMAKE_CXX_STANDARD=$standard} >/dev/null
  cmake --build "$build" >/dev/null
  "$build/consumer"
  "$build/custom_loop" >/dev/null
done
