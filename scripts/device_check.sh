#!/usr/bin/env bash
# On a lent GPU machine (after scripts/device_bundle.sh here): the whole test suite with the
# device present, the CUDA trainer, and the GPU benchmarks. Logs go to $OUT (or ./device-out).
# compare: coshard against PyTorch FSDP2 on the same GPU (bench/gpu_vs_fsdp.py; $COMPARE_PRESETS,
# default gpt2-124m gpt2-1.5b; $COMPARE_FLAGS passed on, $COMPARE_NAME in the files' names;
# COMPARE_TRACE=0 skips the traced run). Everything it writes is packed into $OUT/device-check.tar.gz at the
# end (the device tool brings back few files), with summary.txt beside it.
# llama: the 100M Llama preset in bf16 with activation checkpointing off and on (losses, the
# activation and allocator peaks, tokens/s, the device's peak as nvidia-smi sees it).
# offload: the offloaded table (parameters and optimizer in pinned memory against FSDP2's
# CPUOffloadPolicy) at $OFFLOAD_PRESET (default llama-3.2-3b: the 8B needs ~140 GiB of host memory).
# TEST_BUILD and RELEASE_BUILD (default build/test, build/release) may name one build for both.
# tensor: tensor ranks sharing the card (--tensor-parallel 2 over 4 ranks, the Local backend on device
# memory) against the same run on the CPU: the losses within 1e-4 (issue 51's GPU check).
# loss: the cross-entropy fused with the output layer (--cross-entropy chunked) against the whole
# logits' on Llama-100m in bf16: losses, activation peaks, tokens/s (issue 52's GPU check).
#   scripts/device_check.sh [tests|rest|train|llama|tensor|loss|bench|compare|offload]...   (default: tests train llama bench)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-$PWD/device-out}
mkdir -p "$out/logs"
final=$out
out=$out/logs
source scripts/device_env.sh
# DEADLINE (seconds since the epoch, optional): every run is cut to end before it, and a step that
# starts after it is skipped, so that one device call of a known length brings back all it did.
cap() {  # cap N: N seconds, or what is left before DEADLINE if less (at least 1)
  if [ -z "${DEADLINE:-}" ]; then echo "$1"; return; fi
  local left=$((DEADLINE - $(date +%s)))
  [ "$left" -lt "$1" ] && echo $((left > 1 ? left : 1)) || echo "$1"
}
tb=${TEST_BUILD:-build/test}
rb=${RELEASE_BUILD:-build/release}
pack() { tar -C "$final" -czf "$final/device-check.tar.gz" logs && rm -rf "$final/logs"; }
trap pack EXIT
trap "exit 143" TERM INT
exec > >(tee "$final/summary.txt") 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$out/gpu.txt"
steps=${*:-tests train llama bench}
for step in $steps; do
  if [ -n "${DEADLINE:-}" ] && [ "$(date +%s)" -ge "$((DEADLINE - 5))" ]; then echo "step $step skipped: DEADLINE passed"; continue; fi
  echo "== $step ($(date +%T)) =="
  case $step in
    tests)
      # install.consumer builds an outside project against the installed package: it needs the
      # build machine's -dev packages, and CI runs it; everything else runs here. CTEST_FIRST (a
      # regular expression: the tests that need the device) runs those first, into ctest_first.log,
      # and the step `rest` runs the others (put it last: a DEADLINE then cuts the CPU-only tests, which CI
      # runs anyway, rather than the device's).
      exclude=${CTEST_EXCLUDE:-install}
      if [ -n "${CTEST_FIRST:-}" ]; then
        (cd "$tb" && timeout $(cap ${TESTS_TIMEOUT:-900}) ctest -j12 --timeout $(cap 240) --output-on-failure \
           -LE "$exclude" -R "$CTEST_FIRST" >"$out/ctest_first.log" 2>&1; echo "ctest (device tests) rc $?")
        grep -E "tests passed|Failed|\*\*\*|Not Run" "$out/ctest_first.log" | head -40
      fi
      if [ -z "${CTEST_FIRST:-}" ]; then
        (cd "$tb" && timeout $(cap ${TESTS_TIMEOUT:-900}) ctest -j12 --timeout $(cap 240) --output-on-failure -LE "$exclude" \
           ${CTEST_FLAGS:-} >"$out/ctest.log" 2>&1; echo "ctest rc $?")
        grep -E "tests passed|Failed|\*\*\*|Not Run" "$out/ctest.log" | head -40
        timeout $(cap 120) "$tb"/tests/modules/modules_cuda_test >"$out/cuda_test.log" 2>&1; echo "modules_cuda_test rc $?"
      fi ;;
    rest)
      # With CTEST_FIRST: every test it did not name (the CPU-only ones), into ctest.log.
      (cd "$tb" && timeout $(cap ${TESTS_TIMEOUT:-900}) ctest -j12 --timeout $(cap 240) --output-on-failure \
         -LE "${CTEST_EXCLUDE:-install}" ${CTEST_FIRST:+-E "$CTEST_FIRST"} >"$out/ctest.log" 2>&1; echo "ctest (the rest) rc $?")
      grep -E "tests passed|Failed|\*\*\*|Not Run" "$out/ctest.log" | head -40 ;;
    train)
      for world in 2 4; do
        timeout $(cap 180) "$rb"/trainer/coshard-train --device cuda --world-size "$world" --steps ${TRAIN_STEPS:-300} \
          --metrics "$out/train_w$world.jsonl" >"$out/train_w$world.log" 2>&1
        echo "train world $world rc $?"; tail -2 "$out/train_w$world.log"
      done
      for dtype in f32 bf16; do
        timeout $(cap 180) "$rb"/trainer/coshard-train --device cuda --world-size 1 --steps ${TRAIN_STEPS:-300} --dtype "$dtype" \
          --metrics "$out/train_$dtype.jsonl" >"$out/train_$dtype.log" 2>&1
        echo "train $dtype rc $?"; tail -4 "$out/train_$dtype.log"
      done
      # The optimizer offloaded (pinned memory, NVMe) in bf16, stepped after and during backward.
      for offload in cpu "nvme:$out/swap"; do
        for extra in "" "--step-in-backward --clip 0"; do
          name="offload_${offload%%:*}${extra:+_sib}"
          # shellcheck disable=SC2086  # $extra is two options or none
          timeout $(cap 180) "$rb"/trainer/coshard-train --device cuda --world-size 1 --steps ${TRAIN_STEPS:-300} --dtype bf16 \
            --offload-optimizer "$offload" $extra --metrics "$out/train_$name.jsonl" >"$out/train_$name.log" 2>&1
          echo "train bf16 $name rc $?"; tail -2 "$out/train_$name.log"
        done
      done
      # ZeRO-Infinity in bf16: the optimizer and the parameters on NVMe (stage 3).
      timeout $(cap 180) "$rb"/trainer/coshard-train --device cuda --world-size 1 --steps ${TRAIN_STEPS:-300} --dtype bf16 \
        --offload-optimizer "nvme:$out/swap" --offload-params nvme --metrics "$out/train_params_nvme.jsonl" \
        >"$out/train_params_nvme.log" 2>&1
      echo "train bf16 params_nvme rc $?"; tail -2 "$out/train_params_nvme.log"
      rm -rf "$out/swap" ;;
    tensor)
      tp_args=(--model llama --layers 2 --dim 64 --heads 8 --kv-heads 4 --seq 32 --batch 16 --vocab 256
               --steps "${TRAIN_STEPS_TENSOR:-20}" --lr 0.003 --clip 0.5 --world-size 4 --tensor-parallel 2 --zero-stage 3)
      for device in cpu cuda; do
        timeout $(cap 180) "$rb"/trainer/coshard-train --device "$device" "${tp_args[@]}" \
          --metrics "$out/tensor_$device.jsonl" >"$out/tensor_$device.log" 2>&1
        echo "tensor parallel on $device rc $?"; tail -2 "$out/tensor_$device.log"
      done
      python3 - "$out/tensor_cpu.jsonl" "$out/tensor_cuda.jsonl" <<'PY'
