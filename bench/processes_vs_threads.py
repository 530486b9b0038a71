#!/usr/bin/env python3
"""Ranks as processes (mpirun, the MPI backend) against ranks as threads (the Local backend) on
the same machine, the same model, batch and data, in one run: coshard-train's step time each way.

  python3 bench/processes_vs_threads.py --coshard build/release/trainer/coshard-train \
      [--world 2] [--stage 3] [--repeats 3] [--out results.json] [-- extra coshard-train flags]

Each side runs --repeats times, alternating (so drift of the machine hits both alike); a run's
step time is the median over its steps after --warmup; a side's is the median of its runs. The
ratio is processes / threads (above 1: processes are slower). Both sides give each rank the same
BLAS threads (the cores divided by the ranks), and the same losses bit for bit (checked).
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

SHAPES = {
    # name: layers, dim, heads, seq, batch, vocab
    "small": ["--layers", "4", "--dim", "128", "--heads", "4", "--seq", "64", "--batch", "16", "--vocab", "256"],
    "medium": ["--layers", "6", "--dim", "384", "--heads", "6", "--seq", "128", "--batch", "16", "--vocab", "256"],
    "toy": ["--layers", "1", "--dim", "16", "--heads", "2", "--seq", "8", "--batch", "8", "--vocab", "32"],
}


def mpirun_prefix(world):
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        sys.exit("processes_vs_threads: no mpirun on the PATH (Debian: openmpi-bin, installed by scripts/install-deps.sh)")
    return [exe, "--oversubscribe", "--bind-to", "none", "-np", str(world)]


def run(cmd, metrics, env):
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"processes_vs_threads: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}")
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coshard", required=True, help="the coshard-train binary")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--shape", choices=sorted(SHAPES), default="medium")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("extra", nargs="*", help="more coshard-train flags (after --)")
    a = p.parse_args()
    if a.steps <= a.warmup:
        sys.exit(f"processes_vs_threads: --steps {a.steps} must be above --warmup {a.warmup}")

    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl=os.environ.get("OMPI_MCA_btl", "self,vader"))
    cores = os.cpu_count() or 1
    blas = str(max(1, cores // a.world))
    common = SHAPES[a.shape] + ["--steps", str(a.steps), "--zero-stage", str(a.stage), "--quiet",
                                "--blas-threads", blas] + a.extra
    work = tempfile.mkdtemp(prefix="coshard_pvt_")
    sides = {"threads": [], "processes": []}
    losses = {}
    try:
        for i in range(a.repeats):
            for side in ("threads", "processes"):
                metrics = os.path.join(work, f"{side}-{i}.jsonl")
                if side == "threads":
                    cmd = [a.coshard, "--world-size", str(a.world)] + common + ["--metrics", metrics]
                else:
                    cmd = mpirun_prefix(a.world) + [a.coshard] + common + ["--metrics", metrics]
                rows = run(cmd, metrics, env)
                sides[side].append(statistics.median(r["step_ms"] for r in rows[a.warmup:]))
                losses.setdefault(side, [r["loss"] for r in rows])
                print(f"{side:9s} run {i + 1}: median step {sides[side][-1]:.3f} ms", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if losses["threads"] != losses["processes"]:
        sys.exit("processes_vs_threads: the two sides' losses differ; the comparison is void")
    threads = statistics.median(sides["threads"])
    processes = statistics.median(sides["processes"])
    result = {
        "machine": {"cores": cores, "uname": " ".join(os.uname())},
        "world": a.world, "stage": a.stage, "shape": a.shape, "steps": a.steps, "warmup": a.warmup,
        "blas_threads_per_rank": int(blas), "extra": a.extra,
        "threads_step_ms": threads, "processes_step_ms": processes,
        "threads_runs_ms": sides["threads"], "processes_runs_ms": sides["processes"],
        "ratio_processes_over_threads": processes / threads,
        "same_losses": True,
    }
    print(f"world {a.world}, ZeRO-{a.stage}, {a.shape}: threads {threads:.3f} ms/step, processes (mpirun) "
          f"{processes:.3f} ms/step, ratio {processes / threads:.3f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
