#!/usr/bin/env python3
"""bf16 training on the CPU, coshard against PyTorch, in one run (#64):

  python3 bench/cpu_bf16.py --coshard build/release/trainer/coshard-train \
      --rates build/release/bench/cpu_product_rates [--folder LLAMA_FOLDER] [--steps 8] [--warmup 2]

One Hugging Face Llama folder (--folder; else one coshard-train exports, of the shape below: dim
512, 8 layers, grouped-query 8/2, MLP 1536, vocabulary 32000, sequence 256, batch 8), trained by:
  torch f32        PyTorch, f32, one process with every core (where Python has torch)
  torch autocast   PyTorch, torch.autocast("cpu", dtype=torch.bfloat16): f32 weights, bf16 products
  coshard f32      coshard-train --init FOLDER, 1 rank, then 2 ranks (threads of one process)
  coshard bf16     the same with --dtype bf16 (native products where the CPU has the instructions)
each a step of AdamW over random tokens, the median step after --warmup. It prints each mode's step
time, its ratio to PyTorch's autocast (higher is faster), and its fraction of this machine's product
rate: the step's product work (6 x the multiplying parameters x tokens, the input embedding and
the norms not counted, plus attention's 12 x layers x sequence x width a token) over the step
time, against the rate of the same dtype's products at the step's shapes (cpu_product_rates: f32
through OpenBLAS, bf16 through oneDNN; every core). --json writes it all. PyTorch 1.13 (Debian
12's python3-torch, run by /usr/bin/python3) has no fused attention: its causal attention is then
written out (bench/gpu_vs_fsdp.py's causal_attention).
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_vs_fsdp import model_flops_per_token, torch_llama  # noqa: E402

SHAPE = {"--layers": 8, "--dim": 512, "--heads": 8, "--kv-heads": 2, "--intermediate": 1536, "--vocab": 32000}
SEQ, BATCH = 256, 8


def product_params(c):
    """The parameters that multiply: every linear layer and the output layer (the input embedding is a
    lookup, the norms element-wise), as bench/cpu_step_profile.py counts them."""
    hd = c["head_dim"]
    block = c["dim"] * (c["heads"] + 2 * c["kv_heads"]) * hd + c["heads"] * hd * c["dim"] + 3 * c["dim"] * c["inter"]
    return c["layers"] * block + c["dim"] * c["vocab"]


def export_folder(a, path):
    args = [a.coshard, "--model", "llama"]
    for flag, value in SHAPE.items():
        args += [flag, str(value)]
    args += ["--seq", str(SEQ), "--batch", "1", "--world-size", "1", "--steps", "1", "--freeze", "*",
             "--export", path, "--quiet"]
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"exporting the Llama folder failed: {' '.join(args)}\n{done.stdout}")


def llama_config(folder):
    with open(os.path.join(folder, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    return dict(layers=c["num_hidden_layers"], dim=c["hidden_size"], heads=heads,
                kv_heads=c.get("num_key_value_heads", heads), head_dim=c.get("head_dim", c["hidden_size"] // heads),
                inter=c["intermediate_size"], vocab=c["vocab_size"], theta=float(c.get("rope_theta", 10000.0)),
                scaling=None, tied=bool(c.get("tie_word_embeddings", False)))


def run_coshard(a, folder, dtype, ranks, metrics):
    args = [a.coshard, "--init", folder, "--seq", str(SEQ), "--batch", str(BATCH), "--steps", str(a.steps),
            "--world-size", str(ranks), "--zero-stage", "3" if ranks > 1 else "0", "--dtype", dtype,
            "--metrics", metrics]
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"coshard-train failed: {' '.join(args)}\n{done.stdout}")
    products = re.search(r"matrix products: (.*)", done.stdout)
    with open(metrics) as f:
        steps = [json.loads(line)["step_ms"] / 1000.0 for line in f]
    return statistics.median(steps[a.warmup:]), products.group(1) if products else "?"


def safetensors_tensors(folder):
    """The folder's tensors as torch tensors (f32), read without the safetensors package."""
    import torch
    names = [n for n in os.listdir(folder) if n.endswith(".safetensors")]
    dtypes = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}
    out = {}
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            data = f.read()
        size = int.from_bytes(data[:8], "little")
        header = json.loads(data[8:8 + size])
        base = 8 + size
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, end = info["data_offsets"]
            t = torch.frombuffer(bytearray(data[base + begin:base + end]), dtype=dtypes[info["dtype"]])
            out[key] = t.reshape(info["shape"]).float()
    return out


