#!/usr/bin/env python3
"""Out of core on this machine: a Llama preset trained with its parameters and optimizer state on
NVMe (ZeRO-Infinity's mode), its peak resident memory against the machine's and the estimate's,
the bytes it reads and writes per step, and its step time against the disk-bound floor, in one run:

  python3 bench/out_of_core.py --coshard build/release/trainer/coshard-train --swap /work/swap \
      [--preset Llama-3.2-1B] [--seq 256] [--steps 4] [--buffers 2] [--step-in-backward | --swap-gradients] \
      [--sub-group-size N] [--out results.json]

It measures the disk first (fio: 1 MiB blocks, O_DIRECT, in the swap folder, reads and writes),
then asks coshard-train for its memory estimate (--estimate) and trains --steps steps, polling
the process's /proc/PID/io (bytes the block layer read and wrote for it) and marking each step
as its metrics line appears: the bytes of step k are the counters' growth between lines k-1 and k
(the first step also writes nothing new: the files were written at start). The floor of a step is
(bytes read + bytes written) / the disk's measured rate for each; the ratio step time / floor says
how much beyond the disk's pace the step costs. Each step's time split comes from its metrics
(zero::StepTimeSplit): the compute stream's and the host optimizer's busy time, the NVMe store's
bytes and how long its reads and writes were in flight. The bound a step is held to is
max(compute + optimizer, store bytes read / read rate + store bytes written / write rate), each
rate fio's (QD 32) or the store's own while its transfers of that kind were in flight, whichever
is more: the two cores run both the model and the optimizer, and the one disk both directions.
Peak resident memory is getrusage's of the process. PyTorch's need is the arithmetic of its
resident AdamW training (fp32 parameters, gradients and two moments: 16 bytes a parameter), without
activations.
"""
import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def fio_rate(folder, rw, size="2g"):
    out = subprocess.run(["fio", "--name=disk", f"--directory={folder}", f"--rw={rw}", "--bs=1m", "--direct=1",
                          "--ioengine=io_uring", "--iodepth=32", f"--size={size}", "--output-format=json"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, check=True).stdout
    job = json.loads(out)["jobs"][0]
    side = job["read" if "read" in rw else "write"]
    for f in os.listdir(folder):
        if f.startswith("disk."):
            os.remove(os.path.join(folder, f))
    return side["bw_bytes"]


def io_counters(pid):
    try:
        with open(f"/proc/{pid}/io") as f:
            fields = dict(line.split(": ") for line in f.read().splitlines())
        return int(fields["read_bytes"]), int(fields["write_bytes"])
    except (OSError, KeyError, ValueError):
        return None


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--coshard", required=True)
    p.add_argument("--swap", required=True, help="a folder on the disk to swap to (made, and emptied after)")
    p.add_argument("--preset", default="Llama-3.2-1B")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--buffers", type=int, default=2, help="swap and read-ahead buffers (buffer_count)")
    p.add_argument("--step-in-backward", action="store_true",
                   help="step each unit during backward (gradient clipping off): no gradient shard in pinned memory")
    p.add_argument("--swap-gradients", action="store_true",
                   help="write the gradient shards to the swap files (gradient clipping kept): none in pinned memory")
    p.add_argument("--sub-group-size", type=int, help="elements per swapped sub-group (coshard's default otherwise)")
    p.add_argument("--out")
    a = p.parse_args()
    os.makedirs(a.swap, exist_ok=True)
    work = tempfile.mkdtemp(prefix="out_of_core_")
    config = os.path.join(work, "ds.json")
    with open(config, "w") as f:
        json.dump({"zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "nvme", "nvme_path": a.swap, "buffer_count": a.buffers},
            "offload_param": {"device": "nvme", "nvme_path": a.swap, "buffer_count": a.buffers}}}, f)
    common = ["--preset", a.preset, "--seq", str(a.seq), "--batch", "1", "--world-size", "1", "--config", config]
    if a.step_in_backward:
        common += ["--step-in-backward", "--clip", "0"]
    if a.swap_gradients:
        common += ["--swap-gradients"]
    if a.sub_group_size is not None:
        common += ["--sub-group-size", str(a.sub_group_size)]

    disk = {"read_bytes_per_s": fio_rate(a.swap, "read"), "write_bytes_per_s": fio_rate(a.swap, "write")}
    est = subprocess.run([a.coshard] + common + ["--estimate"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    m = re.search(r"this process \(1 rank\): (.*)", est.stdout)
    estimate_host = 0
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
    params = int(re.search(r"(\d+)-parameter", est.stdout).group(1))
    for place, amount, unit in re.findall(r"(device|pinned host|pageable host|nvme) ([\d.]+) (\w+)", m.group(1) if m else ""):
        if place != "nvme":  # (the device is the CPU: its memory is the host's)
            estimate_host += int(float(amount) * units[unit])

    metrics = os.path.join(work, "m.jsonl")
    start = time.time()
    child = subprocess.Popen([a.coshard] + common + ["--steps", str(a.steps), "--quiet", "--metrics", metrics,
                                                     "--skip-memory-check"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marks = []  # the io counters when each step's line appeared
    last = io_counters(child.pid)
    lines = 0
    while child.poll() is None:
        now = io_counters(child.pid) or last
        last = now
        if os.path.exists(metrics):
            with open(metrics) as f:
                n = sum(1 for _ in f)
            while lines < n:
                marks.append(now)
                lines += 1
        time.sleep(0.2)
    output = child.stdout.read()
    peak_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    if child.returncode != 0:
        sys.exit(f"out_of_core: coshard-train failed ({child.returncode}):\n{output[-4000:]}")
    with open(metrics) as f:
        rows = [json.loads(line) for line in f]
    steps = []
    for k, row in enumerate(rows):
        read = written = None
        if 0 < k < len(marks) and marks[k] and marks[k - 1]:
            read, written = marks[k][0] - marks[k - 1][0], marks[k][1] - marks[k - 1][1]
        floor = None if read is None else read / disk["read_bytes_per_s"] + written / disk["write_bytes_per_s"]
        step_s = row["step_ms"] / 1000
        split = {key[:-3] + "_s": row[key] / 1000 for key in
                 ("compute_ms", "compute_idle_ms", "optimizer_ms", "nvme_read_ms", "nvme_write_ms", "nvme_busy_ms")
                 if row.get(key) is not None}
        store_read, store_written = row.get("nvme_read_bytes", 0), row.get("nvme_written_bytes", 0)
        # The disk's rate: fio's, or what the store reached while its reads (writes) were in
        # flight where that is more (several files at once outrun fio's one).
        read_rate = max(disk["read_bytes_per_s"], store_read / split["nvme_read_s"] if split.get("nvme_read_s") else 0)
        write_rate = max(disk["write_bytes_per_s"],
                         store_written / split["nvme_write_s"] if split.get("nvme_write_s") else 0)
        disk_s = store_read / read_rate + store_written / write_rate
        bound = max(split.get("compute_s", 0) + split.get("optimizer_s", 0), disk_s)
        steps.append({"step": row["step"], "loss": row["loss"], "step_s": step_s, "read_bytes": read,
                      "written_bytes": written, "disk_floor_s": floor,
                      "vs_floor": None if not floor else step_s / floor,
                      "split": split, "store_read_bytes": store_read, "store_written_bytes": store_written,
                      "store_read_rate_vs_fio": (store_read / split["nvme_read_s"] / disk["read_bytes_per_s"])
                      if split.get("nvme_read_s") else None,
                      "store_write_rate_vs_fio": (store_written / split["nvme_write_s"] / disk["write_bytes_per_s"])
                      if split.get("nvme_write_s") else None,
                      "bound_s": bound, "vs_bound": step_s / bound if bound else None})
    total_mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    result = {
        "machine": {"cores": os.cpu_count(), "memory_bytes": total_mem},
        "preset": a.preset, "parameters": params, "seq": a.seq, "buffers": a.buffers, "disk": disk,
        "step_in_backward": a.step_in_backward, "swap_gradients": a.swap_gradients, "estimate": est.stdout,
        "estimate_host_bytes": estimate_host, "peak_rss_bytes": peak_rss, "wall_s": time.time() - start,
        "steps": steps,
        "pytorch_resident_adamw_bytes": 16 * params,
    }
    shutil.rmtree(a.swap, ignore_errors=True)
    shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
