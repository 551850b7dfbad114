// Device-side pieces every transfer shares: epoch flags, the last-block signal, and a warp row copy.
//
// A transfer is: arrive (all ranks entered it), send (peer stores, then raise my data flag on every
// peer), receive (wait for every peer's data flag, read my buffer, then advance my epoch). Each GPU
// counts its transfers in device memory, so every kernel of a transfer reads the same epoch and a
// captured graph stays valid.
#pragma once

#include <cstdint>

#include "signals.h"

namespace jax_ep {

// Threads per block of every transfer kernel. A kernel launches at most one block per SM of the budget,
// so it occupies at most that many SMs.
constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

__device__ inline uint64_t LoadAcquire(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}

__device__ inline void StoreRelease(uint64_t* flag, uint64_t value) {
  asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

// Spins until peer's *flag >= epoch. After timeout_cycles it gives up and records the peer in host-mapped
// memory, where the next call's handler finds it and fails; this transfer's output is then invalid. Once a
// peer is recorded missing, waits of transfers already queued give up at once instead of each timing out.
__device__ inline void WaitFor(const uint64_t* flag, uint64_t epoch, int peer, const GroupView& group) {
  volatile int32_t* missing_peer = group.missing_peer;
  const long long start = clock64();
  for (uint32_t spins = 0; LoadAcquire(flag) < epoch; ++spins) {
    if (spins % 64 == 63 && *missing_peer != 0) return;  // a host-mapped read costs a PCIe round trip
    if (clock64() - start > group.timeout_cycles) {
      *missing_peer = peer + 1;
      __threadfence_system();
      return;
    }
  }
}

// The epoch of the transfer in progress on this GPU.
__device__ inline uint64_t CurrentEpoch(const Signals* signals) {
  return *reinterpret_cast<const volatile uint64_t*>(&signals->epoch) + 1;
}

// True in exactly one thread: thread 0 of the last block of the grid to get here. Every block's
// writes, peer stores included, are fenced system-wide before it counts itself done.
__device__ inline bool LastBlockDone(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence_system();
    last = atomicAdd(counter, 1) == gridDim.x - 1;
    if (last) {
      __threadfence();  // acquire: every other block's writes are visible to what the last block does next
      *counter = 0;
    }
  }
  __syncthreads();
  return last && threadIdx.x == 0;
}

// Send kernels end here: the last block resets the work lists and raises this rank's data flag on every peer.
__device__ inline void SignalDataSent(const GroupView& group, uint64_t epoch) {
  if (LastBlockDone(&group.signals->blocks_done[0])) {
    group.signals->items_taken[0] = 0;
    group.signals->items_taken[1] = 0;
    for (int peer = 0; peer < group.num_ranks; ++peer) {
      if (!ByNccl(group, peer)) StoreRelease(&group.peers->signals[peer]->data[group.rank], epoch);
    }
  }
}

// Receive kernels start here: every block waits until all peers' rows have landed (those of NCCL ranks
// landed before the kernel started: the NCCL swap precedes it on the stream).
__device__ inline void WaitDataReceived(const GroupView& group, uint64_t epoch) {
  const int peer = threadIdx.x;
  if (peer < group.num_ranks && !ByNccl(group, peer)) WaitFor(&group.signals->data[peer], epoch, peer, group);
  __syncthreads();
}

// Where this rank's rows for rank `dest` go, each region holding region_bytes: region `rank` of dest's
// receive buffer, or for a rank reached through NCCL, region `dest` of this rank's outbox.
__device__ inline char* SendRegion(const GroupView& group, int dest, int64_t region_bytes) {
  return ByNccl(group, dest) ? group.outbox + dest * region_bytes
                             : group.peers->recv_buffer[dest] + group.rank * region_bytes;
}

// The rows count rank `source` sent with this transfer (LaunchArrive's send_counts).
__device__ inline int32_t CountFrom(const GroupView& group, uint64_t epoch, int source) {
  const volatile int32_t* counts =
      ByNccl(group, source) ? group.signals->counts_by_nccl : group.signals->counts_in[epoch & 1];
  return counts[source];
}

// Receive kernels end here: the last block closes the transfer by advancing the epoch.
__device__ inline void FinishTransfer(const GroupView& group, uint64_t epoch) {
  if (LastBlockDone(&group.signals->blocks_done[1])) {
    *reinterpret_cast<volatile uint64_t*>(&group.signals->epoch) = epoch;
  }
}

// Rows are split into pieces when there are too few rows to keep every warp of the block budget busy
// (small T): one warp then moves one piece. A piece is a run of steps, a step being what a warp moves at
// once (32 lanes x 16 bytes for copies, 32 lanes x a vector of elements for sums).
constexpr int kMaxPieces = 64;

// Pieces per row for `units` rows of `steps` steps each: 1 when the rows alone fill the budget.
inline int PiecesPerRow(int64_t units, int64_t steps, const GroupView& group) {
  const int64_t warps = static_cast<int64_t>(group.max_blocks) * kWarps;
  int64_t pieces = units < 1 ? 1 : (warps + units - 1) / units;
  if (pieces > steps) pieces = steps;
  if (pieces > kMaxPieces) pieces = kMaxPieces;
  return static_cast<int>(pieces < 1 ? 1 : pieces);
}

// Steps [first, last) of piece `piece` of `pieces` near-equal pieces of a row of `steps` steps.
struct Piece {
  int64_t first;
  int64_t last;
};
__host__ __device__ inline Piece PieceOf(int64_t steps, int pieces, int piece) {
  return Piece{steps * piece / pieces, steps * (piece + 1) / pieces};
}

// A work item of a kernel whose rows are split: item = unit * pieces + piece, unit being a row (or token).
// Items are 32-bit (the launchers check that they fit) and unsplit rows cost no division.
struct UnitPiece {
  uint32_t unit;
  int piece;
};
__device__ inline UnitPiece SplitItem(uint32_t item, int pieces) {
  if (pieces == 1) return UnitPiece{item, 0};
  const uint32_t unit = item / static_cast<uint32_t>(pieces);
  return UnitPiece{unit, static_cast<int>(item - unit * static_cast<uint32_t>(pieces))};
}

// The `index`-th rank other than `rank`: peer work lists leave this rank's own rows out.
__device__ inline int OtherRank(uint32_t index, int rank) {
  return static_cast<int>(index) < rank ? static_cast<int>(index) : static_cast<int>(index) + 1;
}

constexpr int64_t kCopyStep = 32 * 16;  // bytes a warp copies at once

// Steps of a row copy; rows whose size is not a multiple of 16 bytes are never split.
__host__ __device__ inline int64_t CopySteps(int64_t row_bytes) {
  return row_bytes % 16 == 0 ? (row_bytes + kCopyStep - 1) / kCopyStep : 1;
}

// Byte range [begin, end) of a piece of a row copy.
__device__ inline void PieceBytes(int64_t row_bytes, int pieces, int piece, int64_t* begin, int64_t* end) {
  if (pieces == 1) {
    *begin = 0;
    *end = row_bytes;
    return;
  }
  const Piece p = PieceOf(CopySteps(row_bytes), pieces, piece);
  *begin = p.first * kCopyStep;
  *end = p.last * kCopyStep < row_bytes ? p.last * kCopyStep : row_bytes;
}

// One warp copies one row (src == nullptr writes zeros); 16-byte accesses when the row allows them.
__device__ inline void CopyRow(const char* __restrict__ src, char* __restrict__ dst, int64_t row_bytes, int lane) {
  if (row_bytes % 16 == 0) {
    const int64_t n = row_bytes / 16;
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4 zero = make_uint4(0, 0, 0, 0);
    int64_t i = lane;
    for (; i + 96 < n; i += 128) {
      const uint4 a = s ? s[i] : zero, b = s ? s[i + 32] : zero, c = s ? s[i + 64] : zero, e = s ? s[i + 96] : zero;
      d[i] = a;
      d[i + 32] = b;
      d[i + 64] = c;
      d[i + 96] = e;
    }
    for (; i < n; i += 32) d[i] = s ? s[i] : zero;
  } else if (row_bytes % 4 == 0) {
    const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst);
    for (int64_t i = lane; i < row_bytes / 4; i += 32) d[i] = s ? s[i] : 0u;
  } else {
    for (int64_t i = lane; i < row_bytes; i += 32) dst[i] = src ? src[i] : 0;
  }
}

