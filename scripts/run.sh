#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds (Release), and runs the main job:
# coshard-train on its defaults (a GPT on the built-in synthetic task, 2 ranks, ZeRO-3, CPU, about
# a minute), writing per-step metrics to build/release/metrics.jsonl, with a sample every 200
# steps and after the last. Arguments go to coshard-train.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
source scripts/ccache.sh
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOSHARD_BUILD_TESTS=OFF \
  "${coshard_launcher_args[@]}" >/dev/null
cmake --build build/release
build/release/trainer/coshard-train --metrics build/release/metrics.jsonl --sample-every 200 "$@"
