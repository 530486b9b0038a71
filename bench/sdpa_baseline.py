#!/usr/bin/env python3
"""PyTorch's scaled_dot_product_attention at gpu_kernels_bench's attention shapes: the baseline
for coshard's fused attention (BM_FusedAttention_*), counted the same way.

A causal attention's forward and backward in bf16 on random inputs, grouped-query where the shape
is (enable_gqa); TFLOP/s counts 2*B*H*T^2*hd for the forward and 2.5 times that for the backward,
as the C++ benchmark does. Each shape: 5 warm-up passes, then the median of 30 timed passes, each
timed by CUDA events around one forward and backward.

  python3 bench/sdpa_baseline.py [--out results.json]
"""
import argparse
import json
import statistics

# name: B, T, query heads, key/value heads, head size (gpu_kernels_bench.cpp's kShapes)
SHAPES = {
    "Gpt2XL": (4, 1024, 25, 25, 64),
    "Llama1B": (2, 2048, 32, 8, 64),
    "Llama8B": (1, 2048, 32, 8, 128),
}


def time_shape(torch, B, T, H, KVH, hd, warmup=5, passes=30):
    F = torch.nn.functional
    gen = torch.Generator(device="cuda").manual_seed(1)

    def rand(*shape):
        return (torch.rand(*shape, device="cuda", generator=gen) * 2 - 1).to(torch.bfloat16).requires_grad_()

    q, k, v = rand(B, H, T, hd), rand(B, KVH, T, hd), rand(B, KVH, T, hd)
    seed = (torch.rand(B, H, T, hd, device="cuda", generator=gen) * 2 - 1).to(torch.bfloat16)

    def once():
        q.grad = k.grad = v.grad = None  # no accumulation kernel after the first pass
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=KVH != H)
        out.backward(seed)

    for _ in range(warmup):
        once()
    torch.cuda.synchronize()
    times = []
    for _ in range(passes):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        once()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    med = statistics.median(times)
    forward = 2.0 * B * H * T * T * hd
    return {"ms": med * 1e3, "tflops": 3.5 * forward / med / 1e12}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="write the results as JSON here")
    args = p.parse_args()
    import torch
    results = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "shapes": {}}
    for name, shape in SHAPES.items():
        r = time_shape(torch, *shape)
        results["shapes"][name] = r
        print(f"SDPA_{name}: {r['ms']:.3f} ms, {r['tflops']:.1f} TFLOP/s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
