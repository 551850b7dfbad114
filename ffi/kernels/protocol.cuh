// The transfer protocol, written once: every call of a group, on every GPU, is
//   send:    stores into each peer's staging half (call parity), then whichever block finishes the last share of
//            the send work raises this rank's flag flag[parity][me] = tag on every peer, tag = TagOf(call number,
//            call site, op), and writes the tag at the head of each region bound for a rank reached through NCCL;
//   receive: every block waits until each peer's flag equals the tag exactly (and each NCCL region carries it),
//            reads its own staging half, and the last block to check the call counts it done.
// The send work comes in shares that resident blocks claim (SendShares), so a rank's flags never wait for blocks
// that cannot start while other kernels, such as XLA's collectives, hold SMs: one resident block per GPU is enough
// for every call to progress.
// The two phases are one launch, or two (ranks reached through NCCL, whose swap goes in between, and the split
// ops: a start leaves its call open in Signals::open until its finish; any other call meanwhile gives up).
// A call writes the half of its parity, which every peer last read two calls ago: a peer's flag for this
// call means it finished the call before, so halves are never overwritten while read. A wait that sees
// another tag at this call's number (the ranks issued calls in another order, or took different branches to
// calls of other call sites), passes the timeout, or finds the abort word set, gives up: it records why in
// host-mapped memory and tells every peer, whose calls then give up too. Nothing per call lives on the host, so
// the calls can be captured in CUDA graphs.
#pragma once

#include <cstdint>

#include "launch.h"

namespace jax_ep {

constexpr int kThreads = 1024;
constexpr int kWarps = kThreads / 32;

__device__ inline uint64_t NowNs() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// A poll that leaves L1 alone (an acquire load invalidates all of L1 on every spin): once it sees the value it
// waits for, FenceAcquire() orders the reads after it.
__device__ inline uint64_t LoadRelaxed(const uint64_t* flag) {
  uint64_t value;
  asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(value) : "l"(flag) : "memory");
  return value;
}
__device__ inline void FenceAcquire() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }

// A store that peers see without ordering anything before it: raising several peers' flags takes one
// __threadfence_system() first, not a release (a fence and a round trip) per store.
__device__ inline void StoreRelaxed(uint64_t* flag, uint64_t value) {
  asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(flag), "l"(value) : "memory");
}

__device__ inline uint64_t Volatile(const uint64_t* word) { return *reinterpret_cast<const volatile uint64_t*>(word); }

// The abort word: which failure, seen by which rank, about which rank, and whether another rank relayed it.
constexpr uint64_t kRelayed = uint64_t{1} << 62;
__device__ inline uint64_t AbortWord(int code, int reporter, int peer) {
  return (uint64_t{1} << 63) | (static_cast<uint64_t>(code & 0xff) << 32) |
         (static_cast<uint64_t>(reporter & 0xffff) << 16) | static_cast<uint64_t>(peer & 0xffff);
}

// The call a kernel serves; every kernel of a call reads the same number.
struct Call {
  uint64_t number;    // 1, 2, ... on every GPU of the group alike
  int parity;         // staging half and flag set of this call
  uint64_t tag;
  int op;
  uint32_t instance;  // its FFI instance (CallOrigin)
  bool split_start;   // CallOrigin::split_start
};

// A thread's place in a kernel whose blocks of kBlockWarps warps share items: its lane, its warp in the block, its
// warp's first item and the stride between the warp's items.
template <int kBlockWarps>
struct GridWarp {
  int lane, warp;
  int64_t first, stride;
  __device__ GridWarp()
      : lane(static_cast<int>(threadIdx.x % 32)),
        warp(static_cast<int>(threadIdx.x / 32)),
        first(static_cast<int64_t>(blockIdx.x) * kBlockWarps + threadIdx.x / 32),
        stride(static_cast<int64_t>(gridDim.x) * kBlockWarps) {}
};

__device__ inline Call CurrentCall(const GroupView& g, int op, const CallOrigin& origin) {
  const uint64_t number = Volatile(&g.signals->calls) + 1;
  return Call{number, static_cast<int>(number & 1), TagOf(number, origin.site, op), op, origin.instance,
              origin.split_start};
}

// Whether this is the first call of its FFI instance on this GPU: it waits the first-call timeout.
__device__ inline bool FirstOfInstance(const GroupView& g, const Call& call) {
  const uint32_t word = *reinterpret_cast<const volatile uint32_t*>(&g.signals->first_done[call.instance / 32]);
  return ((word >> (call.instance % 32)) & 1) == 0;
}

