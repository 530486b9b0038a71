#!/usr/bin/env python3
"""Training quality under ZeRO++'s quantized communication (#63), in one run:

  python3 bench/quantized_quality.py --coshard build/release/trainer/coshard-train \
      [--world-size 2] [--seeds 1,2,3] [--out results.json]

Two jobs, each trained once with exact ZeRO-3 and once with each quantized mode:
  main    the README's main job (scripts/run.sh: a GPT of 0.14M parameters on the repository's
          docs as bytes, 600 steps, cosine decay)
  llama   a Llama of 3.1M parameters (4 layers, dim 256, 8 heads over 4 key/value heads) on the
          same text, 400 steps, cosine decay
Modes: exact (ZeRO-3), exact1 (the same on one rank, first seed only: its distance from exact is the
order of additions alone), qweights (--quantize-weights int8), qgrads (--quantize-gradients int8), qboth
(both), qgrads4 (--quantize-gradients int4, DeepSpeed's format). (The secondary partition changes no
value: its runs are the others' to the bit, so it has no mode here.) Every run: the same data, --world-size
ranks as threads; each job once per seed (--seeds), as a run perturbed at every step ends wherever its
trajectory takes it: the seeds' spread of exact runs is the yardstick for one run's difference. The loss compared is the validation loss over fixed
batches of the same text (--val-data, --eval-batches 8, every 100 steps and after the last): one
batch's training loss is noisy, and runs that differ in their last bits wander apart step by step
(chaotic, not biased), so a mean of training losses can differ by a few percent between two exact
runs. The script prints the validation curves side by side, the training loss's means over windows
of 100 steps, and each mode's final validation loss against exact's (target: within 1%), with the
gathers' bytes a step against exact's.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data", "coshard_docs.txt")
JOBS = {
    "main": ["--data", DATA, "--layers", "2", "--dim", "64", "--heads", "4", "--seq", "128", "--batch", "32",
             "--steps", "600", "--lr", "0.01", "--warmup", "30", "--lr-decay", "cosine", "--min-lr", "0.001",
             "--val-data", DATA, "--eval-every", "100", "--eval-batches", "8"],
    "llama": ["--data", DATA, "--model", "llama", "--layers", "4", "--dim", "256", "--heads", "8", "--kv-heads", "4",
              "--seq", "64", "--batch", "16", "--steps", "400", "--lr", "0.003", "--warmup", "20", "--lr-decay",
              "cosine", "--min-lr", "0.0003", "--val-data", DATA, "--eval-every", "100", "--eval-batches", "8"],
}
MODES = {
    "exact": [],
    "exact1": ["--world-size", "1"],
    "qweights": ["--quantize-weights", "int8"],
    "qgrads": ["--quantize-gradients", "int8"],
    "qboth": ["--quantize-weights", "int8", "--quantize-gradients", "int8"],
    "qgrads4": ["--quantize-gradients", "int4"],
}
WINDOW = 100


def train(a, job, mode, seed, work):
    metrics = os.path.join(work, f"{job}-{mode}-{seed}.jsonl")
    world = ["--world-size", str(a.world_size)] if "--world-size" not in MODES[mode] else []
    cmd = [a.coshard] + JOBS[job] + ["--zero-stage", "3", "--quiet", "--metrics", metrics, "--seed", str(seed)] + world + \
        MODES[mode]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"quantized_quality: {' '.join(cmd)} failed ({done.returncode}):\n{done.stdout[-4000:]}")
    with open(metrics) as f:
        return [json.loads(line) for line in f]


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--coshard", required=True, help="the coshard-train binary")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--jobs", default="main,llama")
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--modes", default=",".join(MODES), help="which of " + ", ".join(MODES) + " (exact always)")
    p.add_argument("--out", help="write the results as JSON here")
    a = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="quantized_quality.") as work:
        for job in a.jobs.split(","):
            seeds = [int(x) for x in a.seeds.split(",")]
            finals = {}
            for seed in seeds:
                wanted = set(a.modes.split(",")) | {"exact"}
                modes = [m for m in MODES if m in wanted and (m != "exact1" or seed == seeds[0])]
                runs = {mode: train(a, job, mode, seed, work) for mode in modes}
                evals = [i for i, r in enumerate(runs["exact"]) if "val_loss" in r]
                print(f"\n{job}, seed {seed}: validation loss (world {a.world_size}, ZeRO-3; exact1: one rank)")
                print("| step | " + " | ".join(modes) + " |")
                print("|---|" + "---|" * len(modes))
                for i in evals:
                    print(f"| {i + 1} | " + " | ".join(f"{runs[m][i]['val_loss']:.4f}" for m in modes) + " |")
                exact_final = runs["exact"][-1]["val_loss"]
                exact_bytes = statistics.mean(r["gathered_bytes"] for r in runs["exact"])
                for mode, rows in runs.items():
                    final = rows[-1]["val_loss"]
                    finals.setdefault(mode, []).append(final)
                    gathered = statistics.mean(r["gathered_bytes"] for r in rows)
                    results.setdefault(job, {}).setdefault(mode, []).append(
                        {"seed": seed, "final_val_loss": final, "losses": [r["loss"] for r in rows],
                         "val_losses": [rows[i]["val_loss"] for i in evals], "gathered_bytes_per_step": gathered})
                    print(f"{job} seed {seed} {mode:>9}: final validation loss {final:.4f}, "
                          f"{100 * (final - exact_final) / exact_final:+.2f}% against exact; gathered bytes a step "
                          f"{gathered / 1e6:.3f} MB ({gathered / exact_bytes:.2f}x)", flush=True)
            print(f"\n{job}: final validation loss over seeds {seeds} (each mode against exact's over the same seeds)")
            print("| mode | seeds | mean | spread (max - min) | mean vs exact's | per seed vs exact's |")
            print("|---|---|---|---|---|---|")
            for mode, values in finals.items():
                exact = finals["exact"][:len(values)]
                per_seed = ", ".join(f"{100 * (v - e) / e:+.2f}%" for v, e in zip(values, exact))
                print(f"| {mode} | {len(values)} | {statistics.mean(values):.4f} | {max(values) - min(values):.4f} | "
                      f"{100 * (statistics.mean(values) - statistics.mean(exact)) / statistics.mean(exact):+.2f}% | "
                      f"{per_seed} |", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
