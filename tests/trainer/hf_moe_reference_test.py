#!/usr/bin/env python3
"""A Hugging Face Mixtral folder written here, independently of coshard (MixtralForCausalLM's
config.json with output_router_logits and router_aux_loss_coef, block_sparse_moe.gate and
experts.E.w1/w2/w3 tensors, sharded with their index), trained one step by coshard-train --init
with plain SGD at lr 1 (so the exported weights give the gradient: w0 - w1); checked against a
plain-Python forward written from transformers' modeling_mixtral.py (4.x):

- MixtralSparseMoeBlock: router logits, softmax in float, top-2, divided by their sum, cast back,
  each chosen expert's w2(silu(w1 x) * w3 x) times its weight, summed in expert order;
- load_balancing_loss_func: every layer's router logits concatenated, softmax, top-k one-hot,
  tokens_per_expert = mean over rows, router_prob_per_expert = mean over rows,
  loss = sum(tokens_per_expert * router_prob_per_expert) * num_experts; the model's loss is the
  cross-entropy + router_aux_loss_coef * it.

Must match: coshard's first loss (one rank, and two ranks each its own copy of the sequence, the
mean of the ranks' losses); the gradient along random directions of every kind of tensor (the
routers' carry the load-balancing loss's term and the renormalisation's) against central
differences of the Python loss; an export after a step at lr 1e-30 holds the folder's tensors under the same names
and a Mixtral config.

Pure Python (no numpy, no torch): it runs everywhere CI does.
usage: hf_moe_reference_test.py COSHARD_TRAIN SCRATCH_DIR
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
folder = scratch / "mixtral"
folder.mkdir(parents=True)

V, D, L, H, K, HD, I, E, TOP, SEQ = 32, 16, 2, 4, 2, 4, 12, 4, 2, 6
EPS, THETA, COEF = 1e-5, 1000000.0, 0.3
rng = random.Random(11)

tensors = {}  # name -> (shape, values)


def add(name, shape, std):
    n = shape[0] * (shape[1] if len(shape) > 1 else 1)
    vals = [struct.unpack("<f", struct.pack("<f", rng.gauss(0.0, std)))[0] for _ in range(n)]
    tensors[name] = (shape, vals)


def add_norm(name):
    vals = [struct.unpack("<f", struct.pack("<f", rng.uniform(0.5, 1.5)))[0] for _ in range(D)]
    tensors[name] = ([D], vals)


add("model.embed_tokens.weight", [V, D], 0.5)
for l in range(L):
    p = f"model.layers.{l}."
    add_norm(p + "input_layernorm.weight")
    add(p + "self_attn.q_proj.weight", [H * HD, D], 0.3)
    add(p + "self_attn.k_proj.weight", [K * HD, D], 0.3)
    add(p + "self_attn.v_proj.weight", [K * HD, D], 0.3)
    add(p + "self_attn.o_proj.weight", [D, H * HD], 0.3)
    add_norm(p + "post_attention_layernorm.weight")
    add(p + "block_sparse_moe.gate.weight", [E, D], 0.5)
    for e in range(E):
        q = p + f"block_sparse_moe.experts.{e}."
        add(q + "w1.weight", [I, D], 0.3)
        add(q + "w3.weight", [I, D], 0.3)
        add(q + "w2.weight", [D, I], 0.3)
add_norm("model.norm.weight")
add("lm_head.weight", [V, D], 0.3)


def write_safetensors(path, names):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for n in names:
        shape, vals = tensors[n]
        raw = struct.pack(f"<{len(vals)}f", *vals)
        header[n] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


names = list(tensors)
shards = [names[:20], names[20:]]
weight_map = {}
for i, part in enumerate(shards):
    file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    write_safetensors(folder / file, part)
    weight_map.update({n: file for n in part})
(folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
(folder / "config.json").write_text(json.dumps({
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "vocab_size": V, "hidden_size": D,
    "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": K,
    "head_dim": HD, "max_position_embeddings": 32, "rms_norm_eps": EPS, "rope_theta": THETA,
    "sliding_window": None, "tie_word_embeddings": False, "hidden_act": "silu", "num_local_experts": E,
    "num_experts_per_tok": TOP, "output_router_logits": True, "router_aux_loss_coef": COEF,
    "router_jitter_noise": 0.0, "attention_dropout": 0.0, "torch_dtype": "float32"}))

# ---- transformers' Mixtral forward and loss, in plain Python ----


def matvec(m, x, rows, cols):
    return [sum(m[r * cols + c] * x[c] for c in range(cols)) for r in range(rows)]


def rms_norm(x, w):
    inv = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + EPS)
    return [w[i] * x[i] * inv for i in range(len(x))]


FREQ = [1.0 / THETA ** (i / HD) for i in range(0, HD, 2)]


def rope(x, pos):  # rotate_half, emb = cat(freqs, freqs)
    half = HD // 2
    return [x[i] * math.cos(pos * FREQ[i % half]) + (-x[i + half] if i < half else x[i - half]) * math.sin(pos * FREQ[i % half])
            for i in range(HD)]


def softmax(xs):
    top = max(xs)
    e = [math.exp(x - top) for x in xs]
    z = sum(e)
    return [v / z for v in e]


def forward_loss(W, ids, margins=None):
    w = lambda n: W[n][1]
    hs = [list(w("model.embed_tokens.weight")[t * D:(t + 1) * D]) for t in ids[:-1]]
    T = len(hs)
    pooled = []  # every layer's router probabilities and choices
    for l in range(L):
        p = f"model.layers.{l}."
        normed = [rms_norm(h, w(p + "input_layernorm.weight")) for h in hs]
        q = [matvec(w(p + "self_attn.q_proj.weight"), x, H * HD, D) for x in normed]
        k = [matvec(w(p + "self_attn.k_proj.weight"), x, K * HD, D) for x in normed]
        v = [matvec(w(p + "self_attn.v_proj.weight"), x, K * HD, D) for x in normed]
        attn = [[0.0] * (H * HD) for _ in range(T)]
        for h in range(H):
            g = h // (H // K)
            qs = [rope(q[t][h * HD:(h + 1) * HD], t) for t in range(T)]
            ks = [rope(k[t][g * HD:(g + 1) * HD], t) for t in range(T)]
            for t in range(T):
                pr = softmax([sum(a * b for a, b in zip(qs[t], ks[s])) / math.sqrt(HD) for s in range(t + 1)])
                for d in range(HD):
                    attn[t][h * HD + d] = sum(pr[s] * v[s][g * HD + d] for s in range(t + 1))
        hs = [[a + b for a, b in zip(hs[t], matvec(w(p + "self_attn.o_proj.weight"), attn[t], D, H * HD))] for t in range(T)]
        normed = [rms_norm(h, w(p + "post_attention_layernorm.weight")) for h in hs]
        for t in range(T):
            probs = softmax(matvec(w(p + "block_sparse_moe.gate.weight"), normed[t], E, D))
            order = sorted(range(E), key=lambda e: (-probs[e], e))
            chosen = sorted(order[:TOP])  # index_add_ adds the experts in ascending order
            if margins is not None:
                margins.append(probs[order[TOP - 1]] - probs[order[TOP]])
            total = sum(probs[e] for e in chosen)
            out = [0.0] * D
            for e in chosen:
                q_ = p + f"block_sparse_moe.experts.{e}."
                gate = matvec(w(q_ + "w1.weight"), normed[t], I, D)
                up = matvec(w(q_ + "w3.weight"), normed[t], I, D)
                act = [a / (1 + math.exp(-a)) * b for a, b in zip(gate, up)]
                y = matvec(w(q_ + "w2.weight"), act, D, I)
                out = [o + probs[e] / total * yv for o, yv in zip(out, y)]
            hs[t] = [a + b for a, b in zip(hs[t], out)]
            pooled.append((probs, order[:TOP]))
    ce = 0.0
    for t in range(T):
        logits = matvec(w("lm_head.weight"), rms_norm(hs[t], w("model.norm.weight")), V, D)
        top = max(logits)
        ce += top + math.log(sum(math.exp(x - top) for x in logits)) - logits[ids[t + 1]]
    ce /= T
    rows = len(pooled)
    tokens_per_expert = [sum(1.0 for _, ch in pooled for c in ch if c == e) / rows for e in range(E)]
    prob_per_expert = [sum(pr[e] for pr, _ in pooled) / rows for e in range(E)]
    aux = E * sum(a * b for a, b in zip(tokens_per_expert, prob_per_expert))
    return ce + COEF * aux


ids = [rng.randrange(V) for _ in range(SEQ + 1)]
(scratch / "tokens.bin").write_bytes(struct.pack(f"<{SEQ + 1}I", *ids))
margins = []
expected = forward_loss(tensors, ids, margins)
assert min(margins) > 1e-3, f"a top-2 choice within {min(margins)} of the next: pick another seed"

(scratch / "sgd.json").write_text(json.dumps({"optimizer": "sgd", "momentum": 0, "weight_decay": 0}))


def read_safetensors(path):
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    header.pop("__metadata__", None)
    out = {}
    for name, t in header.items():
        assert t["dtype"] == "F32", (name, t["dtype"])
        b, e = t["data_offsets"]
        out[name] = list(struct.unpack(f"<{(e - b) // 4}f", raw[8 + n + b:8 + n + e]))
    return out


def train(world, lr):
    out = scratch / f"world{world}_lr{lr}"
    metrics, exported = out / "m.jsonl", out / "exported"
    out.mkdir()
    run = subprocess.run([binary, "--init", str(folder), "--data", str(scratch / "tokens.bin"), "--data-format", "u32",
                          "--seq", str(SEQ), "--batch", str(world), "--world-size", str(world), "--steps", "1",
                          "--config", str(scratch / "sgd.json"), "--lr", str(lr), "--clip", "0", "--metrics", str(metrics),
                          "--export", str(exported), "--quiet"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    return loss, read_safetensors(exported / "model.safetensors"), json.loads((exported / "config.json").read_text())


# A step at lr 1e-30 (no change in f32) exports the folder's weights: the same tensors, names and a Mixtral config.
_, back, config = train(1, "1e-30")
assert set(back) == set(tensors), set(back) ^ set(tensors)
for name, (_, vals) in tensors.items():
    assert back[name] == vals, f"{name} changed through coshard"
for key, value in [("model_type", "mixtral"), ("num_local_experts", E), ("num_experts_per_tok", TOP),
                   ("output_router_logits", True), ("router_aux_loss_coef", COEF)]:
    assert config[key] == value, (key, config.get(key))

checked = 0
for world in (1, 2):
    loss, after, _ = train(world, 1)
    assert abs(loss - expected) <= 2e-6 * abs(expected), f"world {world}: coshard's loss {loss!r}, transformers' {expected!r}"
    # The gradient along random directions of each kind of tensor: (w0 - w1) . u against
    # (f(w + h u) - f(w - h u)) / 2h.
    for name in ["model.layers.0.block_sparse_moe.gate.weight", "model.layers.1.block_sparse_moe.gate.weight",
                 "model.layers.0.block_sparse_moe.experts.1.w1.weight", "model.layers.1.block_sparse_moe.experts.2.w2.weight",
                 "model.layers.0.block_sparse_moe.experts.3.w3.weight", "model.layers.0.self_attn.q_proj.weight",
                 "model.layers.1.post_attention_layernorm.weight", "model.embed_tokens.weight", "lm_head.weight"]:
        shape, w0 = tensors[name]
        u = [rng.gauss(0.0, 1.0) for _ in w0]
        got = sum((a - b) * c for a, b, c in zip(w0, after[name], u))
        h = 1e-4
        plus = dict(tensors, **{name: (shape, [a + h * c for a, c in zip(w0, u)])})
        minus = dict(tensors, **{name: (shape, [a - h * c for a, c in zip(w0, u)])})
        want = (forward_loss(plus, ids) - forward_loss(minus, ids)) / (2 * h)
        scale = math.sqrt(sum((a - b) ** 2 for a, b in zip(w0, after[name]))) * math.sqrt(sum(c * c for c in u))
        assert abs(got - want) <= 1e-4 * abs(want) + 2e-6 * scale, \
            f"world {world}: d loss along a direction of {name}: coshard {got!r}, transformers' {want!r}"
        checked += 1
print(f"loss {expected:.7f} (cross-entropy + {COEF} x load balancing); {checked} directional derivatives and "
      f"{len(tensors)} tensors round-tripped")
