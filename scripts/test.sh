#!/usr/bin/env bash
# Quick start, command 2 (and CI: .ci/run runs exactly this): installs what is missing, builds,
# and runs the whole test suite three ways:
#   build/test  normal build (CUDA compiled when the toolkit is found; CUDA tests skip without a
#               GPU), every test: unit, examples, header checks, install package, the house rules
#   build/tsan  ThreadSanitizer: the runtime, streams, collectives, the ZeRO engine and the trainer (labels async|collectives|engine|trainer)
#   build/asan  AddressSanitizer + UBSan, clang 19: every test, and libFuzzer on every parser of
#               outside input, 10 s each from the seeds in tests/fuzz/corpus and the inputs earlier
#               fuzzing found in tests/fuzz/found (new inputs stay in the build folder); one compile
#               of the libraries serves both (COSHARD_FUZZ)
# Sanitizer builds leave CUDA off: the sanitizers do not see into the CUDA driver. They compile at
# -O1 -g1, leave the header checks to build/test, and the TSan build builds only the tests it runs.
# Every build goes through ccache when it is installed (scripts/ccache.sh): a second clone of the
# same commit on this machine rebuilds from the cache.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install-deps.sh
source scripts/ccache.sh
jobs=$(nproc)
passed=0 failed=0 skipped=0
started=$(date +%s)
stage_rows=() slowest_rows=()

# CPU seconds (user + system) of every finished child so far: wall time depends on what else the
# machine runs; this hardly does.
# (`times` runs in this shell, not in a $(...) subshell, whose children are its own.)
times_file=$(mktemp)
trap 'rm -f "$times_file"' EXIT
children_cpu() {
  times >"$times_file"
  cpu=$(tail -n 1 "$times_file" | awk '{ split($1, u, /[ms]/); split($2, k, /[ms]/); printf "%d", u[1] * 60 + u[2] + k[1] * 60 + k[2] }')
}

# The ten slowest tests of a ctest log, "seconds name", slowest first. (sed -n reads all of sort's
# output: `head` would leave sort writing into a closed pipe, and under pipefail that SIGPIPE
# (exit 141) ended a CI run whose every test had passed.)
slowest_tests() {
  sed -nE 's/^.*Test +#[0-9]+: ([^ ]+) [.* ]+(Passed|\*\*\*Skipped|\*\*\*Failed[^0-9]*|[^0-9]*)[ ]+([0-9.]+) sec.*$/\3 \1/p' "$1" |
    sort -rn | sed -n '1,10p'
}

# Every build links with LLVM's lld (GCC's and clang's drivers both take -fuse-ld=lld): some 60
# test programs a build, each linking the static libraries with their line tables, took GNU ld
# 3.1 s of wall each where lld takes 0.6 (trainer_test, measured here), the same program.
link_args=(-DCMAKE_EXE_LINKER_FLAGS=-fuse-ld=lld -DCMAKE_SHARED_LINKER_FLAGS=-fuse-ld=lld)

configure_build_test() {
  local dir=$1 labels=$2
  shift 2
  local t0 t1 t2 c0 c1 c2
  t0=$(date +%s); children_cpu; c0=$cpu
  cmake -S . -B "$dir" -G Ninja -DCOSHARD_BUILD_BENCH=OFF "${coshard_launcher_args[@]}" "${link_args[@]}" "$@" >/dev/null
  cmake --build "$dir" -j "$jobs"
  t1=$(date +%s); children_cpu; c1=$cpu
  local label_args=()
  [ -n "$labels" ] && label_args=(-L "$labels")
  ctest --test-dir "$dir" --output-on-failure -j "$jobs" "${label_args[@]}" | tee "$dir/ctest.log"
  # Tally for the closing line ("N tests failed out of M"; skipped tests count as passed there).
  local summary total bad skip
  summary=$(grep -E '[0-9]+ tests failed out of [0-9]+' "$dir/ctest.log" | tail -n 1)
  bad=$(sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\1/' <<<"$summary")
  total=$(sed -E 's/.* ([0-9]+) tests failed out of ([0-9]+).*/\2/' <<<"$summary")
  skip=$(grep -c '\*\*\*Skipped' "$dir/ctest.log" || true)
  passed=$((passed + total - bad - skip)) failed=$((failed + bad)) skipped=$((skipped + skip))
  t2=$(date +%s); children_cpu; c2=$cpu
  stage_rows+=("$(printf '%-11s %7d s %7d s %9d s %9d s %6d' "$dir" $((t1 - t0)) $((t2 - t1)) $((c1 - c0)) $((c2 - c1)) "$total")")
  slowest_rows+=("== $dir: the ten slowest tests (seconds) ==" "$(slowest_tests "$dir/ctest.log")")
}

echo "== build/test: all tests =="
# The libraries at -O2 (the code users run) with line tables only, the test programs at -O1: the
# same machine code where it counts, a third less compile time (debug info and the tests' own
# optimisation took it; the sanitizer builds compile so already).
configure_build_test build/test "" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCOSHARD_WERROR=ON \
  "-DCMAKE_CXX_FLAGS_RELWITHDEBINFO=-O2 -g1 -DNDEBUG" "-DCOSHARD_TEST_CODEGEN=-O1"
echo "== build/tsan: ThreadSanitizer (runtime, streams, collectives, ZeRO engine, trainer) =="
TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" \
  configure_build_test build/tsan "async|collectives|engine|trainer" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCOSHARD_SANITIZE=thread -DCOSHARD_CUDA=OFF -DCOSHARD_HEADER_CHECKS=OFF \
  "-DCOSHARD_TEST_LABELS=async;collectives;engine;trainer"
echo "== build/asan: AddressSanitizer + UBSan (everything) and the libFuzzer targets (clang 19) =="
# (build/asan was GCC's until clang's build took the fuzzers in: a folder configured with GCC starts over)
if [ -f build/asan/CMakeCache.txt ] && ! grep -q '^CMAKE_CXX_COMPILER:FILEPATH=.*clang++-19$' build/asan/CMakeCache.txt; then
  rm -rf build/asan/CMakeCache.txt build/asan/CMakeFiles
fi
ASAN_OPTIONS="detect_leaks=1:abort_on_error=1" UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1" \
  CC=clang-19 CXX=clang++-19 configure_build_test build/asan "" -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCOSHARD_SANITIZE=address -DCOSHARD_FUZZ=ON -DCOSHARD_FUZZ_SECONDS=10 -DCOSHARD_CUDA=OFF -DCOSHARD_HEADER_CHECKS=OFF
echo "== all test builds passed =="
echo "== the clock: each build's configure + compile and its tests, wall and CPU seconds (user + system) =="
printf '%-11s %9s %9s %11s %11s %6s\n' build compile tests "compile CPU" "tests CPU" count
printf '%s\n' "${stage_rows[@]}"
echo "total: $(( $(date +%s) - started )) s"
printf '%s\n' "${slowest_rows[@]}"
echo "coshard: $passed passed, $failed failed, $skipped skipped"
