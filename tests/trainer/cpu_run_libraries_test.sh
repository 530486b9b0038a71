#!/usr/bin/env bash
# Issue 60, item 12: the CUDA build's coshard-train, run on the CPU (--help, then one training
# step), loads none of the CUDA libraries it opens at run time: cuBLAS, cuBLASLt, NCCL, cuDNN
# (810 MB, and the start-up time and memory they cost). What it loads is the dynamic loader's own
# account (LD_DEBUG=files: every file mapped, needed or dlopened). The CUDA runtime, which stays
# linked, must be in that account: the account is read right.
#   cpu_run_libraries_test.sh path/to/coshard-train
set -euo pipefail
bin=$(realpath "$1")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cd "$work"
for args in "--help" "--device cpu --steps 1 --quiet --layers 1 --dim 16 --heads 2 --seq 8 --batch 4 --vocab 32"; do
  rm -f "$work"/loader.*
  # shellcheck disable=SC2086  # the arguments are words
  LD_DEBUG=files LD_DEBUG_OUTPUT="$work/loader" "$bin" $args >"$work/output.txt" 2>&1 ||
    { echo "coshard-train $args failed:"; cat "$work/output.txt"; exit 1; }
  loaded=$(cat "$work"/loader.* | grep -o 'file=[^ ]*' | sort -u)
  if ! grep -q 'libcudart' <<<"$loaded"; then
    echo "coshard-train $args: the loader's account names no libcudart (is this a CUDA build?):"
    echo "$loaded"
    exit 1
  fi
  if grep -E 'libcublas|libnccl|libcudnn' <<<"$loaded"; then
    echo "coshard-train $args loaded the libraries above on the CPU"
    exit 1
  fi
  echo "coshard-train $args: $(wc -l <<<"$loaded") files loaded, none of cuBLAS, cuBLASLt, NCCL, cuDNN"
done