import json, sys
cpu, gpu = ([json.loads(l)["loss"] for l in open(p)] for p in sys.argv[1:])
diff = max(abs(a - b) / abs(a) for a, b in zip(cpu, gpu)) if cpu and len(cpu) == len(gpu) else float("inf")
print(f"  tensor parallel, {len(gpu)} steps on the GPU against {len(cpu)} on the CPU: largest relative loss difference "
      f"{diff:.2e} ({'within' if diff <= 1e-4 else 'NOT within'} 1e-4)")
PY
      ;;
    loss)
      # The cross-entropy fused with the output layer (chunked) against the whole logits' (#52):
      # Llama-100m's 32,000-token vocabulary in bf16, 8 x 1024 rows: the losses, the activation peak and
      # tokens/s of each, from the same binary in one run.
      for kind in whole chunked; do
        timeout $(cap 240) "$rb"/trainer/coshard-train --device cuda --world-size 1 --preset llama-100m --dtype bf16 \
          --seq 1024 --batch 8 --steps 30 --cross-entropy "$kind" --metrics "$out/loss_$kind.jsonl" \
          >"$out/loss_$kind.log" 2>&1
        echo "cross-entropy $kind rc $?"; tail -2 "$out/loss_$kind.log"
      done
      python3 - "$out/loss_whole.jsonl" "$out/loss_chunked.jsonl" <<'PY'
import json, statistics, sys
runs = [[json.loads(l) for l in open(p)] for p in sys.argv[1:]]
for name, rows in zip(("whole", "chunked"), runs):
    print(f"  {name}: loss {rows[0]['loss']:.4f} -> {rows[-1]['loss']:.4f}, peak activation "
          f"{max(r['peak_activation_bytes'] for r in rows) / 2**20:.0f} MiB, tokens/s "
          f"{statistics.median(r['tokens_per_s'] for r in rows[5:]):.0f}")
