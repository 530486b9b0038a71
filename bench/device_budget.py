#!/usr/bin/env python3
"""Parameter shards placed by a device-memory budget, against every shard offloaded and none, in
one run (ZeRO-3, the optimizer in pinned memory, --offload-params cpu):

  python3 bench/device_budget.py --coshard build/release/trainer/coshard-train [--repeats 3] [-- extra flags]

The budget is the engine's device estimate with every shard offloaded plus half the shards'
bytes (read from --estimate), so about half the units keep their shards on the device. The three
modes run in turn, --repeats times (alternating, so a slow moment of the machine falls on all of
them); the step time is the median over the steps after --warmup of every run of a mode. Losses
must agree bit for bit.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

SHAPE = ["--layers", "4", "--dim", "256", "--heads", "4", "--seq", "64", "--batch", "8", "--vocab", "256",
         "--world-size", "2", "--zero-stage", "3", "--offload-optimizer", "cpu"]
UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def device_bytes(a, extra):
    out = subprocess.run([a.coshard] + SHAPE + extra + ["--estimate"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True).stdout
    total = shards = 0
    for line in out.splitlines():
        m = re.match(r"\s+(parameter shards \(f32\)|device)\s+([\d.]+) (\w+)", line)
        if m and m.group(1) == "device" and total == 0:
            total = float(m.group(2)) * UNITS[m.group(3)]
        elif m and m.group(1).startswith("parameter shards"):
            shards = float(m.group(2)) * UNITS[m.group(3)]
    return total, shards, out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--coshard", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("extra", nargs="*")
    a = p.parse_args()
    _, shards, _ = device_bytes(a, ["--offload-params", "none"])
    offloaded, _, text = device_bytes(a, ["--offload-params", "cpu"])
    # (the trainer's device total includes the batch and activations: the budget is the engine's
    # lines, so take them off again through the difference of two estimates)
    rest_engine = offloaded - sum(float(m.group(1)) * UNITS[m.group(2)] for m in
                                  re.finditer(r"(?:batch \(token ids and targets\)|activations \(one micro-batch\))\s+([\d.]+) (\w+)", text))
    budget = int(rest_engine + shards / 2)
    modes = {"none offloaded": ["--offload-params", "none"],
             "budget": ["--offload-params", "cpu", "--device-memory-budget", str(budget)],
             "all offloaded": ["--offload-params", "cpu"]}
    times = {m: [] for m in modes}
    losses = {}
    work = tempfile.mkdtemp(prefix="device_budget_")
    for r in range(a.repeats):
        for name, flags in modes.items():
            metrics = os.path.join(work, f"{r}-{name.replace(' ', '_')}.jsonl")
            done = subprocess.run([a.coshard] + SHAPE + flags + ["--steps", str(a.steps), "--quiet", "--metrics", metrics]
                                  + a.extra, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            if done.returncode != 0:
                sys.exit(f"device_budget: {name} failed:\n{done.stdout[-3000:]}")
            rows = [json.loads(line) for line in open(metrics)]
            times[name] += [row["step_ms"] for row in rows[a.warmup:]]
            losses.setdefault(name, [row["loss"] for row in rows])
    same = all(v == losses["none offloaded"] for v in losses.values())
    base = statistics.median(times["all offloaded"])
    result = {"budget_bytes": budget, "shard_bytes": shards, "losses_identical": same,
              "median_step_ms": {m: statistics.median(t) for m, t in times.items()},
              "vs_all_offloaded": {m: statistics.median(t) / base for m, t in times.items()}}
    print(json.dumps(result, indent=2))
    if not same:
        sys.exit("device_budget: the modes' losses differ")


if __name__ == "__main__":
    main()
