#!/usr/bin/env python3
"""Rewrites a CUDA kernel file into C++ for the CPU emulation (cuda_emu.hpp):
kernel<<<grid, block, shared, stream>>>(args) becomes emu::launch(kernel, grid, block, shared,
stream)(args), and `extern __shared__ ... name[];` a pointer to the block's dynamic shared memory.
Fails (exit 1) when a file holds a launch or a dynamic shared declaration it cannot rewrite.
  translate.py IN.cu OUT.cpp"""
import re
import sys

LAUNCH = re.compile(r"([A-Za-z_][\w:]*(?:<[^<>;]*>)?)<<<(.*?)>>>\(", re.S)
SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\[\];")


def main(src, dst):
    text = open(src).read()
    out = LAUNCH.sub(lambda m: f"::emu::launch({m.group(1)}, {m.group(2)})(", text)
    out = SHARED.sub(lambda m: f"{m.group(1)}* {m.group(2)} = reinterpret_cast<{m.group(1)}*>(emu_dynamic_shared());",
                     out)
    for left in ("<<<", "extern __shared__"):
        if left in out:
            sys.exit(f"translate.py: {src}: cannot rewrite every '{left}'")
    with open(dst, "w") as f:
        f.write(f"// Generated from {src} by tests/cuda_emu/translate.py: do not edit.\n")
        f.write('#include "cuda_emu.hpp"\n#line 1 "' + src + '"\n' + out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