// By one thread once a call's launch ends it (a finish's or a whole call's last block, or a split op's start that
// leaves its call open): its FFI instance has made its first call on this GPU. Only this GPU's later kernels read
// the bit. An atomic whose result nobody reads (a reduction): the thread does not wait for it at the end of the
// kernel.
__device__ inline void MarkFirstCallMade(const GroupView& g, const Call& call) {
  atomicOr(&g.signals->first_done[call.instance / 32], 1u << (call.instance % 32));
}

// By one thread: a start leaves its call open for its finish (CallMayRun). The send launch of a whole call with NCCL
// ranks opens it for its own receive launch, whose wait is still its instance's first: there FinishCall marks it.
__device__ inline void OpenCall(const GroupView& g, const Call& call) {
  *reinterpret_cast<volatile uint64_t*>(&g.signals->open) = call.tag;
  if (call.split_start) MarkFirstCallMade(g, call);
}

// Writes the host status from the abort word, once per GPU: the first thread to claim Signals::reported, unless
// the watchdog wrote it first.
__device__ inline void Report(const GroupView& g, const Call& call, uint64_t word, uint64_t seen) {
  volatile HostStatus* status = g.status;
  if (status->code != 0 || atomicCAS(&g.signals->reported, 0u, 1u) != 0u) return;
  const int reporter = static_cast<int>((word >> 16) & 0xffff);
  const bool relayed = (word & kRelayed) != 0;
  if (relayed) {
    __threadfence_system();  // the abort word was read: the reporter's tag, stored before it, is visible
    seen = reporter < kMaxRanks ? Volatile(&g.signals->told[reporter]) : 0;
  }
  status->peer = static_cast<int32_t>(word & 0xffff);
  status->reporter = reporter;
  status->op = call.op;
  status->call = call.number;
  status->tag = call.tag;
  status->seen = seen;
  status->relayed = relayed;
  __threadfence_system();
  status->code = static_cast<int32_t>((word >> 32) & 0xff);
  __threadfence_system();
}

// Records a failure seen by this rank and tells every peer-store rank, whose waits then give up at once, with
// this rank's own call tag first (Signals::told): a peer at the same position names the call this rank ran.
__device__ inline void Fail(const GroupView& g, const Call& call, int code, int peer, uint64_t seen) {
  const uint64_t word = AbortWord(code, g.rank, peer);
  const auto old = atomicCAS_system(reinterpret_cast<unsigned long long*>(&g.signals->abort), 0ull, word);
  if (old != 0) {
    Report(g, call, old, seen);
    return;
  }
  Report(g, call, word, seen);
  for (int r = 0; r < g.num_ranks; ++r) {
    if (r != g.rank && !ByNccl(g.nccl_ranks, r)) StoreRelaxed(&g.peers->signals[r]->told[g.rank], call.tag);
  }
  __threadfence_system();  // the tags before the abort words
  const uint64_t told = word | kRelayed;
  for (int r = 0; r < g.num_ranks; ++r) {
    if (r == g.rank || ByNccl(g.nccl_ranks, r)) continue;
    // A plain store: PCIe P2P often lacks remote atomics, and any nonzero word stops the peer.
    StoreRelaxed(&g.peers->signals[r]->abort, told);
  }
  __threadfence_system();
}

// True when the group is out of step (this GPU's abort word, read as `word`, is set, or, with NCCL ranks and
// `host`, the watchdog recorded a failed swap); the host status then says why.
__device__ inline bool Aborted(const GroupView& g, const Call& call, uint64_t word, bool host = true) {
  if (word != 0) {
    Report(g, call, word, 0);
    return true;
  }
  if (g.nccl_ranks == 0 || !host) return false;
  const volatile HostStatus* status = g.status;
  if (status->code == 0) return false;
  // The watchdog recorded a failed NCCL swap on the host: set the abort word too, so that this GPU's later
  // calls and its peer-store peers give up as well.
  Fail(g, call, status->code, status->peer, 0);
  return true;
}
__device__ inline bool Aborted(const GroupView& g, const Call& call) {
  return Aborted(g, call, Volatile(&g.signals->abort));
}

// The phase of a launch that runs these halves of a transfer kernel.
__device__ inline Phase PhaseOf(bool send, bool receive) {
  return send && receive ? Phase::kWhole : (send ? Phase::kStart : Phase::kFinish);
}

// What a call check reads, loaded together by thread 0 before any of it is checked (ncu at T=128 on one H200:
// the dispatch and combine kernels 0.5 us shorter than when the check read them in turn).
struct CallWords {
  int32_t axis;
  uint64_t open, abort;
};
__device__ inline CallWords LoadCallWords(const GroupView& g, const int32_t* axis_index) {
  if (threadIdx.x != 0) return CallWords{};
  return CallWords{__ldg(axis_index), Volatile(&g.signals->open), Volatile(&g.signals->abort)};
}

