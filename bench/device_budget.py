#!/usr/bin/env python3
"""What a device-memory budget places, against both ends, in one run (ZeRO-3):

  python3 bench/device_budget.py --coshard build/release/trainer/coshard-train [--what shards|state] [--repeats 3] [-- extra flags]

--what shards (default): parameter shards, the optimizer in pinned memory (--offload-params cpu):
every shard offloaded, none, and a budget of the engine's device estimate with every shard
offloaded plus half the shards' bytes (read from --estimate), so about half the units keep their
shards on the device.
--what state: optimizer state, the parameters on the device (--offload-optimizer cpu, Twin-Flow):
the optimizer on the device, on the host, and a budget halfway between the two ends' engine
device estimates, so about half the state steps on the device (--clip 0: with clipping the
gradient norm is summed in two parts and may differ in its last bit).

The three modes run in turn, --repeats times (alternating, so a slow moment of the machine falls
on all of them); the step time is the median over the steps after --warmup of every run of a
mode. Losses must agree bit for bit.
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile

SHAPE = ["--layers", "4", "--heads", "4", "--vocab", "256", "--zero-stage", "3"]
ACTIVATIONS = r"(?:batch \(token ids and targets\)|activations \(one micro-batch\))\s+([\d.]+) (\w+)"
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


def engine_device(a, flags):
    """The engine's device lines of the estimate: the trainer's total less the batch and activations."""
    total, _, text = device_bytes(a, flags)
    return total - sum(float(m.group(1)) * UNITS[m.group(2)] for m in re.finditer(ACTIVATIONS, text))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--coshard", required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--what", choices=("shards", "state"), default="shards")
    # The GPT's width and a step's tokens: a smaller step makes the optimizer's share larger.
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("extra", nargs="*")
    a = p.parse_args()
    SHAPE.extend(["--dim", str(a.dim), "--seq", str(a.seq), "--batch", str(a.batch), "--world-size", str(a.world_size)])
    if a.what == "shards":
        base_flags = ["--offload-optimizer", "cpu"]
        _, shards, _ = device_bytes(a, base_flags + ["--offload-params", "none"])
        rest_engine = engine_device(a, base_flags + ["--offload-params", "cpu"])
        budget = int(rest_engine + shards / 2)
        placed = shards
        modes = {"none offloaded": base_flags + ["--offload-params", "none"],
                 "budget": base_flags + ["--offload-params", "cpu", "--device-memory-budget", str(budget)],
                 "all offloaded": base_flags + ["--offload-params", "cpu"]}
    else:
        base_flags = ["--clip", "0"]
        rest_engine = engine_device(a, base_flags + ["--offload-optimizer", "cpu"])
        full_engine = engine_device(a, base_flags + ["--offload-optimizer", "cpu", "--device-memory-budget", str(1 << 40)])
        budget = int(rest_engine + (full_engine - rest_engine) / 2)
        placed = full_engine - rest_engine
        modes = {"none offloaded": base_flags + ["--offload-optimizer", "none"],
                 "budget": base_flags + ["--offload-optimizer", "cpu", "--device-memory-budget", str(budget)],
                 "all offloaded": base_flags + ["--offload-optimizer", "cpu"]}
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
    result = {"what": a.what, "budget_bytes": budget, "placed_bytes": placed, "losses_identical": same,
              "median_step_ms": {m: statistics.median(t) for m, t in times.items()},
              "vs_all_offloaded": {m: statistics.median(t) / base for m, t in times.items()}}
    print(json.dumps(result, indent=2))
    if not same:
        sys.exit("device_budget: the modes' losses differ")


if __name__ == "__main__":
    main()
