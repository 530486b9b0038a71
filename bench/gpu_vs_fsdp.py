#!/usr/bin/env python3
"""coshard against PyTorch FSDP2 on the same GPU, the same model and the same batch, in one run.

Two model families, each written the same way on both sides:
- GPT (coshard's make_gpt, modules/src/models/gpt.cpp): learned token and position embeddings, pre-LN
  blocks (LayerNorm, qkv Linear with bias, causal attention, projection; LayerNorm, fc 4x, GELU
  with GPT-2's tanh approximation, projection), a final LayerNorm and an untied head with bias.
- Llama (coshard's make_llama, modules/src/models/llama.cpp; on the PyTorch side written as torchtitan
  writes it): RMSNorm, rotary positions with Llama 3's frequency scaling, grouped-query attention
  (SDPA), a SwiGLU MLP, no biases, tied embeddings where the shape has them.
Both sides train with bf16 compute over fp32 master weights and AdamW, at world size 1;
--checkpointing recomputes every block on both (coshard's --activation-checkpointing full,
PyTorch's checkpoint_wrapper on each block).

  python3 bench/gpu_vs_fsdp.py --preset llama-3.2-1b --coshard build/release/trainer/coshard-train \
      --out results.json [--compile] [--steps 20] [--checkpointing] [--offload]

Reports tokens/s, MFU (6*N*tokens plus attention's 12*L*T*(heads*head_dim) per token [PaLM's
count], against 989 TFLOP/s bf16 dense: H100 SXM and H200 alike), peak memory for each side
(device_peak_bytes: nvidia-smi's rise over the side's run, context included; allocator_peak_bytes:
live tensors at their peak), and the ratio coshard / PyTorch. Each side runs in a process of its
own, so each starts from a clean device. --cpu runs both at toy size on the CPU (the harness itself,
in CI).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

PRESETS = {
    # name: layers, dim, heads, vocab, seq, batch (sequences per step)
    # 1.5B at batch 4: the tables of docs/performance.md were measured so (8 did not fit 80 GB while
    # coshard's attention kept the T x T probabilities).
    "gpt2-1.5b": (48, 1600, 25, 50257, 1024, 4),
    "gpt2-350m": (24, 1024, 16, 50257, 1024, 8),
    "gpt2-124m": (12, 768, 12, 50257, 1024, 8),
    "toy": (2, 64, 4, 256, 32, 4),
}
# name: coshard's preset (or shape flags), seq, batch; the shape itself as LlamaConfig has it.
LLAMA_PRESETS = {
    "llama-3.2-1b": (["--preset", "Llama-3.2-1B"], 2048, 4,
                     dict(layers=16, dim=2048, heads=32, kv_heads=8, head_dim=64, inter=8192, vocab=128256,
                          theta=500000.0, scaling=(32.0, 1.0, 4.0, 8192), tied=True)),
    # Offloaded at 3B on a 128 GiB host: the 8B's fp32 masters, moments and pinned copies need ~140 GiB
    # of host memory on either side (coshard-train --estimate), more than the lent machines have.
    "llama-3.2-3b": (["--preset", "Llama-3.2-3B"], 2048, 2,
                     dict(layers=28, dim=3072, heads=24, kv_heads=8, head_dim=128, inter=8192, vocab=128256,
                          theta=500000.0, scaling=(32.0, 1.0, 4.0, 8192), tied=True)),
    "llama-3.1-8b": (["--preset", "Llama-3.1-8B"], 2048, 1,
                     dict(layers=32, dim=4096, heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256,
                          theta=500000.0, scaling=(8.0, 1.0, 4.0, 8192), tied=False)),
    "llama-toy": (["--model", "llama", "--layers", "2", "--dim", "64", "--heads", "4", "--kv-heads", "2",
                   "--intermediate", "128", "--vocab", "256", "--rope-theta", "10000", "--tie-embeddings"], 32, 4,
                  dict(layers=2, dim=64, heads=4, kv_heads=2, head_dim=16, inter=128, vocab=256, theta=10000.0,
                       scaling=None, tied=True)),
}
PEAK_TFLOPS = 989.0


def model_flops_per_token(layers, attn_width, seq, params):
    return 6 * params + 12 * layers * seq * attn_width  # dense products plus attention's, unmasked (PaLM's count)


def gpt_params(layers, dim, vocab, seq):
    hidden = 4 * dim
    block = 4 * dim + dim * 3 * dim + 3 * dim + dim * dim + dim + dim * hidden + hidden + hidden * dim + dim
    return vocab * dim + seq * dim + layers * block + 2 * dim + dim * vocab + vocab


def llama_params(c):
    block = 2 * c["dim"] + c["dim"] * (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"] + \
        c["heads"] * c["head_dim"] * c["dim"] + 3 * c["dim"] * c["inter"]
    return c["vocab"] * c["dim"] + c["layers"] * block + c["dim"] + (0 if c["tied"] else c["dim"] * c["vocab"])


def causal_attention(q, k, v):
    """PyTorch's fused attention where it has one (2.0 and later), else the same product written out
    (Debian 12's PyTorch is 1.13)."""
    import math
    import torch
    import torch.nn.functional as F
    if hasattr(F, "scaled_dot_product_attention"):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    t = q.shape[-2]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.shape[-1]))
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
    return torch.softmax(scores.masked_fill(mask, float("-inf")), dim=-1) @ v


