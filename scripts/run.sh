#!/usr/bin/env bash
# Quick start, command 1: installs what is missing, builds (Release), and runs the main job:
# coshard-train learning text, a small GPT trained on data/coshard_docs.txt (the project's own
# documentation, bytes as tokens) with 2 ranks as threads, ZeRO-3, on the CPU, for about a
# minute; a sample every 200 steps shows it learning to write. Per-step metrics go to
# build/release/metrics.jsonl.
#
# With arguments, they replace the main job's and go to coshard-train as they are, e.g.
#   ./scripts/run.sh --data my_book.txt --steps 2000 --sample-every 500
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
source scripts/ccache.sh
cmake -S . -B build/release -G Ninja -DCMAKE_BUILD_TYPE=Release -DCOSHARD_BUILD_TESTS=OFF \
  "${coshard_launcher_args[@]}" >/dev/null
cmake --build build/release

if [ $# -eq 0 ]; then
  main_job=(
    --data data/coshard_docs.txt                       # text, read as bytes (a vocabulary of 256)
    --layers 2 --dim 64 --heads 4 --seq 128 --batch 32  # 0.14M parameters, 4,096 tokens a step
    --steps 600 --lr 0.01 --warmup 30 --lr-decay cosine --min-lr 0.001
    --sample-every 200 --prompt "The engine " --sample-tokens 100 --temperature 0.8
    --metrics build/release/metrics.jsonl
  )
  set -- "${main_job[@]}"
fi
exec build/release/trainer/coshard-train "$@"
