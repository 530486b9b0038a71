# COSHARD_SANITIZE: one sanitizer configuration per build folder.
#   thread  -> ThreadSanitizer (the runtime, the streams, the collectives)
#   address -> AddressSanitizer + UndefinedBehaviorSanitizer (everything else)
#   fuzz    -> libFuzzer builds (clang only): the fuzz targets in tests/fuzz
if(COSHARD_SANITIZE STREQUAL "thread")
  add_compile_options(-fsanitize=thread -fno-omit-frame-pointer -g -Wno-tsan)
  # Asio's std_fenced_block uses atomic_thread_fence, which TSan does not model (false reports);
  # handler hand-offs are already ordered by the scheduler's mutex.
  add_compile_definitions(ASIO_DISABLE_FENCED_BLOCK)
  add_link_options(-fsanitize=thread)
elseif(COSHARD_SANITIZE STREQUAL "address")
  add_compile_options(-fsanitize=address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer -g)
  add_link_options(-fsanitize=address,undefined)
elseif(COSHARD_SANITIZE STREQUAL "fuzz")
  # libFuzzer (clang): coverage for every library, ASan + UBSan; fuzz targets link -fsanitize=fuzzer.
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "COSHARD_SANITIZE=fuzz needs clang (e.g. CXX=clang++-19), not ${CMAKE_CXX_COMPILER_ID}")
  endif()
  add_compile_options(-fsanitize=fuzzer-no-link,address,undefined -fno-sanitize-recover=undefined
                      -fno-omit-frame-pointer -g)
  add_link_options(-fsanitize=address,undefined)
elseif(NOT COSHARD_SANITIZE STREQUAL "")
  message(FATAL_ERROR "COSHARD_SANITIZE=${COSHARD_SANITIZE}: expected '', 'thread', 'address' or 'fuzz'")
endif()
