// Kernels of the Local backend on device memory: one launch does one collective for every rank
// of the group at once (the ranks are threads of one process on one GPU, so every rank's buffers
// are reachable from one kernel). Callable from C++23 host code: nvcc compiles C++20 at most, so
// this header includes nothing of coshard's. Each launcher enqueues on `stream` (a
// cudaStream_t) and returns the cudaError_t of the launch as an int.
//
// `dtype` and `op` are collectives::DataType and ReduceOp values (f32 0, f64 1, f16 2, bf16 3,
// i32 4, u8 5; sum 0, avg 1, max 2, min 3). Reductions combine the ranks in order 0..n-1 with the
// same arithmetic as the CPU backend (f16/bf16 in f32, rounded once to nearest even; i32 in
// int64, wrapping; u8 in uint32), so both backends give the same bits.
#pragma once

#include <cstdint>

namespace coshard::collectives::cuda {

constexpr int kMaxRanks = 64;

// Every rank's buffers for one collective (kernel arguments: 1 KiB).
struct RankBuffers {
  const void* send[kMaxRanks];
  void* recv[kMaxRanks];
};

// recv[p][q*bytes ..) = send[q][0 .. bytes) for every p, q (skipping a block onto itself).
int all_gather(void* stream, const RankBuffers& b, int world, std::uint64_t bytes);
// recv[p][q*bytes ..) = send[q][p*bytes ..) for every p, q.
int all_to_all(void* stream, const RankBuffers& b, int world, std::uint64_t bytes);
// recv[p][0 .. bytes) = send[root][0 .. bytes) for every p.
int broadcast(void* stream, const RankBuffers& b, int world, int root, std::uint64_t bytes);
// recv[p][j] = op over q of send[q][p*count + j].
int reduce_scatter(void* stream, const RankBuffers& b, int world, int dtype, int op, std::uint64_t count);
// recv[p][j] = op over q of send[q][j], for every p.
int all_reduce(void* stream, const RankBuffers& b, int world, int dtype, int op, std::uint64_t count);

}  // namespace coshard::collectives::cuda