// Block-wide: whether this call may go on. Call at a kernel's start, by every block. A finish needs its own
// start's call open; anything else needs no call open.
__device__ inline bool CallMayRun(const GroupView& g, const Call& call, const CallWords& words, Phase phase) {
  __shared__ int ok;
  if (threadIdx.x == 0) {
    ok = !Aborted(g, call, words.abort);
    if (ok && words.axis != g.rank) {
      Fail(g, call, kWrongRank, words.axis, 0);
      ok = 0;
    }
    if (ok && words.open != (phase == Phase::kFinish ? call.tag : 0)) {
      Fail(g, call, kSplitOpen, g.rank, words.open);
      ok = 0;
    }
  }
  __syncthreads();
  return ok;
}
__device__ inline bool CallMayRun(const GroupView& g, const Call& call, const int32_t* axis_index, Phase phase) {
  return CallMayRun(g, call, LoadCallWords(g, axis_index), phase);
}

// What a block's writes must reach before it counts itself done in LastBlock: nothing (the last block reads
// none of them, and the next kernel on this GPU sees them all), this GPU (the last block reads them), or every
// GPU of the group (peers read them once the last block raises their flags).
enum class Fence { kNone, kGpu, kSystem };

// Block-uniform: true in the last block of the grid to get here (once per launch). A grid of one block needs
// no counting.
template <Fence kFence>
__device__ inline bool LastBlock(uint32_t* counter) {
  __shared__ bool last;
  __syncthreads();
  if (gridDim.x == 1) return true;
  if (threadIdx.x == 0) {
    if constexpr (kFence == Fence::kSystem) {
      __threadfence_system();
    } else if constexpr (kFence == Fence::kGpu) {
      __threadfence();
    }
    last = atomicAdd(counter, 1u) == gridDim.x - 1;
    if (last) {
      if constexpr (kFence != Fence::kNone) __threadfence();  // acquire: the others' writes, for the last block
      *counter = 0;
    }
  }
  __syncthreads();
  return last;
}

// Where rank `source`'s region of this call is on this GPU: in the staging half of the call's parity, or for
// a rank reached through NCCL, in the inbox the swap filled.
__device__ inline const char* RegionFrom(const GroupView& g, const Call& call, int source, int64_t region_bytes) {
  if (ByNccl(g.nccl_ranks, source)) return g.inbox + source * region_bytes;
  return g.staging + call.parity * g.half_bytes + source * region_bytes;
}

// Where this rank stores its region for rank `dest`: in dest's staging half, or for a rank reached through
// NCCL, in region `dest` of this GPU's outbox, which the swap delivers.
__device__ inline char* RegionAt(const GroupView& g, const Call& call, int dest, int64_t region_bytes) {
  if (ByNccl(g.nccl_ranks, dest)) return g.outbox + dest * region_bytes;
  return g.peers->staging[dest] + call.parity * g.half_bytes + g.rank * region_bytes;
}

// The flags of a call whose send work every share finished: with NCCL ranks, first tells the watchdog that a swap
// is about to be enqueued; then, unless the group gave up, raises this rank's flag on every peer-store rank and
// writes the tag at the head of each outbox region (a rank that gave up sends its stale region, which the
// receiver then refuses: WaitPeers).
__device__ inline void RaiseFlags(const GroupView& g, const Call& call, int64_t region_bytes) {
  if (g.nccl_ranks != 0) {  // the swap follows this kernel whatever happened: the watchdog watches it
    volatile HostStatus* status = g.status;
    status->nccl_first = FirstOfInstance(g, call);
    __threadfence_system();
    status->nccl_started = call.number;
    __threadfence_system();
  }
  if (Aborted(g, call)) return;  // a share of this call gave up, or will: its data is not there
  __threadfence_system();        // every share's stores (LastBlock's acquire) before any flag
  for (int r = 0; r < g.num_ranks; ++r) {
    if (r == g.rank) continue;
    if (ByNccl(g.nccl_ranks, r)) {
      *reinterpret_cast<uint64_t*>(RegionAt(g, call, r, region_bytes)) = call.tag;  // the swap is stream-ordered
    } else {
      StoreRelaxed(&g.peers->signals[r]->flag[call.parity][g.rank], call.tag);
    }
  }
}

