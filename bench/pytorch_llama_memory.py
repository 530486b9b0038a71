#!/usr/bin/env python3
"""PyTorch on the same model and machine as bench/out_of_core.py: a Llama preset trained resident
(fp32 parameters, gradients and AdamW state in memory, as plain PyTorch on a CPU does), a few
steps, its peak resident memory and step time; or, when the machine cannot hold it, the error it
stops with. The process runs under an address-space limit of the memory this machine has
available (RLIMIT_AS), so a model that does not fit fails with PyTorch's own allocation error
instead of waking the kernel's OOM killer (--address-space-gib 0 lifts the limit: then a model
that does not fit is killed by it, exit status 137).

  /usr/bin/python3 bench/pytorch_llama_memory.py [--preset Llama-3.2-1B] [--seq 256] [--steps 3] [--out F]

The model is written here in plain torch (token embedding tied to the head, RMSNorm, grouped-query
attention with rotary positions, SwiGLU MLP: the Llama-3.2 shapes coshard's presets use), so that
no transformers install is needed; Debian 12 packages PyTorch 1.13 (`apt-get install python3-torch`).
"""
import argparse
import json
import math
import os
import resource
import sys
import time

PRESETS = {  # vocabulary, dim, layers, heads, key/value heads, MLP width (tied embeddings)
    "Llama-3.2-1B": (128256, 2048, 16, 32, 8, 8192),
    "Llama-3.2-3B": (128256, 3072, 28, 24, 8, 8192),
}


def available_bytes():
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields["MemAvailable"].split()[0]) * 1024


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="Llama-3.2-1B", choices=sorted(PRESETS))
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--address-space-gib", type=float,
                   help="RLIMIT_AS in GiB (default: the memory available now; 0: no limit, the kernel's OOM killer decides)")
    p.add_argument("--out")
    a = p.parse_args()
    vocab, dim, layers, heads, kv_heads, mlp = PRESETS[a.preset]
    head = dim // heads
    params = vocab * dim + layers * (2 * dim + dim * head * (heads + 2 * kv_heads) + heads * head * dim + 3 * dim * mlp) + dim
    limit = available_bytes() if a.address_space_gib is None else int(a.address_space_gib * (1 << 30))
    if limit:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    result = {"preset": a.preset, "parameters": params, "seq": a.seq, "address_space_limit_bytes": limit,
              "resident_adamw_bytes": 16 * params, "runs": False}
    try:
        import torch
        import torch.nn as nn
        import torch.nn.functional as F
        result["torch"] = torch.__version__
        torch.set_num_threads(a.threads)
        torch.manual_seed(0)

        class RMSNorm(nn.Module):
            def __init__(self):
                super().__init__()
                self.weight = nn.Parameter(torch.ones(dim))

            def forward(self, x):
                return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight

        class Block(nn.Module):
            def __init__(self):
                super().__init__()
                self.attn_norm, self.mlp_norm = RMSNorm(), RMSNorm()
                self.q = nn.Linear(dim, heads * head, bias=False)
                self.k = nn.Linear(dim, kv_heads * head, bias=False)
                self.v = nn.Linear(dim, kv_heads * head, bias=False)
                self.o = nn.Linear(heads * head, dim, bias=False)
                self.gate = nn.Linear(dim, mlp, bias=False)
                self.up = nn.Linear(dim, mlp, bias=False)
                self.down = nn.Linear(mlp, dim, bias=False)

            def forward(self, x, cos, sin, mask):
                b, t, _ = x.shape
                h = self.attn_norm(x)
                q = self.q(h).view(b, t, heads, head).transpose(1, 2)
                k = self.k(h).view(b, t, kv_heads, head).transpose(1, 2)
                v = self.v(h).view(b, t, kv_heads, head).transpose(1, 2)

                def rope(z):
                    z1, z2 = z[..., : head // 2], z[..., head // 2:]
                    return torch.cat([z1 * cos - z2 * sin, z2 * cos + z1 * sin], dim=-1)

                q, k = rope(q), rope(k)
                k = k.repeat_interleave(heads // kv_heads, dim=1)
                v = v.repeat_interleave(heads // kv_heads, dim=1)
                att = (q @ k.transpose(-1, -2)) / math.sqrt(head) + mask
                y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, dim)
                x = x + self.o(y)
                h = self.mlp_norm(x)
                return x + self.down(F.silu(self.gate(h)) * self.up(h))

        class Llama(nn.Module):
            def __init__(self):
                super().__init__()
                self.embed = nn.Embedding(vocab, dim)
                nn.init.normal_(self.embed.weight, std=0.02)  # (Llama's initializer_range)
                self.blocks = nn.ModuleList(Block() for _ in range(layers))
                self.norm = RMSNorm()

            def forward(self, tokens):
                t = tokens.shape[1]
                inv = 1.0 / (500000.0 ** (torch.arange(0, head, 2, dtype=torch.float32) / head))
                angles = torch.outer(torch.arange(t, dtype=torch.float32), inv)
                cos, sin = angles.cos(), angles.sin()
                mask = torch.full((t, t), float("-inf")).triu(1)
                x = self.embed(tokens)
                for blk in self.blocks:
                    x = blk(x, cos, sin, mask)
                return self.norm(x) @ self.embed.weight.t()  # the tied head

        t0 = time.time()
        model = Llama()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
        result["built_s"] = time.time() - t0
        result["counted_parameters"] = sum(p.numel() for p in model.parameters())
        gen = torch.Generator().manual_seed(1)
        steps = []
        for step in range(a.steps):
            tokens = torch.randint(0, vocab, (1, a.seq + 1), generator=gen)
            t0 = time.time()
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.view(-1, vocab), tokens[:, 1:].reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            steps.append({"step": step + 1, "loss": loss.item(), "step_s": time.time() - t0})
            print(f"step {step + 1}: loss {loss.item():.4f}, {steps[-1]['step_s']:.1f} s", file=sys.stderr, flush=True)
        result["steps"] = steps
        result["runs"] = True
    except (RuntimeError, MemoryError) as e:  # PyTorch's allocation failure under the limit
        result["error"] = str(e).splitlines()[0][:300]
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
