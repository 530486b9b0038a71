#!/usr/bin/env bash
# NvmeStore against fio and against plain liburing on the same file, block size and queue depth,
# in alternating rounds (bench/nvme_vs_fio.py says how).
#   scripts/nvme_vs_fio.sh [BUILD_DIR] [DIR] [extra flags of bench/nvme_vs_fio.py...]
#   (BUILD_DIR: a build with COSHARD_BUILD_BENCH=ON; DIR: a folder on the disk, not tmpfs)
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build/release}
dir=${2:-$build/bench/nvme}
shift $(( $# > 2 ? 2 : $# )) || true
command -v fio >/dev/null || { echo "nvme_vs_fio: fio is not installed (apt-get install fio)" >&2; exit 2; }
exec python3 bench/nvme_vs_fio.py --bench "$build/bench/nvme_bench" --dir "$dir" --out "$build/bench/nvme_vs_fio.json" "$@"
