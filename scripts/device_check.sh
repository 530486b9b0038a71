#!/usr/bin/env bash
# On a lent GPU machine (after scripts/device_bundle.sh here): the whole test suite with the
# device present, the CUDA trainer, and the GPU benchmarks. Logs go to $OUT (or ./device-out).
# compare: coshard against PyTorch FSDP2 on the same GPU (bench/gpu_vs_fsdp.py; $COMPARE_PRESETS,
# default gpt2-124m gpt2-1.5b; $COMPARE_FLAGS passed on, $COMPARE_NAME in the files' names;
# COMPARE_TRACE=0 skips the traced run). Everything it writes is packed into $OUT/device-check.tar.gz at the
# end (the device tool brings back few files), with summary.txt beside it.
# llama: the 100M Llama preset in bf16 with activation checkpointing off and on (losses, the
# activation and allocator peaks, tokens/s, the device's peak as nvidia-smi sees it).
#   scripts/device_check.sh [tests|train|llama|bench|compare]...   (default: tests train llama bench)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/device-out}
mkdir -p "$out/logs"
final=$out
out=$out/logs
source scripts/device_env.sh
pack() { tar -C "$final" -czf "$final/device-check.tar.gz" logs && rm -rf "$final/logs"; }
trap pack EXIT
trap "exit 143" TERM INT
exec > >(tee "$final/summary.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
steps=${*:-tests train llama bench}
for step in $steps; do
  case $step in
    tests)
      # install.consumer builds an outside project against the installed package: it needs the
      # build machine's -dev packages, and CI runs it; everything else runs here.
      (cd build/test && ctest -j12 --timeout 240 --output-on-failure -LE install ${CTEST_FLAGS:-} >"$out/ctest.log" 2>&1
       echo "ctest rc $?")
      grep -E "tests passed|Failed|\*\*\*|Not Run" "$out/ctest.log" | head -40
      build/test/tests/modules/modules_cuda_test >"$out/cuda_test.log" 2>&1; echo "modules_cuda_test rc $?" ;;
    train)
      for world in 2 4; do
        timeout 180 build/release/trainer/coshard-train --device cuda --world-size "$world" --steps 300 \
          --metrics "$out/train_w$world.jsonl" >"$out/train_w$world.log" 2>&1
        echo "train world $world rc $?"; tail -2 "$out/train_w$world.log"
      done
      for dtype in f32 bf16; do
        timeout 180 build/release/trainer/coshard-train --device cuda --world-size 1 --steps 300 --dtype "$dtype" \
          --metrics "$out/train_$dtype.jsonl" >"$out/train_$dtype.log" 2>&1
        echo "train $dtype rc $?"; tail -4 "$out/train_$dtype.log"
      done
      # The optimizer offloaded (pinned memory, NVMe) in bf16, stepped after and during backward.
      for offload in cpu "nvme:$out/swap"; do
        for extra in "" "--step-in-backward --clip 0"; do
          name="offload_${offload%%:*}${extra:+_sib}"
          # shellcheck disable=SC2086  # $extra is two options or none
          timeout 180 build/release/trainer/coshard-train --device cuda --world-size 1 --steps 300 --dtype bf16 \
            --offload-optimizer "$offload" $extra --metrics "$out/train_$name.jsonl" >"$out/train_$name.log" 2>&1
          echo "train bf16 $name rc $?"; tail -2 "$out/train_$name.log"
        done
      done
      # ZeRO-Infinity in bf16: the optimizer and the parameters on NVMe (stage 3).
      timeout 180 build/release/trainer/coshard-train --device cuda --world-size 1 --steps 300 --dtype bf16 \
        --offload-optimizer "nvme:$out/swap" --offload-params nvme --metrics "$out/train_params_nvme.jsonl" \
        >"$out/train_params_nvme.log" 2>&1
      echo "train bf16 params_nvme rc $?"; tail -2 "$out/train_params_nvme.log"
      rm -rf "$out/swap" ;;
    llama)
      for policy in none full; do
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 >"$out/llama_${policy}_smi.txt" &
        smi=$!
        timeout 300 build/release/trainer/coshard-train --device cuda --world-size 1 --preset llama-100m --dtype bf16 \
          --seq 1024 --batch 8 --steps 40 --activation-checkpointing "$policy" --metrics "$out/llama_$policy.jsonl" \
          >"$out/llama_$policy.log" 2>&1
        echo "llama checkpointing $policy rc $?"; tail -2 "$out/llama_$policy.log"
        kill "$smi" 2>/dev/null
        echo "  device peak (nvidia-smi): $(sort -n "$out/llama_${policy}_smi.txt" | tail -1) MiB"
      done
      python3 - "$out/llama_none.jsonl" "$out/llama_full.jsonl" <<'PY'
