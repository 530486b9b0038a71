#!/usr/bin/env bash
# Runs a benchmark of a build folder with JSON output and prints coshard-vs-baseline ratios.
#   scripts/bench.sh [BUILD_DIR] [runtime|collectives|nvme|modules] [extra Google Benchmark flags...]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
which=${2:-runtime}
shift $(( $# > 2 ? 2 : $# )) || true

out="$build/bench/${which}_bench.json"
"$build/bench/${which}_bench" --benchmark_format=console --benchmark_out="$out" \
  --benchmark_out_format=json --benchmark_repetitions=3 --benchmark_report_aggregates_only=true "$@"
python3 bench/report.py "$out"