def torch_llama(c, seq):
    """The Llama of coshard's make_llama in plain PyTorch, as torchtitan writes it."""
    import math
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    def inv_freq():
        f = 1.0 / (c["theta"] ** (torch.arange(0, c["head_dim"], 2, dtype=torch.float64) / c["head_dim"]))
        if c["scaling"]:
            factor, low, high, old = c["scaling"]
            wavelen = 2 * math.pi / f
            smooth = (old / wavelen - low) / (high - low)
            scaled = torch.where(wavelen > old / low, f / factor, f)
            medium = (wavelen <= old / low) & (wavelen >= old / high)
            f = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
        return f.float()

    class RMSNorm(nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(c["dim"]))

        def forward(self, x):
            y = x.float()
            y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)
            return self.weight * y.type_as(x)

    def rotate(x, cos, sin):
        half = x.shape[-1] // 2
        return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            hd, h, kv = c["head_dim"], c["heads"], c["kv_heads"]
            self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
            self.q = nn.Linear(c["dim"], h * hd, bias=False)
            self.k = nn.Linear(c["dim"], kv * hd, bias=False)
            self.v = nn.Linear(c["dim"], kv * hd, bias=False)
            self.o = nn.Linear(h * hd, c["dim"], bias=False)
            self.gate = nn.Linear(c["dim"], c["inter"], bias=False)
            self.up = nn.Linear(c["dim"], c["inter"], bias=False)
            self.down = nn.Linear(c["inter"], c["dim"], bias=False)

        def forward(self, x, cos, sin):
            b, t, _ = x.shape
            hd, h, kv = c["head_dim"], c["heads"], c["kv_heads"]
            y = self.attn_norm(x)
            q = rotate(self.q(y).view(b, t, h, hd).transpose(1, 2), cos, sin)
            k = rotate(self.k(y).view(b, t, kv, hd).transpose(1, 2), cos, sin)
            v = self.v(y).view(b, t, kv, hd).transpose(1, 2)
            k, v = k.repeat_interleave(h // kv, dim=1), v.repeat_interleave(h // kv, dim=1)
            a = causal_attention(q, k, v)
            x = x + self.o(a.transpose(1, 2).reshape(b, t, h * hd))
            y = self.mlp_norm(x)
            return x + self.down(F.silu(self.gate(y)) * self.up(y))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(c["vocab"], c["dim"])
            self.blocks = nn.ModuleList(Block() for _ in range(c["layers"]))
            self.norm = RMSNorm()
            self.head = nn.Linear(c["dim"], c["vocab"], bias=False)
            if c["tied"]:
                self.head.weight = self.embed.weight
            freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq())
            emb = torch.cat((freqs, freqs), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)

        def forward(self, idx):
            x = self.embed(idx)
            cos, sin = self.cos.to(x.dtype), self.sin.to(x.dtype)
            for blk in self.blocks:
                x = blk(x, cos, sin)
            return self.head(self.norm(x))

    return Llama()


