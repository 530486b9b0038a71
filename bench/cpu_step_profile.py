#!/usr/bin/env python3
"""Where a training step on the CPU spends its time (#64 item 2), f32 or bf16, in one run:

  python3 bench/cpu_step_profile.py --coshard build/release/trainer/coshard-train \
      --rates build/release/bench/cpu_product_rates [--dtype f32|bf16] [--baseline OTHER/coshard-train] \
      [--steps 8] [--repeats 3]

The step is the issue's Llama (dim 512, 8 layers, grouped-query 8/2, MLP 1536, vocabulary 32000,
sequence 256, batch 8, one rank, every core). It prints:
  - the median step time (after --warmup steps) of coshard-train and, with --baseline, of another
    build of it, alternating --repeats times so that a slow moment of the machine falls on both;
  - the step's matrix-product work (6 x the product parameters x tokens, the input embedding not
    counted, plus attention's 12 x layers x sequence x width a token, the full square) over the
    step time, as a fraction of the products' rate at the step's shapes in the step's dtype
    (cpu_product_rates, every core, in the same run: OpenBLAS's sgemm for f32; for bf16 what
    coshard runs for it here, oneDNN natively or f32 copies);
  - with `perf` installed (Debian: linux-perf), a profile of the steps after the first (perf
    record -e cpu-clock, every thread): the CPU time by kind (the products, the cross-entropy,
    attention's softmax, the norms, the element-wise layers, libm's exp, the optimizer, the
    collectives, threads waiting) in percent of all samples and in seconds a step.
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile

LAYERS, DIM, HEADS, KV_HEADS, INTER, VOCAB, SEQ, BATCH = 8, 512, 8, 2, 1536, 32000, 256, 8
SHAPE = ["--model", "llama", "--layers", str(LAYERS), "--dim", str(DIM), "--heads", str(HEADS), "--kv-heads",
         str(KV_HEADS), "--intermediate", str(INTER), "--vocab", str(VOCAB), "--seq", str(SEQ), "--batch",
         str(BATCH), "--world-size", "1", "--zero-stage", "0"]

# The kinds of a profile, by symbol (first match wins); what matches none is "other".
KINDS = [
    ("matrix products (BLAS, oneDNN)", r"sgemm|dgemm|gemm_|dnnl|jit_|blas_|\[JIT\]"),
    ("cross-entropy", r"cross_entropy|vocab_ce|vocab_row|chunk_ce"),
    ("attention (softmax and its backward)", r"attention_"),
    ("norms", r"norm_fwd|norm_bwd"),
    ("SwiGLU, GELU, rotary", r"swiglu|gelu|rope_"),
    ("libm exp/log (softmax, cross-entropy, SwiGLU)", r"expf|exp_fma|__exp|exp@|log"),
    ("optimizer (AdamW, gradient norm)", r"adamw|sgd|grad_stats|optimizer"),
    ("collectives", r"collectives"),
    ("threads waiting (yield, schedule, futex, OpenMP)", r"sched|schedule|yield|futex|syscall|spin_unlock|libgomp"),
    ("bf16/f16 copies (widen, narrow)", r"Operands|widen|narrow"),
    ("memory (copies, page faults)", r"memmove|memcpy|memset|clear_page|page_fault|alloc"),
]


def product_flops():
    head_dim = DIM // HEADS
    block = DIM * (HEADS + 2 * KV_HEADS) * head_dim + HEADS * head_dim * DIM + 3 * DIM * INTER
    products = LAYERS * block + DIM * VOCAB  # the output layer; the embedding is a lookup
    tokens = SEQ * BATCH
    return 6 * products * tokens + 12 * LAYERS * SEQ * DIM * tokens


def steps(binary, n, metrics, dtype):
    done = subprocess.run([binary] + SHAPE + ["--dtype", dtype, "--steps", str(n), "--metrics", metrics], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"{binary} failed:\n{done.stdout}")
    with open(metrics) as f:
        return [json.loads(line)["step_ms"] / 1000.0 for line in f], done.stdout


def product_rate(rates, dtype):
    tokens = SEQ * BATCH
    qkv = (HEADS + 2 * KV_HEADS) * (DIM // HEADS)
    shapes = [(tokens, qkv, DIM), (tokens, DIM, DIM), (tokens, INTER, DIM), (tokens, DIM, INTER), (tokens, VOCAB, DIM)]
    work = [2 * m * n * k for m, n, k in shapes]
    args = [rates, "--threads", str(os.cpu_count()), "--seconds", "2"] + [str(v) for s in shapes for v in s]
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"{rates} failed:\n{done.stdout}")
    got = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    mine = [r for r in got if r["dtype"] == dtype]
    # The time the shapes' products take at their rates, over their work: the step's mix.
    return sum(work) / sum(w / (r["gflops"] * 1e9) for w, r in zip(work, mine)) / 1e9, mine[0]["kernels"]


def profile(binary, n, warmup_s, dtype):
    with tempfile.TemporaryDirectory() as tmp:
        data = os.path.join(tmp, "perf.data")
        done = subprocess.run(["perf", "record", "-q", "-D", str(int(warmup_s * 1000)), "-F", "499", "-e", "cpu-clock",
                               "-o", data, "--", binary] + SHAPE + ["--dtype", dtype, "--steps", str(n), "--quiet"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            print(f"(perf record failed: {done.stdout.strip()[-300:]})")
            return None
        report = subprocess.run(["perf", "report", "-i", data, "--no-children", "--sort", "dso,sym", "--stdio"],
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True).stdout
    shares = {name: 0.0 for name, _ in KINDS}
    shares["other"] = 0.0
    for line in report.splitlines():
        m = re.match(r"\s*([0-9.]+)%\s+(\S.*\[[.k]\]\s+.*)$", line)
        if not m:
            continue
        share, symbol = float(m.group(1)), m.group(2)
        kind = next((name for name, pattern in KINDS if re.search(pattern, symbol)), "other")
        shares[kind] += share
    return shares


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--coshard", required=True)
    p.add_argument("--rates", required=True, help="bench/cpu_product_rates of the same build")
    p.add_argument("--baseline", help="another coshard-train to time beside it (e.g. the commit before)")
    p.add_argument("--dtype", default="f32", choices=["f32", "bf16"])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()
    binaries = {"coshard": a.coshard}
    if a.baseline:
        binaries["baseline"] = a.baseline
    times = {k: [] for k in binaries}
    first = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(a.repeats):
            for name, binary in binaries.items():
                s, out = steps(binary, a.steps, os.path.join(tmp, "m.jsonl"), a.dtype)
                times[name] += s[a.warmup:]
                first.setdefault(name, (s[0], re.search(r"matrix products: (.*)", out)))
    rate, kernels = product_rate(a.rates, a.dtype)
    flops = product_flops()
    cpu = subprocess.run(["sh", "-c", "lscpu | sed -n 's/^Model name: *//p'"], stdout=subprocess.PIPE,
                         text=True).stdout.strip()
    print(f"CPU: {cpu}, {os.cpu_count()} cores; {a.dtype} products at the step's shapes {rate:.1f} GFLOP/s ({kernels})")
    print(f"step: {flops / 1e9:.1f} GFLOP of products (Llama dim {DIM}, {LAYERS} layers, GQA {HEADS}/{KV_HEADS}, "
          f"MLP {INTER}, vocab {VOCAB}, {BATCH} x {SEQ} tokens, one rank)")
    for name, t in times.items():
        median = statistics.median(t)
        print(f"  {name:9s} median {median * 1000:7.1f} ms a step over {len(t)} steps, first {first[name][0] * 1000:.0f} ms: "
              f"{flops / median / 1e9:6.1f} GFLOP/s = {flops / median / 1e9 / rate:.2f} of the products' rate")
    if a.baseline:
        print(f"  speedup {statistics.median(times['baseline']) / statistics.median(times['coshard']):.3f}x")
    if shutil.which("perf") is None:
        print("(no perf here: the profile by kind needs linux-perf)")
        return
    step = statistics.median(times["coshard"])
    for name, binary in binaries.items():
        shares = profile(binary, a.steps, first[name][0] + 2 * step + 1.0, a.dtype)
        if shares is None:
            continue
        print(f"profile of {name} (CPU samples of every thread after the first steps; seconds a step = share x cores x step):")
        for kind, share in sorted(shares.items(), key=lambda kv: -kv[1]):
            print(f"  {share:5.1f}%  {share / 100 * os.cpu_count() * statistics.median(times[name]):6.3f} s  {kind}")


if __name__ == "__main__":
    main()
