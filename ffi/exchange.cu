// The exchange: an all-to-all of rows over peer-mapped memory, synchronized by epoch flags.
//   1. arrive:  write my send counts into each peer, raise my arrive flag there, wait for all arrivals
//               (after that every peer has finished its previous exchange, so its buffer is free);
//   2. send:    store my rows for each peer straight into its receive buffer, then raise my data flag;
//   3. receive: wait for every peer's data flag, copy the received rows into XLA's output.
// Each GPU counts its exchanges in device memory, so every kernel reads the same epoch and a
// captured graph stays valid.
#include "exchange.h"

#include <algorithm>

namespace jax_ep {
namespace {

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;

__device__ uint64_t LoadAcquire(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

__device__ void StoreRelease(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

// Spins until *flag >= epoch; after timeout_cycles marks the exchange as failed and returns.
__device__ void WaitFor(const uint64_t* flag, uint64_t epoch, int64_t timeout_cycles, Signals* signals) {
  const long long start = clock64();
  while (LoadAcquire(flag) < epoch) {
    if (clock64() - start > timeout_cycles) {
      atomicExch(&signals->timed_out, 1);
      return;
    }
  }
}

__device__ uint64_t CurrentEpoch(const Signals* signals) {
  return *reinterpret_cast<const volatile uint64_t*>(&signals->epoch) + 1;
}

// One warp copies one row; 16-byte accesses when the row allows them.
__device__ void CopyRow(const char* __restrict__ src, char* __restrict__ dst, int64_t row_bytes, int lane) {
  if (row_bytes % 16 == 0) {
    const int64_t n = row_bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    int64_t i = lane;
    for (; i + 96 < n; i += 128) {
      const uint4 a = s[i], b = s[i + 32], c = s[i + 64], e = s[i + 96];
      d[i] = a;
      d[i + 32] = b;
      d[i + 64] = c;
      d[i + 96] = e;
    }
    for (; i < n; i += 32) d[i] = s[i];
  } else if (row_bytes % 4 == 0) {
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = lane; i < row_bytes / 4; i += 32) d[i] = s[i];
  } else {
    for (int64_t i = lane; i < row_bytes; i += 32) dst[i] = src[i];
  }
}

// Returns true in exactly one thread: thread 0 of the last block of the grid to get here.
__device__ bool LastBlockDone(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(counter, 1) == gridDim.x - 1;
    if (last) *counter = 0;
  }
  __syncthreads();
  return last && threadIdx.x == 0;
}

__global__ void ArriveKernel(const int32_t* __restrict__ send_counts, int rank, int num_ranks, Signals* signals,
                             const PeerTable* __restrict__ peers, int64_t timeout_cycles) {
  const uint64_t epoch = CurrentEpoch(signals);
  const int peer = threadIdx.x;
  if (peer >= num_ranks) return;
  Signals* remote = peers->signals[peer];
  remote->counts_in[epoch & 1][rank] = send_counts[peer];
  __threadfence_system();
  StoreRelease(&remote->arrive[rank], epoch);
  WaitFor(&signals->arrive[peer], epoch, timeout_cycles, signals);
}

__global__ void SendKernel(const char* __restrict__ send, const int32_t* __restrict__ send_counts, int64_t rows,
                           int64_t row_bytes, int rank, int num_ranks, Signals* signals,
                           const PeerTable* __restrict__ peers) {
  const uint64_t epoch = CurrentEpoch(signals);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = blockIdx.x * kWarps + threadIdx.x / 32; w < num_ranks * rows; w += warps) {
    const int dest = static_cast<int>(w / rows);
    const int64_t row = w % rows;
    if (dest == rank || row >= send_counts[dest]) continue;
    const int64_t offset = (static_cast<int64_t>(rank) * rows + row) * row_bytes;
    CopyRow(send + (dest * rows + row) * row_bytes, peers->recv_buffer[dest] + offset, row_bytes, lane);
  }
  if (LastBlockDone(&signals->blocks_done[0])) {
    for (int peer = 0; peer < num_ranks; ++peer) StoreRelease(&peers->signals[peer]->data[rank], epoch);
  }
}

__global__ void ReceiveKernel(const char* __restrict__ send, char* __restrict__ recv, int32_t* __restrict__ recv_counts,
                              int64_t rows, int64_t row_bytes, int rank, int num_ranks, Signals* signals,
                              const char* __restrict__ recv_buffer, int64_t timeout_cycles) {
  const uint64_t epoch = CurrentEpoch(signals);
  if (threadIdx.x < num_ranks) WaitFor(&signals->data[threadIdx.x], epoch, timeout_cycles, signals);
  __syncthreads();
  const volatile int32_t* counts = signals->counts_in[epoch & 1];
  if (blockIdx.x == 0 && threadIdx.x < num_ranks) recv_counts[threadIdx.x] = counts[threadIdx.x];
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = blockIdx.x * kWarps + threadIdx.x / 32; w < num_ranks * rows; w += warps) {
    const int source = static_cast<int>(w / rows);
    if (w % rows >= counts[source]) continue;
    const int64_t offset = w * row_bytes;
    CopyRow((source == rank ? send : recv_buffer) + offset, recv + offset, row_bytes, lane);
  }
  if (LastBlockDone(&signals->blocks_done[1])) {
    *reinterpret_cast<volatile uint64_t*>(&signals->epoch) = epoch;
  }
}

}  // namespace

cudaError_t LaunchExchange(const char* send, const int32_t* send_counts, char* recv, int32_t* recv_counts,
                           int64_t rows, int64_t row_bytes, int rank, int num_ranks, const char* own_buffer,
                           Signals* signals, const PeerTable* peers, int64_t timeout_cycles, cudaStream_t stream) {
  ArriveKernel<<<1, kMaxRanks, 0, stream>>>(send_counts, rank, num_ranks, signals, peers, timeout_cycles);
  cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  const int64_t units = num_ranks * rows;
  const unsigned blocks = static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(264, (units + kWarps - 1) / kWarps)));
  SendKernel<<<blocks, kThreads, 0, stream>>>(send, send_counts, rows, row_bytes, rank, num_ranks, signals, peers);
  status = cudaGetLastError();
  if (status != cudaSuccess) return status;
  ReceiveKernel<<<blocks, kThreads, 0, stream>>>(send, recv, recv_counts, rows, row_bytes, rank, num_ranks, signals,
                                                 own_buffer, timeout_cycles);
  return cudaGetLastError();
}

}  // namespace jax_ep
