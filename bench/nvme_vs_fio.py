#!/usr/bin/env python3
"""NvmeStore against fio and against plain liburing, side by side: the same file (256 MiB), block
size (1 MiB), queue depth and O_DIRECT, in alternating rounds so that the disk's drift (a virtual
disk's rate wanders by tens of percent over minutes) falls on all three alike:

  python3 bench/nvme_vs_fio.py --bench build/release/bench/nvme_bench --dir /work/nvme_bench \
      [--rounds 7] [--depth 16] [--out results.json]

Each round runs, for writes then reads, the store (BM_NvmeWrite/BM_NvmeRead of nvme_bench, one
repetition of at least a second), liburing (BM_UringWrite/BM_UringRead: the same transfers
straight through liburing) and fio (--ioengine=io_uring --direct=1), in an order that rotates from
round to round. Reported: each engine's median rate, and the store's ratios to fio and to liburing,
per round and as the median of the per-round ratios (a round's three runs are minutes closer than
the rounds are to one another).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

ENGINES = ("store", "uring", "fio")


def bench_rate(bench, directory, name):
    out = subprocess.run([bench, f"--benchmark_filter=^{name}", "--benchmark_min_time=1", "--benchmark_format=json"],
                         env=dict(os.environ, COSHARD_NVME_DIR=directory), stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    if out.returncode != 0:
        sys.exit(f"nvme_vs_fio: {bench} {name} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    runs = [b for b in json.loads(out.stdout)["benchmarks"] if b.get("run_type", "iteration") == "iteration"]
    if not runs or runs[0].get("error_occurred"):
        sys.exit(f"nvme_vs_fio: {name}: {runs[0].get('error_message') if runs else 'no result'}")
    return runs[0]["bytes_per_second"]


def fio_rate(directory, rw, depth):
    out = subprocess.run(["fio", "--name=fio", f"--filename={os.path.join(directory, 'nvme_bench.bin')}", f"--rw={rw}",
                          "--bs=1M", "--size=256M", f"--iodepth={depth}", "--ioengine=io_uring", "--direct=1",
                          "--loops=4", "--output-format=json"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if out.returncode != 0:
        sys.exit(f"nvme_vs_fio: fio {rw} failed ({out.returncode}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout)["jobs"][0][rw]["bw_bytes"]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bench", required=True, help="nvme_bench of a release build (COSHARD_BUILD_BENCH=ON)")
    p.add_argument("--dir", required=True, help="a folder on the disk to measure (not tmpfs: O_DIRECT)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--out")
    a = p.parse_args()
    if subprocess.run(["which", "fio"], stdout=subprocess.DEVNULL).returncode != 0:
        sys.exit("nvme_vs_fio: fio is not installed (apt-get install fio)")
    os.makedirs(a.dir, exist_ok=True)
    rates = {(e, rw): [] for e in ENGINES for rw in ("write", "read")}
    for r in range(a.rounds):
        order = ENGINES[r % 3:] + ENGINES[:r % 3]
        for rw in ("write", "read"):
            for e in order:
                name = f"BM_{'Nvme' if e == 'store' else 'Uring'}{rw.capitalize()}/{a.depth}/"
                rate = fio_rate(a.dir, rw, a.depth) if e == "fio" else bench_rate(a.bench, a.dir, name)
                rates[(e, rw)].append(rate)
            print(f"round {r + 1} {rw:5}: " + "  ".join(f"{e} {rates[(e, rw)][-1] / 1e9:.2f} GB/s" for e in ENGINES),
                  flush=True)
    result = {"depth": a.depth, "rounds": a.rounds, "block_bytes": 1 << 20, "file_bytes": 256 << 20, "ops": {}}
    print(f"\n{'op':6} {'store GB/s':>11} {'fio GB/s':>9} {'liburing GB/s':>14} {'store/fio':>10} {'store/liburing':>15}"
          "   (medians; ratios: median of the rounds' ratios, [min, max])")
    for rw in ("write", "read"):
        store, fio, uring = rates[("store", rw)], rates[("fio", rw)], rates[("uring", rw)]
        vs_fio = [s / f for s, f in zip(store, fio)]
        vs_uring = [s / u for s, u in zip(store, uring)]
        result["ops"][rw] = {"store": store, "fio": fio, "uring": uring,
                             "store_vs_fio": statistics.median(vs_fio), "store_vs_uring": statistics.median(vs_uring),
                             "store_vs_fio_range": [min(vs_fio), max(vs_fio)],
                             "store_vs_uring_range": [min(vs_uring), max(vs_uring)]}
        print(f"{rw:6} {statistics.median(store) / 1e9:11.2f} {statistics.median(fio) / 1e9:9.2f} "
              f"{statistics.median(uring) / 1e9:14.2f} {statistics.median(vs_fio):10.2f} {statistics.median(vs_uring):15.2f}"
              f"   [{min(vs_fio):.2f}, {max(vs_fio):.2f}] [{min(vs_uring):.2f}, {max(vs_uring):.2f}]")
    try:
        os.remove(os.path.join(a.dir, "nvme_bench.bin"))
    except OSError:
        pass
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
