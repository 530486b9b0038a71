#!/usr/bin/env python3
"""A Hugging Face Llama folder written here, independently of coshard (sharded safetensors with
their index, BF16 matrices beside F32 norms, config.json with Llama 3's rope scaling, grouped-query
heads, tied embeddings), loads into coshard-train --init; coshard's first loss on one sequence
equals the loss of a plain-Python forward written from transformers' LlamaForCausalLM
(modeling_llama.py: RMSNorm in float, rotate_half rotary with the llama3 frequency scaling,
repeat_kv, SwiGLU, causal softmax attention, the tied head); and coshard's --export of it holds
the same tensors (converted to F32) under the same names.

Pure Python (no numpy, no torch): it runs everywhere CI does.
usage: hf_reference_test.py COSHARD_TRAIN SCRATCH_DIR
"""
import json
import math
import pathlib
import random
import shutil
import struct
import subprocess
import sys

binary, scratch = sys.argv[1], pathlib.Path(sys.argv[2])
shutil.rmtree(scratch, ignore_errors=True)
folder = scratch / "llama"
folder.mkdir(parents=True)

V, D, L, H, K, HD, I, SEQ = 48, 32, 2, 4, 2, 8, 40, 12
EPS, THETA = 1e-5, 10000.0
SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8}
rng = random.Random(7)


def bf16(x):
    """x rounded to bfloat16 (nearest even), as a float; and its two bytes."""
    bits = struct.unpack("<I", struct.pack("<f", x))[0]
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0], struct.pack("<H", bits)


def f32(x):
    v = struct.unpack("<f", struct.pack("<f", x))[0]
    return v, struct.pack("<f", v)


def matrix(rows, cols, std, kind):
    """Row-major values and bytes in `kind` (bf16 or f32)."""
    conv = bf16 if kind == "BF16" else f32
    vals, raw = [], b""
    for _ in range(rows * cols):
        v, b = conv(rng.gauss(0.0, std))
        vals.append(v)
        raw += b
    return [vals[r * cols:(r + 1) * cols] for r in range(rows)], raw


tensors = {}  # name -> (dtype, shape, bytes)
weights = {}  # name -> rows (lists) or a vector


def add(name, rows, cols, std, kind):
    m, raw = matrix(rows, cols, std, kind)
    tensors[name] = (kind, [rows, cols], raw)
    weights[name] = m


def add_norm(name):
    vals, raw = [], b""
    for _ in range(D):
        v, b = f32(rng.uniform(0.5, 1.5))
        vals.append(v)
        raw += b
    tensors[name] = ("F32", [D], raw)
    weights[name] = vals


add("model.embed_tokens.weight", V, D, 0.5, "F32")
for l in range(L):
    p = f"model.layers.{l}."
    add_norm(p + "input_layernorm.weight")
    add(p + "self_attn.q_proj.weight", H * HD, D, 0.2, "BF16")
    add(p + "self_attn.k_proj.weight", K * HD, D, 0.2, "BF16")
    add(p + "self_attn.v_proj.weight", K * HD, D, 0.2, "BF16")
    add(p + "self_attn.o_proj.weight", D, H * HD, 0.2, "BF16")
    add_norm(p + "post_attention_layernorm.weight")
    add(p + "mlp.gate_proj.weight", I, D, 0.2, "BF16")
    add(p + "mlp.up_proj.weight", I, D, 0.2, "BF16")
    add(p + "mlp.down_proj.weight", D, I, 0.2, "BF16")
add_norm("model.norm.weight")


