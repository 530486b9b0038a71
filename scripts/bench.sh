#!/usr/bin/env bash
# Runs the benchmarks of a build folder with JSON output and prints coshard-vs-baseline ratios.
#   scripts/bench.sh [BUILD_DIR] [extra Google Benchmark flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
shift || true

out="$build/bench/runtime_bench.json"
"$build/bench/runtime_bench" --benchmark_format=console --benchmark_out="$out" \
  --benchmark_out_format=json --benchmark_repetitions=3 --benchmark_report_aggregates_only=true "$@"
python3 bench/report.py "$out"
