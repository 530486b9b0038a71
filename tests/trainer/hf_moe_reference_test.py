#!/usr/bin/env python3
"""Hugging Face Mixtral and Qwen3-MoE folders (and a dense Qwen3's) written here, independently of coshard
(MixtralForCausalLM: block_sparse_moe.gate and experts.E.w1/w2/w3; Qwen3MoeForCausalLM: the query
and key head norms, mlp.gate and experts.E.gate_proj/up_proj/down_proj, a dense layer from
mlp_only_layers, experts narrower than the dense MLP, norm_topk_prob false; both with
output_router_logits and router_aux_loss_coef, sharded with their index), each trained one step by
coshard-train --init with plain SGD at lr 1 (so the exported weights give the gradient: w0 - w1);
checked against a plain-Python forward written from transformers' modeling_mixtral.py and
modeling_qwen3_moe.py (4.x):

- the sparse MoE block: router logits, softmax in float, top-k, divided by their sum (Mixtral
  always, Qwen3-MoE when norm_topk_prob), cast back, each chosen expert's
  down(silu(gate x) * up x) times its weight, summed in expert order;
- Qwen3's attention: q_norm and k_norm (RMSNorm over each head) before the rotary embedding;
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

V, D, H, K, HD, SEQ = 32, 16, 4, 2, 4, 6
THETA, COEF = 1000000.0, 0.3
rng = random.Random(11)


class Family:
    """What differs between the two conventions."""

    def __init__(self, name):
        self.name = name
        self.mixtral = name == "mixtral"
        self.L = 2 if self.mixtral else 3
        self.E, self.TOP = (4, 2) if self.mixtral else (6, 3)
        self.I = 12                           # the dense MLP's (and Mixtral's experts') width
        self.W = 12 if self.mixtral else 8    # the experts' width
        self.renormalize = self.mixtral       # Qwen3-MoE: norm_topk_prob false here
        self.dense = [] if self.mixtral else [1] if name == "qwen3_moe" else list(range(self.L))  # qwen3: no experts
        self.eps = 1e-5 if self.mixtral else 1e-6
        self.moe = "block_sparse_moe." if self.mixtral else "mlp."
        self.gate, self.up, self.down = ("w1", "w3", "w2") if self.mixtral else ("gate_proj", "up_proj", "down_proj")

    def config(self):
        c = {"vocab_size": V, "hidden_size": D, "intermediate_size": self.I, "num_hidden_layers": self.L,
             "num_attention_heads": H, "num_key_value_heads": K, "head_dim": HD, "max_position_embeddings": 32,
             "rms_norm_eps": self.eps, "rope_theta": THETA, "tie_word_embeddings": False, "hidden_act": "silu",
             "num_experts_per_tok": self.TOP, "output_router_logits": True, "router_aux_loss_coef": COEF,
             "attention_dropout": 0.0, "torch_dtype": "float32"}
        if self.mixtral:
            c.update({"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "num_local_experts": self.E,
                      "sliding_window": None, "router_jitter_noise": 0.0})
        elif self.name == "qwen3":
            for key in ("num_experts_per_tok", "output_router_logits", "router_aux_loss_coef"):
                del c[key]
            c.update({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False,
                      "use_sliding_window": False, "sliding_window": None})
        else:
            c.update({"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": self.E,
                      "moe_intermediate_size": self.W, "norm_topk_prob": self.renormalize, "decoder_sparse_step": 1,
                      "mlp_only_layers": self.dense, "attention_bias": False, "use_sliding_window": False,
                      "sliding_window": None})
        return c


def f32(x):
    return struct.unpack("<f", struct.pack("<f", x))[0]


def make_tensors(fam):
    tensors = {}  # name -> (shape, values)

    def add(name, shape, std):
        n = shape[0] * (shape[1] if len(shape) > 1 else 1)
        tensors[name] = (shape, [f32(rng.gauss(0.0, std)) for _ in range(n)])

    def add_norm(name, n=D):
        tensors[name] = ([n], [f32(rng.uniform(0.5, 1.5)) for _ in range(n)])

    add("model.embed_tokens.weight", [V, D], 0.5)
    for l in range(fam.L):
        p = f"model.layers.{l}."
        add_norm(p + "input_layernorm.weight")
        add(p + "self_attn.q_proj.weight", [H * HD, D], 0.3)
        add(p + "self_attn.k_proj.weight", [K * HD, D], 0.3)
        add(p + "self_attn.v_proj.weight", [K * HD, D], 0.3)
        if not fam.mixtral:
            add_norm(p + "self_attn.q_norm.weight", HD)
            add_norm(p + "self_attn.k_norm.weight", HD)
        add(p + "self_attn.o_proj.weight", [D, H * HD], 0.3)
        add_norm(p + "post_attention_layernorm.weight")
        if l in fam.dense:
            add(p + "mlp.gate_proj.weight", [fam.I, D], 0.3)
            add(p + "mlp.up_proj.weight", [fam.I, D], 0.3)
            add(p + "mlp.down_proj.weight", [D, fam.I], 0.3)
            continue
        add(p + fam.moe + "gate.weight", [fam.E, D], 0.5)
        for e in range(fam.E):
            q = p + fam.moe + f"experts.{e}."
            add(q + fam.gate + ".weight", [fam.W, D], 0.3)
            add(q + fam.up + ".weight", [fam.W, D], 0.3)
            add(q + fam.down + ".weight", [D, fam.W], 0.3)
    add_norm("model.norm.weight")
    add("lm_head.weight", [V, D], 0.3)
    return tensors


def write_safetensors(path, tensors, names):
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for n in names:
        shape, vals = tensors[n]
        raw = struct.pack(f"<{len(vals)}f", *vals)
        header[n] = {"dtype": "F32", "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def write_folder(fam, tensors, folder):
    folder.mkdir(parents=True)
    names = list(tensors)
    shards = [names[:20], names[20:]]
    weight_map = {}
    for i, part in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(folder / file, tensors, part)
        weight_map.update({n: file for n in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(fam.config()))

# ---- transformers' forward and loss, in plain Python ----


def matvec(m, x, rows, cols):
    return [sum(m[r * cols + c] * x[c] for c in range(cols)) for r in range(rows)]


def rms_norm(x, w, eps):
    inv = 1.0 / math.sqrt(sum(v * v for v in x) / len(x) + eps)
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


def swiglu_mlp(w, prefix, names, x, width):
    gate = matvec(w(prefix + names[0] + ".weight"), x, width, D)
    up = matvec(w(prefix + names[1] + ".weight"), x, width, D)
    act = [a / (1 + math.exp(-a)) * b for a, b in zip(gate, up)]
    return matvec(w(prefix + names[2] + ".weight"), act, D, width)


def attention(fam, w, p, normed):
    T = len(normed)
    q = [matvec(w(p + "self_attn.q_proj.weight"), x, H * HD, D) for x in normed]
    k = [matvec(w(p + "self_attn.k_proj.weight"), x, K * HD, D) for x in normed]
    v = [matvec(w(p + "self_attn.v_proj.weight"), x, K * HD, D) for x in normed]
    qh = lambda t, h: q[t][h * HD:(h + 1) * HD]
    kh = lambda t, g: k[t][g * HD:(g + 1) * HD]
    if not fam.mixtral:  # Qwen3: q_norm and k_norm over each head, before the rotary embedding
        qn, kn = w(p + "self_attn.q_norm.weight"), w(p + "self_attn.k_norm.weight")
        qh = lambda t, h, f=qh: rms_norm(f(t, h), qn, fam.eps)
        kh = lambda t, g, f=kh: rms_norm(f(t, g), kn, fam.eps)
    attn = [[0.0] * (H * HD) for _ in range(T)]
    for h in range(H):
        g = h // (H // K)
        qs = [rope(qh(t, h), t) for t in range(T)]
        ks = [rope(kh(t, g), t) for t in range(T)]
        for t in range(T):
            pr = softmax([sum(a * b for a, b in zip(qs[t], ks[s])) / math.sqrt(HD) for s in range(t + 1)])
            for d in range(HD):
                attn[t][h * HD + d] = sum(pr[s] * v[s][g * HD + d] for s in range(t + 1))
    return [matvec(w(p + "self_attn.o_proj.weight"), attn[t], D, H * HD) for t in range(T)]


def forward_loss(fam, W, ids, margins=None):
    w = lambda n: W[n][1]
    hs = [list(w("model.embed_tokens.weight")[t * D:(t + 1) * D]) for t in ids[:-1]]
    T = len(hs)
    pooled = []  # every MoE layer's router probabilities and choices
    for l in range(fam.L):
        p = f"model.layers.{l}."
        normed = [rms_norm(h, w(p + "input_layernorm.weight"), fam.eps) for h in hs]
        hs = [[a + b for a, b in zip(h, o)] for h, o in zip(hs, attention(fam, w, p, normed))]
        normed = [rms_norm(h, w(p + "post_attention_layernorm.weight"), fam.eps) for h in hs]
        for t in range(T):
            if l in fam.dense:
                out = swiglu_mlp(w, p + "mlp.", ["gate_proj", "up_proj", "down_proj"], normed[t], fam.I)
                hs[t] = [a + b for a, b in zip(hs[t], out)]
                continue
            probs = softmax(matvec(w(p + fam.moe + "gate.weight"), normed[t], fam.E, D))
            order = sorted(range(fam.E), key=lambda e: (-probs[e], e))
            chosen = sorted(order[:fam.TOP])  # index_add_ adds the experts in ascending order
            if margins is not None:
                margins.append(probs[order[fam.TOP - 1]] - probs[order[fam.TOP]])
            total = sum(probs[e] for e in chosen) if fam.renormalize else 1.0
            out = [0.0] * D
            for e in chosen:
                y = swiglu_mlp(w, p + fam.moe + f"experts.{e}.", [fam.gate, fam.up, fam.down], normed[t], fam.W)
                out = [o + probs[e] / total * yv for o, yv in zip(out, y)]
            hs[t] = [a + b for a, b in zip(hs[t], out)]
            pooled.append((probs, order[:fam.TOP]))
    ce = 0.0
    for t in range(T):
        logits = matvec(w("lm_head.weight"), rms_norm(hs[t], w("model.norm.weight"), fam.eps), V, D)
        top = max(logits)
        ce += top + math.log(sum(math.exp(x - top) for x in logits)) - logits[ids[t + 1]]
    ce /= T
    rows = len(pooled)
    if rows == 0:  # no experts: the cross-entropy alone
        return ce
    tokens_per_expert = [sum(1.0 for _, ch in pooled for c in ch if c == e) / rows for e in range(fam.E)]
    prob_per_expert = [sum(pr[e] for pr, _ in pooled) / rows for e in range(fam.E)]
    aux = fam.E * sum(a * b for a, b in zip(tokens_per_expert, prob_per_expert))
    return ce + COEF * aux


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


(scratch).mkdir(parents=True)
(scratch / "sgd.json").write_text(json.dumps({"optimizer": "sgd", "momentum": 0, "weight_decay": 0}))


def train(folder, tokens, world, lr):
    out = folder.parent / f"{folder.name}_world{world}_lr{lr}"
    metrics, exported = out / "m.jsonl", out / "exported"
    out.mkdir()
    run = subprocess.run([binary, "--init", str(folder), "--data", str(tokens), "--data-format", "u32",
                          "--seq", str(SEQ), "--batch", str(world), "--world-size", str(world), "--steps", "1",
                          "--config", str(scratch / "sgd.json"), "--lr", str(lr), "--clip", "0", "--metrics", str(metrics),
                          "--export", str(exported), "--quiet"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
    return loss, read_safetensors(exported / "model.safetensors"), json.loads((exported / "config.json").read_text())


def check(fam):
    tensors = make_tensors(fam)
    folder = scratch / fam.name
    write_folder(fam, tensors, folder)
    ids = [rng.randrange(V) for _ in range(SEQ + 1)]
    tokens = scratch / f"{fam.name}_tokens.bin"
    tokens.write_bytes(struct.pack(f"<{SEQ + 1}I", *ids))
    margins = []
    expected = forward_loss(fam, tensors, ids, margins)
    assert min(margins, default=1) > 1e-3, f"{fam.name}: a top-k choice within {min(margins)} of the next: pick another seed"

    # A step at lr 1e-30 (no change in f32) exports the folder's weights: the same tensors, names, config.
    _, back, config = train(folder, tokens, 1, "1e-30")
    assert set(back) == set(tensors), set(back) ^ set(tensors)
    for name, (_, vals) in tensors.items():
        assert back[name] == vals, f"{fam.name}: {name} changed through coshard"
    for key, value in fam.config().items():
        if key not in ("torch_dtype", "attention_dropout"):
            assert config.get(key) == value, (fam.name, key, config.get(key), value)

    checked = 0
    for world in (1, 2):
        loss, after, _ = train(folder, tokens, world, 1)
        assert abs(loss - expected) <= 2e-6 * abs(expected), \
            f"{fam.name}, world {world}: coshard's loss {loss!r}, transformers' {expected!r}"
        # The gradient along random directions of each kind of tensor: (w0 - w1) . u against
        # (f(w + h u) - f(w - h u)) / 2h.
        last = f"model.layers.{fam.L - 1}."
        kinds = [n for n in tensors if "gate.weight" in n or "experts.1." in n or "q_proj" in n or "q_norm" in n or
                 "k_norm" in n or "layers.1.mlp.up_proj" in n or "post_attention" in n or not n.startswith("model.layers")]
        for name in kinds:
            shape, w0 = tensors[name]
            u = [rng.gauss(0.0, 1.0) for _ in w0]
            got = sum((a - b) * c for a, b, c in zip(w0, after[name], u))
            h = 1e-4
            plus = dict(tensors, **{name: (shape, [a + h * c for a, c in zip(w0, u)])})
            minus = dict(tensors, **{name: (shape, [a - h * c for a, c in zip(w0, u)])})
            want = (forward_loss(fam, plus, ids) - forward_loss(fam, minus, ids)) / (2 * h)
            scale = math.sqrt(sum((a - b) ** 2 for a, b in zip(w0, after[name]))) * math.sqrt(sum(c * c for c in u))
            assert abs(got - want) <= 1e-4 * abs(want) + 2e-6 * scale, \
                f"{fam.name}, world {world}: d loss along a direction of {name}: coshard {got!r}, transformers' {want!r}"
            checked += 1
    print(f"{fam.name}: loss {expected:.7f} ({'cross-entropy alone' if fam.name == 'qwen3' else f'cross-entropy + {COEF} x load balancing'}); {checked} directional "
          f"derivatives, {len(tensors)} tensors round-tripped")


check(Family("mixtral"))
check(Family("qwen3_moe"))
check(Family("qwen3"))  # Qwen3's dense model: the head norms alone
