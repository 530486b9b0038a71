# Sourced on a lent GPU machine, in the repository root, after scripts/device_bundle.sh made
# .device/bundle.tar.xz here: unpacks the builds in place, makes the absolute paths the tests
# were built with valid, and finds the CUDA and NCCL libraries the image has.
#   source scripts/device_env.sh
# Python's tarfile reads xz where the image has no xz program.
if command -v xz >/dev/null; then xz -dc .device/bundle.tar.xz | tar -xf - -C .
else python3 -c "import tarfile; tarfile.open('.device/bundle.tar.xz').extractall('.', filter='fully_trusted')"; fi
# The build's absolute paths name the folder it was made from (.device/source_dir): link it here.
built_in=$(cat .device/source_dir 2>/dev/null || echo /work/main)
if [ "$(pwd -P)" != "$built_in" ] && [ ! -e "$built_in" ]; then
  mkdir -p "$(dirname "$built_in")" && ln -s "$(pwd -P)" "$built_in"
fi
# The Python and CMake named by the tests: the machine's own where those paths do not exist there.
for tool in python:python3 cmake:cmake; do
  named=$(cat ".device/${tool%%:*}" 2>/dev/null)
  own=$(command -v "${tool##*:}")
  if [ -n "$named" ] && [ ! -e "$named" ] && [ -n "$own" ]; then mkdir -p "$(dirname "$named")" && ln -s "$own" "$named"; fi
done
# The CUDA runtime is linked; cuBLAS, cuBLASLt and NCCL are opened at run time, from the loader's
# search path among other places: the image's copies go on it.
libdirs=$(pwd -P)/.device/lib
for name in libcudart.so.13 libcublas.so.13 libcublasLt.so.13 libnccl.so.2; do
  found=$(find /usr/local /usr/lib /opt -name "$name" 2>/dev/null | head -1)
  if [ -n "$found" ]; then libdirs=$libdirs:$(dirname "$found"); else echo "device_env: $name not found" >&2; fi
done
# The lib folder of one of PyTorch's nvidia packages (nvidia/cudnn/lib, ...), where Python has it.
torch_lib_dir() {
  python3 -c "import nvidia.$1, os; print(os.path.join(list(nvidia.$1.__path__)[0], 'lib'))" 2>/dev/null
}
# cuBLAS (with its cuBLASLt) and NCCL: PyTorch's where it brings the versions this build opens,
# named first to coshard (COSHARD_CUBLAS_LIBRARY, COSHARD_NCCL_LIBRARY); else the image's above.
cublas_dir=$(torch_lib_dir cublas)
if [ -n "$cublas_dir" ] && [ -e "$cublas_dir/libcublas.so.13" ] && [ -e "$cublas_dir/libcublasLt.so.13" ]; then
  export COSHARD_CUBLAS_LIBRARY=$cublas_dir
fi
nccl_dir=$(torch_lib_dir nccl)
if [ -n "$nccl_dir" ] && [ -e "$nccl_dir/libnccl.so.2" ]; then
  export COSHARD_NCCL_LIBRARY=$nccl_dir
fi
# cuDNN for --attention cudnn: the one PyTorch brings (its nvidia/cudnn package), opened at run
# time by coshard (COSHARD_CUDNN_LIBRARY) and found beside it by cuDNN's own libraries.
cudnn_dir=$(torch_lib_dir cudnn)
if [ -n "$cudnn_dir" ] && [ -e "$cudnn_dir/libcudnn_graph.so.9" ]; then
  export COSHARD_CUDNN_LIBRARY=$cudnn_dir
  libdirs=$libdirs:$cudnn_dir
else
  echo "device_env: PyTorch's cuDNN (nvidia/cudnn/lib/libcudnn_graph.so.9) not found: --attention cudnn runs the fused kernels" >&2
fi
export LD_LIBRARY_PATH=$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
echo "device_env: LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
echo "device_env: COSHARD_CUBLAS_LIBRARY=${COSHARD_CUBLAS_LIBRARY:-} COSHARD_NCCL_LIBRARY=${COSHARD_NCCL_LIBRARY:-}" \
  "COSHARD_CUDNN_LIBRARY=${COSHARD_CUDNN_LIBRARY:-}"
