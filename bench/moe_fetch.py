#!/usr/bin/env python3
"""Routing-aware expert fetches at ZeRO-3 against gathering every expert (#62), in one run:

  python3 bench/moe_fetch.py --coshard build/release/trainer/coshard-train \
      [--worlds 2,3,4] [--tokens 4,32] [--steps 8] [--out results.json]

Two mixture-of-experts Llamas (4 layers, dim 256, 4 heads, Qwen3-MoE's layout, the load-balancing
loss at 0.01): top-2 of 16 experts of 256, and top-8 of 64 experts of 64. Each block activation-
checkpointed (so no unit spans two blocks), at each world size, with small micro-batches (one
sequence of --tokens tokens a rank), two ways:
  routed   (the default) the ranks agree on each layer's routed experts and gather exactly those,
           in one order, each expert its own unit; an expert nobody routed to is neither
           gathered nor reduced
  all      --expert-fetch all: every expert gathered and reduced in every pass, the bytes of
           FSDP2's fully_shard(block) and DeepSpeed's MoE-block leaf (in one launch an expert
           here, where those take one a block)
Both coalesce the small leaves (--module-granularity of one expert's bytes; a unit never spans
two experts).
Printed per case: bytes gathered a step (forward, the checkpoint's replay and backward: the
engine's gathered_bytes), collective launches a step, step time, each the mean over the steps
after the first two; and routed's share of all's. The routed experts depend on how many tokens
a step routes: with few (small micro-batches, or sampling a token at a time) few experts are
touched; with thousands every expert is, and routing-aware fetch then gathers what all does.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

SHAPES = {
    "top-2 of 16": {"experts": 16, "top": 2, "width": 256},
    "top-8 of 64": {"experts": 64, "top": 8, "width": 64},
}
DIM, LAYERS = 256, 4


def run(coshard, shape, world, tokens, mode, steps, scratch):
    s = SHAPES[shape]
    expert_bytes = 3 * DIM * s["width"] * 4  # gate_up and down, f32
    granularity = expert_bytes
    metrics = os.path.join(scratch, f"{shape.replace(' ', '_')}_{world}_{tokens}_{mode}.jsonl")
    cmd = [coshard, "--model", "llama", "--layers", str(LAYERS), "--dim", str(DIM), "--heads", "4", "--experts",
           str(s["experts"]), "--experts-per-token", str(s["top"]), "--expert-width", str(s["width"]),
           "--router-aux-loss-coef", "0.01", "--activation-checkpointing", "full", "--module-granularity",
           str(granularity), "--expert-fetch", mode, "--world-size", str(world), "--seq", str(tokens), "--batch", str(world), "--steps",
           str(steps), "--lr", "0.003", "--metrics", metrics, "--quiet"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{done.stdout}{done.stderr}")
    rows = [json.loads(line) for line in open(metrics)][2:]
    mean = lambda key: statistics.mean(r[key] for r in rows)
    return {"gathered_bytes": mean("gathered_bytes"), "launches": mean("collective_launches"),
            "step_ms": statistics.median(r["step_ms"] for r in rows),
            "experts_used": statistics.mean(statistics.mean(r["experts_used"]) for r in rows)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coshard", required=True)
    p.add_argument("--worlds", default="2,3,4")
    p.add_argument("--tokens", default="4,32")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out")
    a = p.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as scratch:
        print(f"{'shape':12} {'world':>5} {'tokens':>6} {'experts used':>12} {'mode':7} {'MiB gathered':>12} "
              f"{'launches':>8} {'step ms':>8}  routed / all (bytes, time)")
        for shape in SHAPES:
            for world in [int(w) for w in a.worlds.split(",")]:
                for tokens in [int(t) for t in a.tokens.split(",")]:
                    r = {m: run(a.coshard, shape, world, tokens, m, a.steps, scratch) for m in ("routed", "all")}
                    for m in ("routed", "all"):
                        x = r[m]
                        ratio = (f"  {r['routed']['gathered_bytes'] / r['all']['gathered_bytes']:.2f}, "
                                 f"{r['routed']['step_ms'] / r['all']['step_ms']:.2f}") if m == "routed" else ""
                        print(f"{shape:12} {world:5d} {tokens:6d} {x['experts_used']:12.1f} {m:7} "
                              f"{x['gathered_bytes'] / 2**20:12.2f} {x['launches']:8.0f} {x['step_ms']:8.1f}{ratio}")
                        results.append({"shape": shape, "world": world, "tokens": tokens, "mode": m, **x})
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