def run_torch(args, layers, dim, heads, vocab, seq, batch, compiled, llama=None):
    import torch
    import torch.distributed as dist
    import torch.nn as nn
    import torch.nn.functional as F
    try:  # torch 2.6 and later
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    except ImportError:  # FSDP2 before it moved (torch 2.4 and 2.5)
        from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    device = torch.device("cpu" if args.cpu else "cuda")
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("gloo" if args.cpu else "nccl", rank=0, world_size=1)

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1 = nn.LayerNorm(dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.ln2 = nn.LayerNorm(dim)
            self.fc = nn.Linear(dim, 4 * dim)
            self.out = nn.Linear(4 * dim, dim)

        def forward(self, x):
            b, t, c = x.shape
            q, k, v = self.qkv(self.ln1(x)).split(c, dim=2)
            q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in (q, k, v))
            y = causal_attention(q, k, v)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
            return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))

    class Gpt(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte = nn.Embedding(vocab, dim)
            self.wpe = nn.Embedding(seq, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(layers))
            self.ln_f = nn.LayerNorm(dim)
            self.head = nn.Linear(dim, vocab)

        def forward(self, idx):
            x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln_f(x))

    torch.manual_seed(1)
    model = (torch_llama(llama, seq) if llama else Gpt()).to(device)
    params = sum(p.numel() for p in model.parameters())
    if args.checkpointing:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        for i, blk in enumerate(model.blocks):
            model.blocks[i] = checkpoint_wrapper(blk)
    mp = MixedPrecisionPolicy(param_dtype=torch.float32 if args.cpu else torch.bfloat16, reduce_dtype=torch.float32)
    offload = CPUOffloadPolicy() if args.offload else OffloadPolicy()
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp, offload_policy=offload)
    fully_shard(model, mp_policy=mp, offload_policy=offload)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01)
    forward = torch.compile(model) if compiled else model
    idx = torch.randint(0, vocab, (batch, seq), device=device)
    tgt = torch.roll(idx, -1, 1)

    def step():
        logits = forward(idx)
        loss = F.cross_entropy(logits.float().view(-1, vocab), tgt.view(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for _ in range(args.warmup):
        step()
    if not args.cpu:
        torch.cuda.synchronize()
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        if not args.cpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    # live tensors at their peak, as coshard's allocator counts its peak_in_use (the whole run)
    peak = 0 if args.cpu else torch.cuda.max_memory_allocated()
    med = statistics.median(times)
    return {"params": params, "step_s": med, "tokens_per_s": batch * seq / med, "allocator_peak_bytes": peak}


def nvidia_smi(field):
    """The first GPU's `field` as nvidia-smi reports it (no header or units), or None where it
    cannot. The script asks nvidia-smi, not torch, so that it holds no CUDA context itself."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10).stdout.strip()
        return out.splitlines()[0] if out else None
    except (OSError, subprocess.SubprocessError):
        return None


def device_memory_used():
    """The device's used memory in bytes (None where nvidia-smi cannot say)."""
    used = nvidia_smi("memory.used")
    return int(used) * 1024 * 1024 if used and used.isdigit() else None


class DeviceMemoryPoller:
    """How far the device's used memory rose above where it stood before, while a child process
    runs (its CUDA context, workspaces and allocator pools included: each side runs in a process of
    its own, so both are counted alike)."""

    def __init__(self, enabled):
        self.peak = 0
        self.enabled = enabled
        self._base = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self):
        while not self._stop.is_set():
            used = device_memory_used()
            if used is None:
                return
            self.peak = max(self.peak, used - self._base)
            self._stop.wait(0.25)

    def __enter__(self):
        if self.enabled:
            self._base = device_memory_used() or 0
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self.enabled:
            self._thread.join()


def run_coshard(args, layers, dim, heads, vocab, seq, batch, model_flags=None):
    metrics = os.path.abspath(args.workdir + "/coshard_metrics.jsonl")
    steps = args.warmup + args.steps
    shape = model_flags or ["--layers", str(layers), "--dim", str(dim), "--heads", str(heads), "--vocab", str(vocab)]
    cmd = [args.coshard, "--device", "cpu" if args.cpu else "cuda", "--world-size", "1", "--steps", str(steps)] + \
        shape + ["--seq", str(seq), "--batch", str(batch), "--lr", "3e-4", "--clip", "1", "--zero-stage",
                 str(args.zero_stage), "--metrics", metrics, "--quiet"] + (["--dtype", "bf16"] if not args.cpu else [])
    if args.checkpointing:
        cmd += ["--activation-checkpointing", "full"]
    if args.offload:
        cmd += ["--offload-optimizer", "cpu", "--offload-params", "cpu"]
    cmd += args.coshard_args
    if os.path.exists(metrics):
        os.remove(metrics)
    with DeviceMemoryPoller(not args.cpu) as poller:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"error": f"coshard-train exited {proc.returncode}: {proc.stderr.strip()[-2000:]}", "cmd": cmd}
    with open(metrics) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steady = rows[args.warmup:]
    med = statistics.median(r["step_ms"] for r in steady) / 1e3
    return {"step_s": med, "tokens_per_s": batch * seq / med, "device_peak_bytes": poller.peak,
            "allocator_peak_bytes": max(r["peak_memory_bytes"] for r in rows),
            "blocking_waits": max(r["blocking_waits"] for r in steady),
            "exposed_comm_ms": statistics.median(r["exposed_comm_ms"] or 0 for r in steady), "cmd": " ".join(cmd)}


TORCH_RESULT = "TORCH_RESULT "


