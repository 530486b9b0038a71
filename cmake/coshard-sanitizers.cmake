# COSHARD_SANITIZE: one sanitizer configuration per build folder.
#   thread  -> ThreadSanitizer (the runtime, the streams, the collectives)
#   address -> AddressSanitizer + UndefinedBehaviorSanitizer (everything else)
#   fuzz    -> libFuzzer builds (clang only): the fuzz targets in tests/fuzz alone
# COSHARD_FUZZ=ON with address (clang only): the same build also builds and runs the fuzz targets,
#   every library compiled with libFuzzer's coverage (CI's one ASan + UBSan build: the whole suite
#   and the fuzzers on one compile of the libraries, where two builds compiled them twice).
# Every sanitizer build compiles at -O1 with line tables only (-g1): reports keep file and line,
# and the build takes about half the time of -O2 -g (70 s against 37 s for the largest test file
# under ASan), which is most of CI's time. The options come after the build type's, so they win.
set(coshard_sanitizer_codegen -O1 -g1 -fno-omit-frame-pointer)
if(COSHARD_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread ${coshard_sanitizer_codegen} -Wno-tsan)
  # Asio's std_fenced_block uses atomic_thread_fence, which TSan does not model (false reports);
  # handler hand-offs are already ordered by the scheduler's mutex.
  add_compile_definitions(ASIO_DISABLE_FENCED_BLOCK)
  add_link_options(-fsanitize=thread)
elseif(COSHARD_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-sanitize-recover=undefined
                      ${coshard_sanitizer_codegen})
  add_link_options(-fsanitize=address,undefined)
  if(COSHARD_FUZZ)
    if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
      message(FATAL_ERROR "COSHARD_FUZZ=ON needs clang (e.g. CXX=clang++-19), not ${CMAKE_CXX_COMPILER_ID}")
    endif()
    # Coverage for the fuzzers' guidance everywhere but the compute kernels and the tests
    # (cmake/fuzz_coverage_ignore.txt): no parser there, and a callback at every comparison of
    # their loops would slow the suite that runs beside the fuzzers.
    add_compile_options(-fsanitize=fuzzer-no-link
                        -fsanitize-coverage-ignorelist=${CMAKE_CURRENT_LIST_DIR}/fuzz_coverage_ignore.txt)
  endif()
elseif(COSHARD_SANITIZE STREQUAL "fuzz")
  # libFuzzer (clang): coverage for every library, ASan + UBSan; fuzz targets link -fsanitize=fuzzer.
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "COSHARD_SANITIZE=fuzz needs clang (e.g. CXX=clang++-19), not ${CMAKE_CXX_COMPILER_ID}")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
                      ${coshard_sanitizer_codegen})
  add_link_options(-fsanitize=address,undefined)
elseif(COSHARD_FUZZ)
  message(FATAL_ERROR "COSHARD_FUZZ=ON goes with COSHARD_SANITIZE=address (got '${COSHARD_SANITIZE}')")
elseif(NOT COSHARD_SANITIZE STREQUAL "")
  message(FATAL_ERROR "COSHARD_SANITIZE=${COSHARD_SANITIZE}: expected '', 'thread', 'address' or 'fuzz'")
endif()

# coshard_sanitizer_hooks(target): a program's share of the sanitizer build's settings that must be
# compiled into the program itself (TSan reads its default suppressions from a function the
# program defines: cmake/tsan_suppressions.cpp says which and why).
function(coshard_sanitizer_hooks target)
  if(COSHARD_SANITIZE STREQUAL "thread")
    target_sources(${target} PRIVATE ${PROJECT_SOURCE_DIR}/cmake/tsan_suppressions.cpp)
  endif()
endfunction()