def load_into(model, c, tensors):
    import torch
    names = {"embed.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight"}
    if not c["tied"]:
        names["head.weight"] = "lm_head.weight"
    parts = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
             "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
             "up": "mlp.up_proj", "down": "mlp.down_proj"}
    for i in range(c["layers"]):
        for ours, theirs in parts.items():
            names[f"blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
    state = model.state_dict()
    with torch.no_grad():
        for ours, theirs in names.items():
            state[ours].copy_(tensors[theirs])


def run_torch(a, folder, c, autocast):
    import torch
    import torch.nn.functional as F
    torch.manual_seed(0)
    torch.set_num_threads(os.cpu_count())
    model = torch_llama(c, SEQ)
    load_into(model, c, safetensors_tensors(folder))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx = torch.randint(0, c["vocab"], (BATCH, SEQ + 1))
    times = []
    for _ in range(a.steps):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, c["vocab"]), idx[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return statistics.median(times[a.warmup:])


def product_rates(a, c):
    """Each dtype's GFLOP/s at the step's linear shapes, weighted by each shape's share of the work."""
    tokens = SEQ * BATCH
    qkv = (c["heads"] + 2 * c["kv_heads"]) * c["head_dim"]
    shapes = [(tokens, qkv, c["dim"]), (tokens, c["dim"], c["heads"] * c["head_dim"]),
              (tokens, c["inter"], c["dim"]), (tokens, c["dim"], c["inter"]), (tokens, c["vocab"], c["dim"])]
    args = [a.rates, "--threads", str(os.cpu_count()), "--seconds", str(a.rate_seconds)]
    for s in shapes:
        args += [str(v) for v in s]
    done = subprocess.run(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"cpu_product_rates failed: {' '.join(args)}\n{done.stdout}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    rates = {}
    for dtype in ("f32", "bf16"):
        mine = [r for r in rows if r["dtype"] == dtype]
        work = [r["m"] * r["n"] * r["k"] for r in mine]
        seconds = sum(w / r["gflops"] for w, r in zip(work, mine))
        rates[dtype] = {"gflops": sum(work) / seconds, "kernels": mine[0]["kernels"], "shapes": mine}
    return rates


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--coshard", required=True)
    p.add_argument("--rates", required=True, help="the cpu_product_rates program (build/.../bench/)")
    p.add_argument("--folder", default="", help="a Hugging Face Llama folder (default: one exported of the shape above)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--rate-seconds", type=int, default=2)
    p.add_argument("--ranks", default="1,2")
    p.add_argument("--json", default="")
    a = p.parse_args()
    if a.steps <= a.warmup:
        sys.exit(f"--steps {a.steps}: expected more than --warmup ({a.warmup})")
    try:
        import torch  # noqa: F401
        have_torch = True
    except ImportError:
        have_torch = False
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.folder
        if not folder:
            folder = os.path.join(tmp, "llama")
            export_folder(a, folder)
        c = llama_config(folder)
        rates = product_rates(a, c)
        results = []
        if have_torch:
            results.append({"mode": "torch f32", "dtype": "f32", "step_s": run_torch(a, folder, c, False),
                            "products": f"torch {torch.__version__}"})
            results.append({"mode": "torch autocast bf16", "dtype": "bf16", "step_s": run_torch(a, folder, c, True),
                            "products": f"torch {torch.__version__}"})
        for ranks in (int(r) for r in a.ranks.split(",")):
            for dtype in ("f32", "bf16"):
                step, products = run_coshard(a, folder, dtype, ranks, os.path.join(tmp, "m.jsonl"))
                results.append({"mode": f"coshard {dtype}, {ranks} rank(s)", "dtype": dtype, "step_s": step,
                                "products": products})
    flops = model_flops_per_token(c["layers"], c["heads"] * c["head_dim"], SEQ, product_params(c)) * SEQ * BATCH
    autocast = next((r["step_s"] for r in results if r["mode"] == "torch autocast bf16"), None)
    print(f"machine: {os.cpu_count()} cores; Llama dim {c['dim']}, {c['layers']} layers, heads {c['heads']}/"
          f"{c['kv_heads']}, MLP {c['inter']}, vocabulary {c['vocab']}; sequence {SEQ}, batch {BATCH}; "
          f"{a.steps - a.warmup} steps after {a.warmup}")
    for dtype, r in rates.items():
        print(f"product rate {dtype}: {r['gflops']:.1f} GFLOP/s ({r['kernels']})")
    if not have_torch:
        print("torch: not installed for this Python; the PyTorch rows are left out")
    print(f"{'mode':28s} {'ms/step':>9s} {'x autocast':>10s} {'of rate':>8s}  products")
    for r in results:
        r["fraction_of_rate"] = flops / r["step_s"] / 1e9 / rates[r["dtype"]]["gflops"]
        ratio = f"{autocast / r['step_s']:10.2f}" if autocast else f"{'-':>10s}"
        print(f"{r['mode']:28s} {1000 * r['step_s']:9.1f} {ratio} {100 * r['fraction_of_rate']:7.0f}%  {r['products']}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"config": c, "seq": SEQ, "batch": BATCH, "flops_per_step": flops, "rates": rates,
                       "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