def run_torch_process(args, side):
    """One PyTorch side in a process of its own (`--torch-side`), so that each side starts from a
    clean device: no CUDA context, caching-allocator pool or compile cache left by the one before,
    and the device peak counts each side's own context, as coshard's does."""
    cmd = [sys.executable, os.path.abspath(__file__), "--torch-side", side] + sys.argv[1:]
    with DeviceMemoryPoller(not args.cpu) as poller:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(TORCH_RESULT)]
    if proc.returncode != 0 or not lines:
        return {"error": f"the {side} side exited {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    r = json.loads(lines[-1][len(TORCH_RESULT):])
    if "error" not in r:
        r["device_peak_bytes"] = poller.peak
    return r


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt2-1.5b", choices=sorted(PRESETS) + sorted(LLAMA_PRESETS))
    p.add_argument("--seq", type=int, help="tokens per sequence (default: the preset's)")
    p.add_argument("--checkpointing", action="store_true", help="recompute every block in backward, both sides")
    p.add_argument("--batch", type=int, help="sequences per step (default: the preset's)")
    p.add_argument("--coshard", default="build/release/trainer/coshard-train")
    p.add_argument("--coshard-args", nargs=argparse.REMAINDER, default=[], help="passed on to coshard-train")
    p.add_argument("--zero-stage", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true", help="also PyTorch with torch.compile")
    p.add_argument("--offload", action="store_true",
                   help="parameters and optimizer in pinned host memory: FSDP2's CPUOffloadPolicy, coshard's "
                        "--offload-optimizer cpu --offload-params cpu")
    p.add_argument("--skip-torch", action="store_true")
    p.add_argument("--cpu", action="store_true", help="both on the CPU (toy sizes: checks the harness)")
    p.add_argument("--workdir", default=".")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--torch-side", choices=["eager", "compile"], help=argparse.SUPPRESS)  # run_torch_process's child
    args = p.parse_args()
    llama = None
    model_flags = None
    if args.preset in LLAMA_PRESETS:
        model_flags, seq, batch, llama = LLAMA_PRESETS[args.preset]
        layers, dim, heads, vocab = llama["layers"], llama["dim"], llama["heads"], llama["vocab"]
        seq = args.seq or seq
        params = llama_params(llama)
        attn_width = llama["heads"] * llama["head_dim"]
    else:
        layers, dim, heads, vocab, seq, batch = PRESETS[args.preset]
        seq = args.seq or seq
        params = gpt_params(layers, dim, vocab, seq)
        attn_width = dim
    batch = args.batch or batch
    flops_per_token = model_flops_per_token(layers, attn_width, seq, params)
    results = {"preset": args.preset, "offload": args.offload, "checkpointing": args.checkpointing, "layers": layers,
               "dim": dim, "heads": heads, "vocab": vocab, "seq": seq, "batch": batch, "params": params,
               "flops_per_token": flops_per_token, "runs": {}}
    if args.torch_side:
        try:
            r = run_torch(args, layers, dim, heads, vocab, seq, batch, args.torch_side == "compile", llama)
        except Exception as e:  # noqa: BLE001 - reported to the parent as this side's result
            r = {"error": f"{type(e).__name__}: {e}"}
        print(TORCH_RESULT + json.dumps(r), flush=True)
        return 0
    if not args.cpu:
        results["device"] = nvidia_smi("name") or "unknown"
    sides = [("coshard", lambda: run_coshard(args, layers, dim, heads, vocab, seq, batch, model_flags))]
    if not args.skip_torch:
        sides.append(("fsdp2_eager", lambda: run_torch_process(args, "eager")))
        if args.compile:
            sides.append(("fsdp2_compile", lambda: run_torch_process(args, "compile")))
    for name, run in sides:
        try:
            r = run()
        except Exception as e:  # noqa: BLE001 - a side that fails is reported, the others still run
            r = {"error": f"{type(e).__name__}: {e}"}
        if "tokens_per_s" in r:
            r["mfu"] = r["tokens_per_s"] * flops_per_token / (PEAK_TFLOPS * 1e12)
        results["runs"][name] = r
        print(name, json.dumps({k: v for k, v in r.items() if k != "cmd"}), flush=True)
    base = results["runs"].get("fsdp2_eager", {})
    ours = results["runs"]["coshard"]
    if "tokens_per_s" in base and "tokens_per_s" in ours:
        results["coshard_over_fsdp2_eager"] = ours["tokens_per_s"] / base["tokens_per_s"]
        print(f"coshard / FSDP2 eager tokens/s: {results['coshard_over_fsdp2_eager']:.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if "error" not in ours else 1


if __name__ == "__main__":
    sys.exit(main())
