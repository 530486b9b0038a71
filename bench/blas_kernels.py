#!/usr/bin/env python3
"""The CPU's matrix products on the default OpenBLAS kernels against the same run with the right
core named, in one script (#48 item 15):

  python3 bench/blas_kernels.py --coshard build/release/trainer/coshard-train [--repeats 3] [--core SkylakeX]

Three modes, in turn, --repeats times (alternating, so a slow moment of the machine falls on all):
  default   coshard-train as a user runs it (it restarts itself with the best kernels it knows for
            this CPU when OpenBLAS picked weaker ones; the header's "matrix products" line says)
  named     OPENBLAS_CORETYPE=--core (default: the core the default run's header names)
  generic   OPENBLAS_CORETYPE=Prescott: OpenBLAS's generic kernels, what Debian 12's OpenBLAS runs
            on CPUs newer than it (a Sapphire Rapids Xeon), for the size of what the check catches
The step time is the median over the steps after --warmup of every run of a mode; the ratio is
each mode's against `named`. The shape is the report's: a dim-512, 8-layer Llama at sequence 256,
batch 8, one rank.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

SHAPE = ["--preset", "llama-tiny", "--layers", "8", "--dim", "512", "--heads", "8", "--seq", "256", "--batch", "8",
         "--world-size", "1", "--zero-stage", "3"]


def run(a, core, metrics):
    env = dict(os.environ)
    env.pop("OPENBLAS_CORETYPE", None)
    env.pop("COSHARD_BLAS_REPLACED", None)
    if core:
        env["OPENBLAS_CORETYPE"] = core
    out = subprocess.run([a.coshard] + SHAPE + ["--steps", str(a.steps), "--metrics", metrics], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if out.returncode != 0:
        sys.exit(f"coshard-train failed ({core or 'default'}):\n{out.stdout}")
    kernels = re.search(r"matrix products: (.*)", out.stdout)
    with open(metrics) as f:
        steps = [json.loads(line)["step_ms"] for line in f]
    return steps[a.warmup:], kernels.group(1) if kernels else "?"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--coshard", required=True)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--core", default="", help="the core to name (default: the one the default run runs)")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        metrics = os.path.join(tmp, "m.jsonl")
        _, default_kernels = run(a, "", metrics)
        core = a.core or re.match(r"OpenBLAS (\S+) kernels", default_kernels).group(1)
        modes = {"default": "", "named": core, "generic": "Prescott"}
        times = {m: [] for m in modes}
        seen = {}
        for _ in range(a.repeats):
            for mode, c in modes.items():
                steps, kernels = run(a, c, metrics)
                times[mode] += steps
                seen[mode] = kernels
    named = statistics.median(times["named"])
    print(f"machine: {os.cpu_count()} cores; shape: {' '.join(SHAPE)}; {a.repeats} x {a.steps - a.warmup} steps a mode")
    for mode in modes:
        t = statistics.median(times[mode])
        print(f"{mode:8s} {t:9.1f} ms/step  {t / named:5.2f}x of named   ({seen[mode]})")


if __name__ == "__main__":
    main()
