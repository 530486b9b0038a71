# Sourced by the build scripts: ccache as the compiler launcher of every build they configure, set
# up so that a fresh clone in another folder reuses what this machine compiled before.
#   base_dir = the clone's root: absolute paths under it (sources, includes, generated files in
#              build/) reach the compiler's hash relative to the build folder, the same in
#              every clone that uses the same build folder names;
#   hash_dir = false: the build folder's absolute path is not hashed (line tables then name the
#              first clone's folder in DW_AT_comp_dir, which nothing here reads);
#   max_size = COSHARD_CCACHE_SIZE (default 8G; the four CI builds take about 3 GiB).
# The cache is ccache's own (CCACHE_DIR, default ~/.cache/ccache). Without ccache, or with
# COSHARD_CCACHE=0, the builds run without a launcher, as before.
# Sets coshard_launcher_args: the -D options to pass to `cmake -S . -B ...`.
coshard_launcher_args=()
if [ "${COSHARD_CCACHE:-1}" != 0 ] && command -v ccache >/dev/null 2>&1; then
  export CCACHE_BASEDIR="$PWD"
  export CCACHE_NOHASHDIR=true
  export CCACHE_MAXSIZE="${COSHARD_CCACHE_SIZE:-8G}"
  # The test programs' precompiled header (tests/CMakeLists.txt): without these ccache compiles
  # every file that uses one, and caches none of them.
  export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
  # The cache's own bound, written to its configuration so a plain `ccache` call honours it too.
  ccache --max-size "$CCACHE_MAXSIZE" >/dev/null 2>&1 || true
  coshard_launcher_args=(-DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache
                         -DCMAKE_CUDA_COMPILER_LAUNCHER=ccache)
fi
