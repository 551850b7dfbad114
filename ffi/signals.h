// Device memory shared by the GPUs of one EP group: signals and the table of every rank's buffers.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace jax_ep {

constexpr int kMaxRanks = 64;

// Lives in each GPU's memory. Peers write arrive/data/counts_in, NCCL counts_by_nccl; the owner reads them.
struct Signals {
  uint64_t arrive[kMaxRanks];          // epoch at which rank r entered the current transfer
  uint64_t data[kMaxRanks];            // epoch at which rank r finished writing its rows here
  int32_t counts_in[2][kMaxRanks];     // rows rank r sends here, double-buffered by epoch parity
  uint64_t epoch;                      // transfers completed by this GPU
  uint32_t blocks_done[2];             // last-block detection of the send and receive kernels
  uint32_t items_taken[2];             // a send kernel's progress through its peer and local work lists
  int32_t counts_by_nccl[kMaxRanks];   // rows rank r sends here when it is reached through NCCL (ncclRecv)
};

struct PeerTable {
  char* recv_buffer[kMaxRanks];
  Signals* signals[kMaxRanks];
};

// Where a kernel of a transfer finds this rank's group.
struct GroupView {
  int rank;
  int num_ranks;
  char* own_buffer;        // this rank's receive buffer
  Signals* signals;        // this rank's signals
  const PeerTable* peers;  // device copy of every rank's buffers and signals
  int64_t timeout_cycles;  // give up waiting for peers after this many SM cycles
  int max_blocks;          // most blocks a kernel of a transfer launches: the SM budget of jax_ep.initialize
  int32_t* missing_peer;   // host-mapped: 1 + the rank a wait gave up on (-1: an NCCL swap), reported next call
  uint64_t nccl_ranks;     // bit r: rank r is reached through NCCL, not by peer stores
  char* outbox;            // rows for the NCCL ranks: region d goes to rank d (null without NCCL ranks)
};

__host__ __device__ inline bool ByNccl(const GroupView& group, int rank) { return (group.nccl_ranks >> rank) & 1; }

}  // namespace jax_ep