def write_safetensors(path, names):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for n in names:
        kind, shape, raw = tensors[n]
        header[n] = {"dtype": kind, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


# Three shards in transformers' style, each tensor in one of them, and the index.
names = list(tensors)
shards = [names[:5], names[5:13], names[13:]]
weight_map = {}
for i, part in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(folder / file, part)
    weight_map.update({n: file for n in part})
(folder / "model.safetensors.index.json").write_text(json.dumps(
    {"metadata": {"total_size": sum(len(t[2]) for t in tensors.values())}, "weight_map": weight_map}))
(folder / "config.json").write_text(json.dumps({
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": V, "hidden_size": D,
    "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": K,
    "head_dim": HD, "max_position_embeddings": 64, "rms_norm_eps": EPS, "rope_theta": THETA,
    "rope_scaling": SCALING, "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
    "hidden_act": "silu", "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}))

# ---- transformers' forward, in plain Python ----


def matvec(m, x):
    return [sum(a * b for a, b in zip(row, x)) for row in m]


def rms_norm(x, w):
    inv = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + EPS)
    return [w[i] * x[i] * inv for i in range(len(x))]


def inv_freq():
    base = [1.0 / THETA ** (i / HD) for i in range(0, HD, 2)]
    old = SCALING["original_max_position_embeddings"]
    low_wl, high_wl = old / SCALING["low_freq_factor"], old / SCALING["high_freq_factor"]
    out = []
    for f in base:
        wl = 2 * math.pi / f
        scaled = f / SCALING["factor"] if wl > low_wl else f
        if not wl < high_wl and not wl > low_wl:  # the medium band: blended
            smooth = (old / wl - SCALING["low_freq_factor"]) / (SCALING["high_freq_factor"] - SCALING["low_freq_factor"])
            scaled = (1 - smooth) * scaled / SCALING["factor"] + smooth * scaled
        out.append(scaled)
    return out


FREQ = inv_freq()


def rope(x, pos):  # one head: x * cos + rotate_half(x) * sin, emb = cat(freqs, freqs)
    half = HD // 2
    out = []
    for i in range(HD):
        angle = pos * FREQ[i % half]
        rotated = -x[i + half] if i < half else x[i - half]
        out.append(x[i] * math.cos(angle) + rotated * math.sin(angle))
    return out


def forward_loss(ids):
    W = weights
    hs = [list(W["model.embed_tokens.weight"][t]) for t in ids[:-1]]
    T = len(hs)
    for l in range(L):
        p = f"model.layers.{l}."
        normed = [rms_norm(h, W[p + "input_layernorm.weight"]) for h in hs]
        q = [matvec(W[p + "self_attn.q_proj.weight"], x) for x in normed]
        k = [matvec(W[p + "self_attn.k_proj.weight"], x) for x in normed]
        v = [matvec(W[p + "self_attn.v_proj.weight"], x) for x in normed]
        attn = [[0.0] * (H * HD) for _ in range(T)]
        for h in range(H):
            g = h // (H // K)  # repeat_kv
            qs = [rope(q[t][h * HD:(h + 1) * HD], t) for t in range(T)]
            ks = [rope(k[t][g * HD:(g + 1) * HD], t) for t in range(T)]
            vs = [v[t][g * HD:(g + 1) * HD] for t in range(T)]
            for t in range(T):
                scores = [sum(a * b for a, b in zip(qs[t], ks[s])) / math.sqrt(HD) for s in range(t + 1)]
                top = max(scores)
                e = [math.exp(sc - top) for sc in scores]
                z = sum(e)
                for d in range(HD):
                    attn[t][h * HD + d] = sum(e[s] / z * vs[s][d] for s in range(t + 1))
        hs = [[a + b for a, b in zip(hs[t], matvec(W[p + "self_attn.o_proj.weight"], attn[t]))] for t in range(T)]
        normed = [rms_norm(h, W[p + "post_attention_layernorm.weight"]) for h in hs]
        for t in range(T):
            gate = matvec(W[p + "mlp.gate_proj.weight"], normed[t])
            up = matvec(W[p + "mlp.up_proj.weight"], normed[t])
            act = [gv / (1 + math.exp(-gv)) * uv for gv, uv in zip(gate, up)]
            hs[t] = [a + b for a, b in zip(hs[t], matvec(W[p + "mlp.down_proj.weight"], act))]
    total = 0.0
    for t in range(T):
        logits = matvec(W["model.embed_tokens.weight"], rms_norm(hs[t], W["model.norm.weight"]))  # tied head
        top = max(logits)
        total += top + math.log(sum(math.exp(x - top) for x in logits)) - logits[ids[t + 1]]
    return total / T


ids = [rng.randrange(V) for _ in range(SEQ + 1)]
(scratch / "tokens.bin").write_bytes(struct.pack(f"<{SEQ + 1}I", *ids))
expected = forward_loss(ids)

metrics, exported = scratch / "m.jsonl", scratch / "exported"
run = subprocess.run([binary, "--init", str(folder), "--data", str(scratch / "tokens.bin"), "--data-format", "u32",
                      "--seq", str(SEQ), "--batch", "2", "--world-size", "2", "--steps", "1", "--lr", "1e-30",
                      "--weight-decay", "0", "--metrics", str(metrics), "--export", str(exported), "--quiet"],
                     capture_output=True, text=True, timeout=300)
assert run.returncode == 0, run.stdout + run.stderr
loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
assert abs(loss - expected) <= 2e-6 * abs(expected), f"coshard's loss {loss!r}, transformers' forward {expected!r}"


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        b, e = t["data_offsets"]
        data = raw[8 + n + b:8 + n + e]
        count = len(data) // (4 if t["dtype"] == "F32" else 2)
        if t["dtype"] == "F32":
            out[name] = list(struct.unpack(f"<{count}f", data))
        else:  # BF16
            out[name] = [struct.unpack("<f", struct.pack("<I", h << 16))[0] for h in struct.unpack(f"<{count}H", data)]
    return out


config = json.loads((exported / "config.json").read_text())
for key, value in [("num_key_value_heads", K), ("tie_word_embeddings", True), ("rope_theta", THETA),
                   ("head_dim", HD), ("intermediate_size", I)]:
    assert config[key] == value, (key, config[key])
assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_scaling"]["factor"] == 8.0, config["rope_scaling"]
back = read_safetensors(exported / "model.safetensors")
assert set(back) == set(tensors), set(back) ^ set(tensors)
for name in tensors:
    rows = weights[name]
    flat = [x for r in rows for x in r] if isinstance(rows[0], list) else rows
    assert back[name] == flat, f"{name} changed through coshard"
print(f"loss {loss:.7f} against transformers' forward {expected:.7f}; {len(tensors)} tensors round-tripped")