diff = max(abs(a["loss"] - b["loss"]) / abs(a["loss"]) for a, b in zip(*runs))
print(f"  chunked against whole: largest relative loss difference {diff:.2e} ({'within' if diff <= 2e-2 else 'NOT within'} 2e-2, bf16)")
PY
      ;;
    llama)
      for policy in none full; do
        nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 250 >"$out/llama_${policy}_smi.txt" &
        smi=$!
        timeout $(cap 300) "$rb"/trainer/coshard-train --device cuda --world-size 1 --preset llama-100m --dtype bf16 \
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
      [ "${BENCH_COLLECTIVES:-1}" = 1 ] && for which in Gpu Nccl; do  # apart, so that one failing leaves the other's numbers
        timeout $(cap 240) "$rb"/bench/collectives_bench --benchmark_filter="$which" \
          --benchmark_out="$out/bench_$which.json" --benchmark_out_format=json >"$out/bench_$which.log" 2>&1
        echo "$which bench rc $?"; python3 bench/report.py "$out/bench_$which.json"
      done
      # The fused attention and the multi-tensor AdamW against their unfused baselines, the norms
      # against a device copy.
      timeout $(cap 300) "$rb"/bench/gpu_kernels_bench --benchmark_out="$out/bench_kernels.json" \
        --benchmark_out_format=json >"$out/bench_kernels.log" 2>&1
      echo "kernels bench rc $?"; python3 bench/report.py "$out/bench_kernels.json"
      grep -E "^BM_" "$out/bench_kernels.log"
      echo "cuDNN for BM_CudnnAttention: ${COSHARD_CUDNN_LIBRARY:-none found (the fused kernels run)}"
      # PyTorch's SDPA at the same attention shapes (the fused attention's baseline).
      timeout $(cap 120) python3 bench/sdpa_baseline.py --out "$out/bench_sdpa.json" >"$out/bench_sdpa.log" 2>&1
      echo "sdpa baseline rc $?"; cat "$out/bench_sdpa.log"
      # The engine's parameter streaming from pinned memory against a plain pinned copy (#19 3b).
      [ "${BENCH_STREAM:-1}" = 1 ] && timeout $(cap 180) "$rb"/bench/offload_stream_bench --benchmark_out="$out/bench_stream.json" \
        --benchmark_out_format=json >"$out/bench_stream.log" 2>&1
      echo "stream bench rc $?"; python3 bench/report.py "$out/bench_stream.json" ;;
    compare)
      for preset in ${COMPARE_PRESETS:-gpt2-124m gpt2-1.5b}; do
        name=$preset${COMPARE_NAME:+_$COMPARE_NAME}
        timeout $(cap ${COMPARE_TIMEOUT:-420}) python3 bench/gpu_vs_fsdp.py --preset "$preset" --coshard "$rb"/trainer/coshard-train \
          --workdir "$out" --out "$out/compare_$name.json" ${COMPARE_FLAGS:-} >"$out/compare_$name.log" 2>&1
        echo "compare $name rc $?"; cat "$out/compare_$name.log"
        # COMPARE_VARIANT="NAME ARGS...": coshard alone again with coshard-train ARGS (e.g.
        # "fused --attention fused"), in the same run as the table it is set beside.
        if [ -n "${COMPARE_VARIANT:-}" ]; then
          read -r vname vargs <<<"$COMPARE_VARIANT"
          # shellcheck disable=SC2086  # $vargs is several options
          timeout $(cap ${COMPARE_TIMEOUT:-420}) python3 bench/gpu_vs_fsdp.py --preset "$preset" --skip-torch \
            --coshard "$rb"/trainer/coshard-train --workdir "$out" --out "$out/compare_${name}_$vname.json" \
            ${COMPARE_FLAGS:-} --coshard-args $vargs >"$out/compare_${name}_$vname.log" 2>&1
          echo "compare $name $vname rc $?"; cat "$out/compare_${name}_$vname.log"
        fi
      done
      # One traced run of the smaller GPT (its steps on a device timeline, for the overlap).
      [ "${COMPARE_TRACE:-1}" = 1 ] && timeout $(cap 120) "$rb"/trainer/coshard-train --device cuda --world-size 1 --dtype bf16 --layers 12 \
        --dim 768 --heads 12 --vocab 50257 --seq 1024 --batch 8 --steps 4 --quiet \
        --trace "$out/trace_gpt2-124m.json" >"$out/trace.log" 2>&1
      echo "traced run rc $?" ;;
    offload)
      preset=${OFFLOAD_PRESET:-llama-3.2-3b}
      timeout $(cap "${OFFLOAD_TIMEOUT:-420}") python3 bench/gpu_vs_fsdp.py --preset "$preset" --offload --coshard "$rb"/trainer/coshard-train \
        --workdir "$out" --out "$out/compare_${preset}_offload.json" ${OFFLOAD_FLAGS:-} >"$out/compare_${preset}_offload.log" 2>&1
      echo "offload $preset rc $?"; cat "$out/compare_${preset}_offload.log" ;;
  esac
done