// A launch's send phase: work(share) does what block `share` of the grid would send (use it, not blockIdx.x, for
// any split of the send work). With peers, resident blocks claim shares (Signals::send_next) until none remain,
// and whoever finishes the last one raises the flags; the last claim, made once every block has checked the call
// (CallMayRun), rearms the counter and leaves a start's call open. A group of one rank waits for nobody: each block
// does its own share, and a start only leaves the call open, for its finish, a later kernel on this GPU.
template <typename Work>
__device__ inline void SendShares(const GroupView& g, const Call& call, Phase phase, int64_t region_bytes, Work work) {
  if (g.num_ranks == 1) {
    work(blockIdx.x);
    if (phase == Phase::kStart && LastBlock<Fence::kNone>(&g.signals->send_done) && threadIdx.x == 0) {
      OpenCall(g, call);
    }
    return;
  }
  __shared__ uint32_t claimed;
  for (;;) {
    __syncthreads();  // every thread has read the claim before
    if (threadIdx.x == 0) claimed = atomicAdd(&g.signals->send_next, 1u);
    __syncthreads();
    const uint32_t share = claimed;
    if (share >= gridDim.x) {
      if (threadIdx.x == 0 && share == 2 * gridDim.x - 1) {  // each block's one failed claim: this is the last
        g.signals->send_next = 0;
        if (phase == Phase::kStart) OpenCall(g, call);
      }
      return;
    }
    work(share);
    if (LastBlock<Fence::kSystem>(&g.signals->send_done) && threadIdx.x == 0) RaiseFlags(g, call, region_bytes);
  }
}

// The start of a receive kernel: with NCCL ranks, the swap before it has finished (stream order).
__device__ inline void NoteSwapDone(const GroupView& g, const Call& call) {
  if (g.nccl_ranks != 0 && blockIdx.x == 0 && threadIdx.x == 0) {
    reinterpret_cast<volatile HostStatus*>(g.status)->nccl_done = call.number;
  }
}

// Every block, before it reads its staging half: waits until every peer-store rank's data for this call has
// landed, and checks that every region from an NCCL rank (landed before the kernel started) carries this call's
// tag. False when the call gives up.
__device__ inline bool WaitPeers(const GroupView& g, const Call& call, int64_t region_bytes) {
  if (g.num_ranks == 1) return true;  // nobody to wait for, and nobody else writes the abort word CallMayRun read
  __shared__ int failed;
  if (threadIdx.x == 0) failed = 0;
  __syncthreads();
  const int peer = threadIdx.x;
  if (peer < g.num_ranks && peer != g.rank && ByNccl(g.nccl_ranks, peer)) {
    const uint64_t seen = __ldcg(reinterpret_cast<const unsigned long long*>(RegionFrom(g, call, peer, region_bytes)));
    if (seen != call.tag) {  // another call at this position, or the region of a rank that gave up on it
      Fail(g, call, (seen >> kTagNumberShift) == call.number ? kOutOfOrder : kStaleRegion, peer, seen);
      failed = 1;
    }
  } else if (peer < g.num_ranks && peer != g.rank) {
    const uint64_t* flag = &g.signals->flag[call.parity][peer];
    const uint64_t start = NowNs();
    const uint64_t timeout = FirstOfInstance(g, call) ? g.first_timeout_ns : g.timeout_ns;
    for (uint32_t spin = 0;; ++spin) {
      const uint64_t seen = LoadRelaxed(flag);
      if (seen == call.tag) break;
      if ((seen >> kTagNumberShift) >= call.number) {
        Fail(g, call, kOutOfOrder, peer, seen);
        failed = 1;
        break;
      }
      if (spin % 32 == 31) {
        // The host status (NCCL ranks' watchdog) is read over PCIe: only every 1024 spins.
        if (Aborted(g, call, Volatile(&g.signals->abort), spin % 1024 == 1023)) {
          failed = 1;
          break;
        }
        if (NowNs() - start > timeout) {
          Fail(g, call, kMissingPeer, peer, seen);
          failed = 1;
          break;
        }
      }
    }
    FenceAcquire();
  }
  if (threadIdx.x == 0 && Aborted(g, call)) failed = 1;
  __syncthreads();
  return failed == 0;
}

// Every block of a launch that ends a call, after CallMayRun, whose barrier comes after its threads read the call's
// number and the open word: counts the block in. Thread 0 keeps the block's place for FinishCall.
__device__ inline uint32_t ArriveCall(const GroupView& g) {
  return threadIdx.x == 0 ? atomicAdd(&g.signals->kernel_done, 1u) : 0;
}

// Every block ends a call here. The last block to arrive (ArriveCall) counts the call done on this GPU, closes
// it and marks its FFI instance's first call made: every block has read these words by then, and only this GPU's
// later kernels read them again, so nothing waits for the other blocks' ends, and nothing fences.
__device__ inline void FinishCall(const GroupView& g, const Call& call, uint32_t arrival) {
  if (threadIdx.x == 0 && arrival == gridDim.x - 1) {
    g.signals->kernel_done = 0;
    *reinterpret_cast<volatile uint64_t*>(&g.signals->open) = 0;
    *reinterpret_cast<volatile uint64_t*>(&g.signals->calls) = call.number;
    MarkFirstCallMade(g, call);
  }
}

}  // namespace jax_ep