// A send kernel's two work lists: peer items (stores to other GPUs over NVLink) and local items (writes
// to this GPU's memory). Warps take one item at a time from counters in the signals: with few items per
// warp (combine's tokens, small T), taking several at once left most warps idle while a few did the work.
// Even blocks start on the peer list and odd blocks on the local one; a warp whose list runs dry helps
// with the other, so NVLink and local memory stay busy at the same time and no warp idles at the end.
template <typename PeerItem, typename LocalItem>
__device__ inline void DrainWorkLists(const GroupView& group, uint32_t num_peer_items, uint32_t num_local_items,
                                      PeerItem peer_item, LocalItem local_item) {
  const int lane = threadIdx.x % 32;
  const bool peer_first = blockIdx.x % 2 == 0;
  for (int pass = 0; pass < 2; ++pass) {
    const bool peer = (pass == 0) == peer_first;
    const uint32_t count = peer ? num_peer_items : num_local_items;
    uint32_t* taken = &group.signals->items_taken[peer ? 0 : 1];
    while (true) {
      uint32_t item = 0;
      if (lane == 0) item = atomicAdd(taken, 1u);
      item = __shfl_sync(0xffffffffu, item, 0);
      if (item >= count) break;
      if (peer) {
        peer_item(item);
      } else {
        local_item(item);
      }
    }
  }
}

// Most work items one kernel may have: item numbers and the work-list counters are 32-bit, and every warp
// takes one more after the end.
constexpr int64_t kMaxItems = (int64_t{1} << 31) - 1;

// Grid size for one warp per unit of work, at most the group's block budget.
inline unsigned BlocksFor(int64_t units, const GroupView& group) {
  const int64_t blocks = (units + kWarps - 1) / kWarps;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > group.max_blocks ? group.max_blocks : blocks));
}

}  // namespace jax_ep