import json, statistics, sys
runs = [[json.loads(l) for l in open(p)] for p in sys.argv[1:]]
for name, rows in zip(("none", "full"), runs):
    print(f"  {name}: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, peak activation "
          f"{max(r['peak_activation_bytes'] for r in rows) / 2**20:.0f} MiB, allocator peak "
          f"{max(r['peak_memory_bytes'] for r in rows) / 2**20:.0f} MiB, tokens/s {statistics.median(r['tokens_per_s'] for r in rows[5:]):.0f}")
# (CUDA's token-embedding gradient adds with atomics: runs may differ in the last bits anyway)
diff = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(*runs))
print(f"  losses with and without checkpointing: largest relative difference {diff:.2e}")
PY
      ;;
    bench)
      for which in Gpu Nccl; do  # apart, so that one failing leaves the other's numbers
        timeout 240 build/release/bench/collectives_bench --benchmark_filter="$which" \
          --benchmark_out="$out/bench_$which.json" --benchmark_out_format=json >"$out/bench_$which.log" 2>&1
        echo "$which bench rc $?"; python3 bench/report.py "$out/bench_$which.json"
      done
      # The fused attention and the multi-tensor AdamW against their unfused baselines, the norms
      # against a device copy.
      timeout 300 build/release/bench/gpu_kernels_bench --benchmark_out="$out/bench_kernels.json" \
        --benchmark_out_format=json >"$out/bench_kernels.log" 2>&1
      echo "kernels bench rc $?"; python3 bench/report.py "$out/bench_kernels.json"
      grep -E "^BM_" "$out/bench_kernels.log"
      # The engine's parameter streaming from pinned memory against a plain pinned copy (#19 3b).
      timeout 180 build/release/bench/offload_stream_bench --benchmark_out="$out/bench_stream.json" \
        --benchmark_out_format=json >"$out/bench_stream.log" 2>&1
      echo "stream bench rc $?"; python3 bench/report.py "$out/bench_stream.json" ;;
    compare)
      for preset in ${COMPARE_PRESETS:-gpt2-124m gpt2-1.5b}; do
        name=$preset${COMPARE_NAME:+_$COMPARE_NAME}
        timeout 420 python3 bench/gpu_vs_fsdp.py --preset "$preset" --coshard build/release/trainer/coshard-train \
          --workdir "$out" --out "$out/compare_$name.json" ${COMPARE_FLAGS:-} >"$out/compare_$name.log" 2>&1
        echo "compare $name rc $?"; cat "$out/compare_$name.log"
      done
      # One traced run of the smaller GPT (its steps on a device timeline, for the overlap).
      [ "${COMPARE_TRACE:-1}" = 1 ] && timeout 120 build/release/trainer/coshard-train --device cuda --world-size 1 --dtype bf16 --layers 12 \
        --dim 768 --heads 12 --vocab 50257 --seq 1024 --batch 8 --steps 4 --quiet \
        --trace "$out/trace_gpt2-124m.json" >"$out/trace.log" 2>&1
      echo "traced run rc $?" ;;
  esac
done
