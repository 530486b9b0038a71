#!/usr/bin/env python3
"""coshard-train --tensorboard, loaded by TensorBoard itself: every scalar tag, one event per step.

Skips (exit 77) where Python has no `tensorboard` package; the C++ test reads the same files
with the protobuf definitions everywhere.
usage: tensorboard_load_test.py COSHARD_TRAIN SCRATCH_DIR
"""
import math
import pathlib
import shutil
import subprocess
import sys

try:
    from tensorboard.backend.event_processing import event_accumulator
except ImportError:
    print("SKIP: Python has no tensorboard package")
    sys.exit(77)

binary, scratch = sys.argv[1], pathlib.Path(sys.argv[2])
shutil.rmtree(scratch, ignore_errors=True)
scratch.mkdir(parents=True)
logdir = scratch / "tb"
steps = 5
subprocess.run([binary, "--layers", "1", "--dim", "16", "--heads", "2", "--seq", "8", "--batch", "4",
                "--steps", str(steps), "--world-size", "2", "--quiet", "--tensorboard", str(logdir)], check=True)
acc = event_accumulator.EventAccumulator(str(logdir), size_guidance={event_accumulator.SCALARS: 0})
acc.Reload()
tags = set(acc.Tags()["scalars"])
expected = {"train/loss", "train/lr", "train/grad_norm", "train/loss_scale", "perf/tokens_per_s", "perf/step_ms",
            "perf/exposed_comm_ms", "perf/blocking_waits", "zero/prefetch_hit_rate", "comm/gathered_bytes",
            "comm/reduce_scattered_bytes", "offload/swap_bytes", "memory/peak_bytes", "memory/peak_gathered_bytes",
            "memory/peak_activation_bytes"}
missing = expected - tags
assert not missing, f"tags TensorBoard did not find: {sorted(missing)} (found {sorted(tags)})"
for tag in expected:
    events = acc.Scalars(tag)
    assert [e.step for e in events] == list(range(1, steps + 1)), (tag, [e.step for e in events])
    assert all(math.isfinite(e.value) for e in events), (tag, [e.value for e in events])
losses = [e.value for e in acc.Scalars("train/loss")]
print(f"tensorboard loaded {len(expected)} tags x {steps} steps; loss {losses[0]:.4f} -> {losses[-1]:.4f}")
