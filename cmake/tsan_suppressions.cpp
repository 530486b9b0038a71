// Linked into the programs of a ThreadSanitizer build (coshard_sanitizer_hooks in
// coshard-sanitizers.cmake): TSan reads these suppressions at start, so a plain `ctest` in the
// build folder needs no TSAN_OPTIONS.
//
// liburing.h: liburing (2.3, Debian 12) maps and unmaps each ring's submission queue with raw
// system calls that TSan never sees. When one rank's Runtime is destroyed its ring's pages go back
// to the kernel, but TSan keeps their history; a ring another rank's thread maps later at the same
// address and writes a submission entry into (asio's io_uring_service::shutdown cancelling its
// reads) is then reported as racing with the first thread's old writes (CI, 2026-11-29:
// TensorParallel.ACheckpointResumesAtAnotherTensorSize). Every write in liburing.h's inline
// functions goes into such kernel-shared ring memory, owned by one io_context and its thread.
extern "C" const char* __tsan_default_suppressions() { return "race:liburing.h\n"; }
