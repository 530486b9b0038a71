#!/usr/bin/env bash
# NvmeStore against fio on the same file, block size and queue depth, in one run.
#   scripts/nvme_vs_fio.sh [BUILD_DIR] [DIR]     (DIR: a folder on the disk to measure, not tmpfs)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
dir=${2:-$build/bench}
command -v fio >/dev/null || { echo "nvme_vs_fio: fio is not installed (apt-get install fio)" >&2; exit 2; }
mkdir -p "$dir"
out="$build/bench/nvme_bench.json"
COSHARD_NVME_DIR="$dir" "$build/bench/nvme_bench" --benchmark_out="$out" --benchmark_out_format=json \
  --benchmark_repetitions=3 --benchmark_report_aggregates_only=true
for rw in write read; do
  for qd in 8 16 32; do
    fio --name="fio_${rw}_${qd}" --filename="$dir/nvme_bench.bin" --rw="$rw" --bs=1M --size=256M \
        --iodepth="$qd" --ioengine=io_uring --direct=1 --time_based=0 --loops=8 --output-format=json \
        > "$build/bench/fio_${rw}_${qd}.json"
  done
done
python3 - "$out" "$build/bench" <<'PY'
import json, sys
ours = {}
for b in json.load(open(sys.argv[1]))["benchmarks"]:
    if b.get("aggregate_name") != "median":
        continue
    name, qd = b["run_name"].split("/")[:2]
    ours[("write" if "Write" in name else "read", int(qd))] = b["bytes_per_second"]
print(f"\n{'op':6} {'QD':>3} {'coshard GB/s':>13} {'fio GB/s':>9} {'ratio':>6}")
for (rw, qd), bw in sorted(ours.items()):
    job = json.load(open(f"{sys.argv[2]}/fio_{rw}_{qd}.json"))["jobs"][0][rw]
    fio_bw = job["bw_bytes"]
    print(f"{rw:6} {qd:>3} {bw / 1e9:13.2f} {fio_bw / 1e9:9.2f} {bw / fio_bw:6.2f}")
PY
