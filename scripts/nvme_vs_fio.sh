#!/usr/bin/env bash
# NvmeStore against fio and against plain liburing (with and without registered buffers) on the
# same file, block size and queue depth, in one run.
#   scripts/nvme_vs_fio.sh [BUILD_DIR] [DIR]     (DIR: a folder on the disk to measure, not tmpfs)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
dir=${2:-$build/bench}
command -v fio >/dev/null || { echo "nvme_vs_fio: fio is not installed (apt-get install fio)" >&2; exit 2; }
mkdir -p "$dir"
out="$build/bench/nvme_bench.json"
COSHARD_NVME_DIR="$dir" "$build/bench/nvme_bench" --benchmark_out="$out" --benchmark_out_format=json \
  --benchmark_repetitions=3 --benchmark_report_aggregates_only=true --benchmark_enable_random_interleaving=true
for rw in write read; do
  for qd in 8 16 32; do
    fio --name="fio_${rw}_${qd}" --filename="$dir/nvme_bench.bin" --rw="$rw" --bs=1M --size=256M \
        --iodepth="$qd" --ioengine=io_uring --direct=1 --time_based=0 --loops=8 --output-format=json \
        > "$build/bench/fio_${rw}_${qd}.json"
  done
done
python3 - "$out" "$build/bench" <<'PY'
import json, sys
rates = {}  # (engine, op, QD) -> bytes/s; engine: store (NvmeStore on Asio), uring, fixed
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    if b.get("aggregate_name") != "median":
        continue
    name, qd = b["run_name"].split("/")[:2]
    engine = "fixed" if name.endswith("Fixed") else "uring" if "Uring" in name else "store"
    rates[(engine, "write" if "Write" in name else "read", int(qd))] = b["bytes_per_second"]
print(f"\n{'op':6} {'QD':>3} {'store GB/s':>11} {'fio GB/s':>9} {'store/fio':>10} {'liburing GB/s':>14} {'store/liburing':>15} {'fixed/plain':>12}")
for (engine, rw, qd), bw in sorted(rates.items()):
    if engine != "store":
        continue
    fio_bw = json.load(open(f"{sys.argv[2]}/fio_{rw}_{qd}.json"))["jobs"][0][rw]["bw_bytes"]
    uring, fixed = rates.get(("uring", rw, qd), float("nan")), rates.get(("fixed", rw, qd), float("nan"))
    print(f"{rw:6} {qd:>3} {bw / 1e9:11.2f} {fio_bw / 1e9:9.2f} {bw / fio_bw:10.2f} {uring / 1e9:14.2f} {bw / uring:15.2f} {fixed / uring:12.2f}")
PY
