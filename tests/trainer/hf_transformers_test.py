#!/usr/bin/env python3
"""Hugging Face folders against transformers itself: a LlamaForCausalLM that transformers writes
(sharded, with its index; grouped-query heads, tied embeddings, Llama 3's rope scaling) loads into
coshard-train --init, whose first loss on one sequence equals the loss transformers computes on it;
coshard's --export of it loads back into transformers with every tensor unchanged.

Skips (exit 77) where Python has no torch or transformers (the C++ tests check the layout
everywhere; this checks the conventions against the library: rotary halves, GQA, SwiGLU, RMSNorm).
usage: hf_transformers_test.py COSHARD_TRAIN SCRATCH_DIR
"""
import json
import pathlib
import shutil
import struct
import subprocess
import sys

try:
    import torch
    import transformers
except ImportError:
    print("SKIP: Python has no torch or transformers")
    sys.exit(77)

binary, scratch = sys.argv[1], pathlib.Path(sys.argv[2])
shutil.rmtree(scratch, ignore_errors=True)
scratch.mkdir(parents=True)
seq = 16
config = transformers.LlamaConfig(
    vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8},
    tie_word_embeddings=True, attention_bias=False, mlp_bias=False)
torch.manual_seed(0)
model = transformers.LlamaForCausalLM(config).float().eval()
with torch.no_grad():  # norms away from 1, so a misplaced gain shows
    for name, p in model.named_parameters():
        if "norm" in name:
            p.uniform_(0.5, 1.5)
source = scratch / "from_transformers"
model.save_pretrained(source, safe_serialization=True, max_shard_size="40KB")
assert (source / "model.safetensors.index.json").exists(), sorted(p.name for p in source.iterdir())

# One sequence of seq + 1 ids: every window coshard draws is this one.
ids = torch.randint(0, config.vocab_size, (seq + 1,), generator=torch.Generator().manual_seed(1))
(scratch / "tokens.bin").write_bytes(struct.pack(f"<{seq + 1}I", *ids.tolist()))
with torch.no_grad():
    logits = model(input_ids=ids[:seq].unsqueeze(0)).logits[0].double()
    expected = torch.nn.functional.cross_entropy(logits, ids[1:]).item()

metrics = scratch / "m.jsonl"
exported = scratch / "from_coshard"
run = subprocess.run([binary, "--init", str(source), "--data", str(scratch / "tokens.bin"), "--data-format", "u32",
                      "--seq", str(seq), "--batch", "2", "--world-size", "2", "--steps", "1", "--lr", "1e-30",
                      "--weight-decay", "0", "--metrics", str(metrics), "--export", str(exported), "--quiet"],
                     capture_output=True, text=True, timeout=600)
assert run.returncode == 0, run.stdout + run.stderr
loss = json.loads(metrics.read_text().splitlines()[0])["loss"]
assert abs(loss - expected) <= 1e-5 * abs(expected), f"coshard's loss {loss}, transformers' {expected}"

again = transformers.LlamaForCausalLM.from_pretrained(exported, torch_dtype=torch.float32)
theirs, ours = model.state_dict(), again.state_dict()
assert theirs.keys() == ours.keys(), set(theirs.keys()) ^ set(ours.keys())
for name, tensor in theirs.items():
    assert torch.equal(tensor, ours[name]), f"{name} changed through coshard"
print(f"transformers {transformers.__version__}: loss {loss:.6f} against {expected:.6f}; {len(theirs)} tensors round-tripped")
