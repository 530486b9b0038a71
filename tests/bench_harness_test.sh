#!/usr/bin/env bash
# bench/gpu_vs_fsdp.py at toy size on the CPU (the GPT, and the Llama with checkpointing): it runs coshard-train, reads its metrics, and writes
# a report with tokens/s and MFU for every side it ran (PyTorch's too when torch is importable).
#   bench_harness_test.sh PYTHON SCRIPT COSHARD_TRAIN
set -euo pipefail
python=$1 script=$2 coshard=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
skip_torch=--skip-torch
"$python" -c "import torch" 2>/dev/null && skip_torch=
for preset in toy llama-toy; do
extra=
[ "$preset" = llama-toy ] && extra=--checkpointing  # the Llama with every block recomputed, both sides
"$python" "$script" --cpu --preset $preset --steps 3 --warmup 1 $skip_torch $extra --coshard "$coshard" \
  --workdir "$work" --out "$work/results.json"
"$python" - "$work/results.json" "${skip_torch:-with-torch}" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
runs = r["runs"]
assert "coshard" in runs and "error" not in runs["coshard"], runs
for name, run in runs.items():
    assert "error" not in run, (name, run)
    assert run["tokens_per_s"] > 0 and 0 < run["mfu"] < 1, (name, run)
assert runs["coshard"]["blocking_waits"] == 0, runs["coshard"]
if sys.argv[2] == "with-torch":
    assert r["coshard_over_fsdp2_eager"] > 0, r
print("harness ok:", {k: round(v["tokens_per_s"]) for k, v in runs.items()})
PY
done
