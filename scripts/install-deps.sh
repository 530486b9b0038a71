#!/usr/bin/env bash
# Installs the Debian packages coshard builds against, only the ones that are missing, so it is
# cheap to run before every build. CUDA and NCCL are not installed here: they are found through
# the toolkit on the PATH when present (COSHARD_CUDA=AUTO).
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache
  libasio-dev liburing-dev nlohmann-json3-dev libopenblas-dev libcli11-dev zlib1g-dev
  libspdlog-dev libfmt-dev libprotobuf-dev protobuf-compiler
  libdnnl-dev  # oneDNN: the CPU's bf16/f16 matrix products (AVX512-BF16, AMX)
  libopenmpi-dev openmpi-bin
  iproute2 util-linux  # the simulated cluster of the tests (scripts/netns_cluster.sh: ip, tc, unshare)
  libgtest-dev libgmock-dev libbenchmark-dev
  clang-19 libclang-rt-19-dev
  lld lld-19  # CI's builds link with lld (scripts/test.sh): GNU ld took five times as long
  python3
)

missing=()
for p in "${packages[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep 'install ok installed' >/dev/null; then
    missing+=("$p")
  fi
done

if ((${#missing[@]} == 0)); then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
