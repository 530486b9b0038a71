#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds (Release), and runs the main job.
# Until the trainer exists (issue #7), the main job is the runtime benchmark: coshard's hot paths
# beside their baselines, with the ratios summarised. JSON lands in build/release/bench/.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOSHARD_BUILD_TESTS=OFF >/dev/null
cmake --build build/release
bash scripts/bench.sh build/release
