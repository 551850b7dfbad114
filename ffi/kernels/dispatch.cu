// The dispatch kernel: each token goes once to every peer rank it is routed to (its row, its slots'
// (local expert, rank, weight) and this rank's counts, stored into the peer's staging half), then, once every
// peer's data has landed, each rank expands what it received, and its own tokens straight from x, into the
// layout. A routing of one block (decode sizes) runs at the kernel's start; larger ones are a kernel before it.
#include <algorithm>

#include "launch.h"
#include "protocol.cuh"
#include "routing_one_block.cuh"
#include "rows.cuh"

namespace jax_ep {

namespace {

constexpr int kTableSharedBytes = 128 * 1024;

// A slot as it travels with its token: its local expert on the receiver (-1: not for this rank), its rank
// among the sender's slots of that expert, and its routing weight.
struct StagedSlot {
  int32_t local_expert;
  int32_t rank;
  float weight;
};

// The call, and what the launcher derives from it for the kernels.
struct DispatchParams : DispatchCall {
  int64_t local_experts;
  RoutingScratch s;
  DispatchRegion region;
  Divisor send_pieces, recv_pieces, ranks, peers, tokens, align, experts_per_rank;
  Divisor fill_pieces;  // pieces of the rows that FillRows zeroes (FillPieces)
  bool do_send, do_receive;
  int64_t scratch_words;  // 16-byte words of shared memory before the row tables: the routing's scratch
};

// Position of token t in this rank's send list to rank d, or -1.
__device__ inline int32_t TokenPos(const DispatchParams& p, const int32_t* scratch, int num_ranks, int64_t t, int d) {
  const int32_t local = scratch[p.s.token_local + t * num_ranks + d];
  if (p.s.chunks == 1) return local;
  const int32_t chunk = static_cast<int32_t>(t) >> p.s.chunk_shift;
  const int32_t base = scratch[p.s.chunk_rank + chunk * num_ranks + d];  // both loads at once
  return local < 0 ? -1 : base + local;
}

// Slot (t, k) as rank `dest` receives it.
__device__ inline StagedSlot SlotFor(const DispatchParams& p, const int32_t* scratch, int64_t t, int64_t k, int dest) {
  const int32_t e = p.topk_idx[t * p.topk + k];
  const int32_t local_rank = scratch[p.s.slot_local + t * p.topk + k];  // loads that do not wait for e
  const float weight = p.topk_weights[t * p.topk + k];
  const int32_t first = dest * static_cast<int32_t>(p.local_experts);  // dest's experts: [first, first + L)
  if (e < first || e >= first + p.local_experts) return StagedSlot{-1, 0, 0.0f};
  if (p.s.chunks == 1) return StagedSlot{e - first, local_rank, weight};
  const int32_t chunk = static_cast<int32_t>(t) >> p.s.chunk_shift;
  return StagedSlot{e - first, scratch[p.s.chunk_expert + chunk * p.num_experts + e] + local_rank, weight};
}

// A slot as a peer staged it. Values outside what a sender can write (a region left from another call after a
// failure) become "not for this rank", so they can never index out of bounds.
__device__ inline StagedSlot LoadStagedSlot(const StagedSlot* slot, int64_t local_experts) {
  const int32_t* words = reinterpret_cast<const int32_t*>(slot);
  const StagedSlot s{__ldcg(words), __ldcg(words + 1), __int_as_float(__ldcg(words + 2))};
  if (s.local_expert < 0 || s.local_expert >= local_experts || s.rank < 0) return StagedSlot{-1, 0, 0.0f};
  return s;
}

// A count as a peer staged it, kept within [0, most].
__device__ inline int32_t StagedCount(const int32_t* count, int64_t most) {
  const int32_t value = __ldcg(count);
  return value < 0 ? 0 : (value > most ? static_cast<int32_t>(most) : value);
}

__device__ void PoisonOutputs(const DispatchParams& p, int num_ranks) {
  const int64_t T = p.num_tokens, K = p.topk, R = num_ranks;
  Poison(p.received.x, p.num_rows * p.row_bytes);
  Poison(p.received.weights, p.num_rows * 4);
  Poison(p.received.group_sizes, p.local_experts * 4);
  Poison(p.received.num_dropped, 4);
  Poison(p.received.num_invalid, 4);
  Poison(p.received.expert_load, p.local_experts * 4);
  PoisonStart(p.routed.token_dest_pos, p.routed.slot_dest, T, R, K);
  Poison(p.received.send_counts, R * 4);
  Poison(p.received.recv_rows, R * T * K * 4);
  Poison(p.received.recv_counts, R * 4);
  Poison(p.received.row_slot, p.num_rows * 4);
}

// The receiver's tables, in shared memory: for source r and local expert l, the layout
// position of r's first slot of l (start[r * L + l]: a row in the ragged layout, an index within expert l's
// rows in the expert layout), each segment's first row (ragged), each local expert's slots from all ranks, and
// where the slots the capacity keeps end (the first ones, in source order): a row (ragged), an index (expert).
struct Tables {
  int32_t* start;
  int32_t* seg_start;
  int32_t* total;
  int32_t* keep_end;
  int32_t* recv_count;  // [R] tokens received from each rank
  int32_t* data_end;    // rows up to the end of the last segment (ragged), N (expert)
  int32_t* dropped;     // [kWarps], block 0: each warp's slots that the capacity drops
};
constexpr int64_t kTableArraysOfL = 3;  // seg_start, total, keep_end (and start, R of them)

// total rounded up to a multiple of alignment (which the API keeps at most the capacity, an int32).
__device__ inline int32_t Padded(int32_t total, const Divisor& alignment) {
  return alignment.Divide(total + alignment.value - 1) * alignment.value;
}

// Block-wide exclusive prefix sum of one value per thread (blocks of whole warps, at most kThreads), with one
// barrier: every warp scans the warps' totals itself. Once per kernel: its shared totals are not reused.
__device__ inline int32_t BlockExclusiveSum(int32_t value) {
  __shared__ int32_t warp_totals[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int32_t inclusive = value;
  for (int offset = 1; offset < 32; offset *= 2) {
    const int32_t other = __shfl_up_sync(0xffffffffu, inclusive, offset);
    if (lane >= offset) inclusive += other;
  }
  if (lane == 31) warp_totals[warp] = inclusive;
  __syncthreads();
  int32_t totals = lane < warp ? warp_totals[lane] : 0;  // the warps before this one
  for (int offset = 16; offset > 0; offset /= 2) totals += __shfl_xor_sync(0xffffffffu, totals, offset);
  return inclusive - value + totals;
}

// Block-wide sum of one value per thread, every thread gets it; two barriers, its shared totals reusable.
__device__ inline int64_t BlockSum(int64_t value) {
  __shared__ int64_t warp_sums[kWarps];
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  __syncthreads();  // every thread has read the sums of the call before
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  int64_t total = lane < static_cast<int>(blockDim.x / 32) ? warp_sums[lane] : 0;
  for (int offset = 16; offset > 0; offset /= 2) total += __shfl_xor_sync(0xffffffffu, total, offset);
  return total;
}

// Drop policy "balanced": the largest level c such that the experts' padded segments of min(n_l, c) rows fit in
// the capacity, found by bisection over the block (this thread holds experts [first, last)), or INT32_MAX when
// every slot fits. A few integer operations per local expert and step; only a call that drops slots searches.
__device__ int32_t BalancedLevel(const DispatchParams& p, const Tables& t, int32_t first, int32_t last) {
  auto rows_at = [&](int32_t level) {
    int64_t rows = 0;
    for (int32_t l = first; l < last; ++l) rows += Padded(std::min(t.total[l], level), p.align);
    return BlockSum(rows);
  };
  if (rows_at(INT32_MAX) <= p.capacity) return INT32_MAX;
  int32_t lo = 0, hi = static_cast<int32_t>(p.capacity);  // rows_at(lo) <= C < rows_at(hi + 1)
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (rows_at(mid) <= p.capacity) lo = mid; else hi = mid - 1;
  }
  return lo;
}

// Barriers: after the counts in start[], in the ragged layout's padded prefix (BlockExclusiveSum, and BlockSum's in
// the balanced search), after the tables. Block 0 also writes group_sizes and expert_load, a thread per expert, and
// each warp's dropped slots (WriteCounts sums them).
// kSearch: drop policy "balanced" where slots can drop (p.balanced); an instance of its own, so that the others carry
// none of its code. kOneRank: a group of one GPU (no peers' counts). The loops over a thread's experts (mostly one)
// stay rolled: at small sizes each warp runs its code about once, and the kernel waits on fetching it (Nsight
// Compute's "no instruction" stalls).
template <bool kSearch, bool kOneRank>
__device__ void BuildTables(const DispatchParams& p, const GroupView& g, const Call& call, const int32_t* scratch,
                            Tables t) {
  const int R = kOneRank ? 1 : g.num_ranks, me = kOneRank ? 0 : g.rank;
  const int32_t L = static_cast<int32_t>(p.local_experts);
  const int64_t C = p.capacity;
  const bool writes_counts = blockIdx.x == 0;
  auto staged_by = [&](int r) {  // [L + 1]: r's slots for each local expert, then its tokens
    return reinterpret_cast<const int32_t*>(RegionFrom(g, call, r, p.region.bytes) + p.region.counts);
  };
  for (int r = threadIdx.x; r < R; r += blockDim.x) {
    t.recv_count[r] = r == me ? scratch[p.s.rank_count + me] : StagedCount(staged_by(r) + L, p.num_tokens);
  }
  // Rank r's slots for local expert l into start[r * L + l], a thread per pair: the peers' counts, from L2, all in
  // flight at once, in little code.
  for (int32_t i = threadIdx.x; i < R * L; i += blockDim.x) {
    const int r = i / L;
    const int32_t l = i - r * L;
    t.start[i] = r == me ? scratch[p.s.expert_count + me * L + l]
                         : StagedCount(staged_by(r) + l, p.num_tokens * p.topk);
  }
  __syncthreads();
  // Each thread a run of consecutive experts (one while L <= kThreads): start[r * L + l] within l's segment and
  // total[l], then, once the segments' starts are known, start[] moved to them.
  const int32_t per_thread = (L + kThreads - 1) / kThreads;
  const int32_t first = threadIdx.x * per_thread, last = std::min<int32_t>(L, first + per_thread);
  int32_t mine = 0;
#pragma unroll 1
  for (int32_t l = first; l < last; ++l) {
    int32_t running = 0;
#pragma unroll 1
    for (int r = 0; r < R; ++r) {
      const int32_t count = t.start[r * L + l];
      t.start[r * L + l] = running;
      running += count;
    }
    t.total[l] = running;
    mine += Padded(running, p.align);
  }
  int32_t dropped = 0;
  if (p.expert_layout) {
#pragma unroll 1
    for (int32_t l = first; l < last; ++l) {
      const int32_t total = t.total[l], kept = static_cast<int32_t>(std::min<int64_t>(total, C));
      t.keep_end[l] = kept;
      if (writes_counts) {
        p.received.group_sizes[l] = kept;
        p.received.expert_load[l] = total;
        dropped += total - kept;
      }
    }
    if (threadIdx.x == 0) *t.data_end = static_cast<int32_t>(p.num_rows);
  } else {
    // The segments: "expert" keeps the first C rows of the layout of every slot; "balanced" gives each expert
    // min(n_l, c) rows (and its padding), c as large as fits, so its segments always fit.
    int32_t level = INT32_MAX;
    if constexpr (kSearch) {
      level = BalancedLevel(p, t, first, last);
      mine = 0;
#pragma unroll 1
      for (int32_t l = first; l < last; ++l) mine += Padded(std::min(t.total[l], level), p.align);
    }
    int32_t before = BlockExclusiveSum(mine);
#pragma unroll 1
    for (int32_t l = first; l < last; ++l) {
      t.seg_start[l] = before;
#pragma unroll 1
      for (int r = 0; r < R; ++r) t.start[r * L + l] += before;
      const int32_t total = t.total[l], rows = Padded(std::min(total, level), p.align);
      const int32_t kept = static_cast<int32_t>(std::clamp<int64_t>(C - before, 0, std::min(total, level)));
      t.keep_end[l] = before + kept;
      if (writes_counts) {  // the segment, up to the capacity
        p.received.group_sizes[l] =
            static_cast<int32_t>(std::min<int64_t>(before + rows, C) - std::min<int64_t>(before, C));
        p.received.expert_load[l] = total;
        dropped += total - kept;
      }
      before += rows;
      if (l == L - 1) *t.data_end = static_cast<int32_t>(std::min<int64_t>(before, C));
    }
  }
  if (writes_counts) {
    dropped = __reduce_add_sync(0xffffffffu, dropped);
    if (threadIdx.x % 32 == 0) t.dropped[threadIdx.x / 32] = dropped;
  }
  __syncthreads();
}

// Warp 0 of block 0, after BuildTables: num_dropped, num_invalid, send_counts, recv_counts.
__device__ void WriteCounts(const DispatchParams& p, const GroupView& g, const int32_t* scratch, const Tables& t,
                            int lane) {
  for (int r = lane; r < g.num_ranks; r += 32) {
    p.received.recv_counts[r] = t.recv_count[r];
    p.received.send_counts[r] = scratch[p.s.rank_count + r];
  }
  const int32_t dropped = __reduce_add_sync(0xffffffffu, lane < kWarps ? t.dropped[lane] : 0);
  if (lane == 0) {
    *p.received.num_dropped = dropped;
    *p.received.num_invalid = scratch[p.s.num_invalid];
  }
}

// One warp: the layout rows of a received token's slots (slot(k) gives slot k as received), then a piece of
// the token row from src into all of them. Piece 0 also writes the rows' weights and slots, and recv_rows at
// position i (none when i < 0: a token of this rank's that has no slot here).
template <bool kStaged, typename SlotOf>
__device__ void Expand(const DispatchParams& p, const Tables& t, int source, int64_t i, SlotOf slot, const char* src,
                       int piece, int32_t* held, int lane) {
  const int64_t T = p.num_tokens, K = p.topk, L = p.local_experts;
  int count = 0;
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const int64_t k = k0 + lane;
    int32_t row = -1;
    if (k < K) {
      const StagedSlot s = slot(k);
      if (s.local_expert >= 0) {
        const int64_t at = static_cast<int64_t>(t.start[source * L + s.local_expert]) + s.rank;
        if (at < t.keep_end[s.local_expert]) {
          row = static_cast<int32_t>(p.expert_layout ? s.local_expert * p.capacity + at : at);
        }
      }
      if (piece == 0 && i >= 0) {
        const int64_t id = (source * T + i) * K + k;
        p.received.recv_rows[id] = row;
        if (row >= 0) {
          p.received.weights[row] = s.weight;
          p.received.row_slot[row] = static_cast<int32_t>(id);
        }
      }
    }
    const unsigned rows = __ballot_sync(0xffffffffu, row >= 0);
    if (row >= 0) held[count + __popc(rows & ((1u << lane) - 1))] = row;
    count += __popc(rows);
  }
  __syncwarp();
  int64_t begin, end;
  PieceBytes(p.row_bytes, p.recv_pieces, piece, &begin, &end);
  CopyToRows<kStaged>(src + begin, held, count, p.received.x + begin, p.row_bytes, end - begin, lane);
  __syncwarp();
}

// One warp, rows n0 .. n0 + 31 (a lane each): those that hold no slot get weight 0, and inside the data (alignment
// padding, the expert layout's unused rows) zeros in piece `piece` of x and row_slot kNoSlot; the ragged tail keeps
// its x and gets row_slot kPastData. Piece 0 writes the weights and row_slot.
__device__ void FillRows(const DispatchParams& p, const Tables& t, int32_t n0, int piece, int lane) {
  const int32_t n = n0 + lane;
  bool empty = false, padding = false;
  if (n < p.num_rows) {
    if (p.expert_layout) {
      const int32_t capacity = static_cast<int32_t>(p.capacity);
      padding = empty = n % capacity >= t.keep_end[n / capacity];
    } else if (n >= *t.data_end) {
      empty = true;  // past the data: not padding
    } else {
      int32_t lo = 0, hi = static_cast<int32_t>(p.local_experts);  // the last segment that starts at or before n
      while (hi - lo > 1) {
        const int32_t mid = (lo + hi) / 2;
        if (t.seg_start[mid] <= n) lo = mid; else hi = mid;
      }
      padding = empty = n >= t.keep_end[lo];
    }
  }
  if (empty && piece == 0) {
    p.received.weights[n] = 0.0f;
    p.received.row_slot[n] = padding ? kNoSlot : kPastData;
  }
  int64_t begin, end;
  PieceBytes(p.row_bytes, p.fill_pieces, piece, &begin, &end);
  for (unsigned mask = __ballot_sync(0xffffffffu, padding); mask != 0; mask &= mask - 1) {
    CopyRow(nullptr, p.received.x + static_cast<int64_t>(n0 + __ffs(mask) - 1) * p.row_bytes + begin, end - begin, lane);
  }
}

// A dispatch whose routing is one block runs it here, in every block, into the block's own copy of the routing
// scratch (`scratch`, shared memory, laid out as RoutingScratch): the rest of the kernel reads that copy, so no
// block waits for another or for a load from L2. Block 0 also writes slot_dest and token_dest_pos, and, when a
// later launch of this call reads the routing (a start, or a send launch before an NCCL swap), the scratch in
// global memory. Returns CallMayRun's answer; a call that may not run writes no outputs here (its blocks poison
// them).
__device__ bool RouteAndCheck(const DispatchParams& p, const GroupView& g, const Call& call, Phase phase,
                              uint4* rows_memory, int32_t* scratch) {
  const CountRows rows(kWarps);
  const int32_t num_slots = static_cast<int32_t>(p.num_tokens * p.topk);
  const int32_t e = static_cast<int32_t>(threadIdx.x) < num_slots ? __ldg(p.topk_idx + threadIdx.x) : -1;
  const CallWords words = LoadCallWords(g, p.axis_index);
  const int32_t E = static_cast<int32_t>(p.num_experts);
  OneBlockZero(rows_memory, rows, E, g.num_ranks);
  __syncthreads();
  const OneBlockSlot slot =
      OneBlockCount(rows_memory, rows, e, num_slots, static_cast<int>(p.topk), E, g.num_ranks, p.experts_per_rank);
  const bool may_run = CallMayRun(g, call, words, phase);  // its barrier also ends the counting
  const bool outputs = blockIdx.x == 0 && may_run;
  OneBlockWrite(rows_memory, rows, slot, num_slots, static_cast<int>(p.topk), E, g.num_ranks, p.s, scratch,
                outputs ? p.routed.slot_dest : nullptr, outputs ? p.routed.token_dest_pos : nullptr);
  __syncthreads();  // the row tables overwrite the count rows that OneBlockWrite's threads read
  if (blockIdx.x == 0 && !p.do_receive) {
    for (int64_t i = threadIdx.x; i < p.s.ints; i += blockDim.x) g.scratch[i] = scratch[i];
  }
  return may_run;
}

// kRoute: this launch routes (RouteAndCheck); kSearch: BuildTables<kSearch>; kOneRank: a group of one GPU, whose
// every token comes from x. Separate instances, so that each launch carries only the code it runs (at T=128 each
// warp runs most of the kernel once, and every stretch of code waits on its fetch).
template <bool kRoute, bool kSearch, bool kOneRank>
__global__ void __launch_bounds__(kThreads) DispatchKernel(DispatchParams p, GroupView g) {
  // With the routing in the kernel (RouteAndCheck): its scratch, then its rows, where the row tables go after it.
  extern __shared__ uint4 shared_words[];
  int32_t* table_memory = reinterpret_cast<int32_t*>(shared_words + p.scratch_words);
  __shared__ int32_t held_rows[kWarps][kMaxTopk];
  __shared__ int32_t recv_count[kMaxRanks];
  __shared__ int32_t data_end;
  __shared__ int32_t dropped_of_warp[kWarps];
  const Call call = CurrentCall(g, kOpDispatch, p.origin);
  const GridWarp<kWarps> at;
  const int R = kOneRank ? 1 : g.num_ranks, me = kOneRank ? 0 : g.rank;
  const int64_t T = p.num_tokens, K = p.topk;
  int32_t* own_scratch = reinterpret_cast<int32_t*>(shared_words);
  const int32_t* scratch = kRoute ? own_scratch : g.scratch;
  int32_t* held = held_rows[at.warp];
  const Phase phase = PhaseOf(p.do_send, p.do_receive);
  const bool may_run =
      kRoute ? RouteAndCheck(p, g, call, phase, shared_words + p.scratch_words, own_scratch)
             : CallMayRun(g, call, p.axis_index, phase);
  const uint32_t arrival = p.do_receive ? ArriveCall(g) : 0;

  if (p.do_send) {
    if (p.sent != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *p.sent = 0.0f;
    if (!may_run && phase == Phase::kStart) PoisonStart(p.routed.token_dest_pos, p.routed.slot_dest, T, R, K);
    SendShares(g, call, phase, p.region.bytes, [&](uint32_t share) {
      if (!may_run) return;
      const int64_t first = static_cast<int64_t>(share) * kWarps + at.warp;
      // With one chunk the routing wrote them.
      for (int64_t i = first * 32 + at.lane; p.s.chunks > 1 && i < T * R; i += at.stride * 32) {
        const int32_t t = p.ranks.Divide(static_cast<int32_t>(i));
        p.routed.token_dest_pos[i] = TokenPos(p, scratch, R, t, static_cast<int>(i - t * R));
      }
      if constexpr (!kOneRank) {
        for (int64_t item = first; item < T * (R - 1) * p.send_pieces.value; item += at.stride) {
          const PeerItem up = SplitPeerItem(item, p.send_pieces, p.peers, me);
          const int32_t t = up.token, dest = up.dest;
          const int32_t pos = TokenPos(p, scratch, R, t, dest);
          if (pos < 0) continue;
          StoreTokenPiece(g, call, p.region, p.x, p.row_bytes, t, dest, pos, p.send_pieces, up.piece, at.lane);
          if (up.piece == 0) {
            char* region = RegionAt(g, call, dest, p.region.bytes);
            StagedSlot* slots = reinterpret_cast<StagedSlot*>(region + p.region.meta) + pos * K;
            for (int64_t k = at.lane; k < K; k += 32) slots[k] = SlotFor(p, scratch, t, k, dest);
          }
        }
        if (share == 0 && at.warp == 0) {  // this rank's counts for each peer's local experts
          for (int dest = 0; dest < R; ++dest) {
            if (dest == me) continue;
            int32_t* counts = reinterpret_cast<int32_t*>(RegionAt(g, call, dest, p.region.bytes) + p.region.counts);
            for (int64_t l = at.lane; l < p.local_experts; l += 32) {
              counts[l] = scratch[p.s.expert_count + dest * p.local_experts + l];
            }
            if (at.lane == 0) counts[p.local_experts] = scratch[p.s.rank_count + dest];
          }
        }
      }
    });
  }
  if (!p.do_receive) return;
  if (!kOneRank) NoteSwapDone(g, call);
  if (!may_run || (!kOneRank && !WaitPeers(g, call, p.region.bytes))) {
    PoisonOutputs(p, R);
    FinishCall(g, call, arrival);
    return;
  }

  const int64_t L = p.local_experts;
  const Tables tables{table_memory, table_memory + R * L, table_memory + R * L + L, table_memory + R * L + 2 * L,
                      recv_count, &data_end, dropped_of_warp};
  BuildTables<kSearch, kOneRank>(p, g, call, scratch, tables);
  if (blockIdx.x == 0 && at.warp == 0) WriteCounts(p, g, scratch, tables, at.lane);
  const int64_t token_items = R * T * p.recv_pieces.value;
  const int64_t fill_items = (p.num_rows + 31) / 32 * p.fill_pieces.value;
  for (int64_t item = at.first; item < token_items + fill_items; item += at.stride) {
    if (item >= token_items) {
      const UnitPiece up = SplitItem(item - token_items, p.fill_pieces);
      FillRows(p, tables, up.unit * 32, up.piece, at.lane);
      continue;
    }
    const UnitPiece up = SplitItem(item, p.recv_pieces);
    const int source = kOneRank ? 0 : p.tokens.Divide(up.unit);
    const int32_t i = up.unit - source * static_cast<int32_t>(T);
    if (up.piece == 0 && i >= recv_count[source]) {
      for (int64_t k = at.lane; k < K; k += 32) p.received.recv_rows[(source * T + i) * K + k] = -1;
    }
    if (kOneRank || source == me) {  // i is one of this rank's own tokens: its row comes straight from x
      // Loaded together with the slots: when pos < 0, no slot is for this rank either, and nothing is written.
      const int32_t pos = TokenPos(p, scratch, R, i, me);
      auto slot = [&](int64_t k) { return SlotFor(p, scratch, i, k, me); };
      Expand<false>(p, tables, me, pos, slot, p.x + i * p.row_bytes, up.piece, held, at.lane);
    } else if (i < recv_count[source]) {
      const char* region = RegionFrom(g, call, source, p.region.bytes);
      const StagedSlot* slots = reinterpret_cast<const StagedSlot*>(region + p.region.meta) + i * K;
      auto slot = [&](int64_t k) { return LoadStagedSlot(slots + k, p.local_experts); };
      Expand<true>(p, tables, source, i, slot, region + p.region.rows + i * p.region.stride, up.piece, held, at.lane);
    }
  }
  FinishCall(g, call, arrival);
}

using DispatchKernelType = decltype(&DispatchKernel<false, false, false>);

template <bool kRoute, bool kSearch>
DispatchKernelType Instance(bool one_rank) {
  return one_rank ? DispatchKernel<kRoute, kSearch, true> : DispatchKernel<kRoute, kSearch, false>;
}

// DispatchKernel's instance for a launch.
DispatchKernelType Instance(bool route, bool search, bool one_rank) {
  return route ? (search ? Instance<true, true>(one_rank) : Instance<true, false>(one_rank))
               : (search ? Instance<false, true>(one_rank) : Instance<false, false>(one_rank));
}

// The dispatch's checks and plan: its regions fit a staging half, each phase's pieces per row, and its warp
// items (the receive phase also has items of 32 layout rows, one per piece of them when rows may need zeros).
Status Plan(DispatchParams* p, const GroupView& g, int64_t* send_items, int64_t* recv_items) {
  Status status = CheckStaging(p->region.bytes, g);
  if (!status.ok()) return status;
  const int64_t steps = CopySteps(p->row_bytes), units = p->num_tokens * g.num_ranks;
  p->send_pieces = Divisor(PiecesPerRow(p->num_tokens * (g.num_ranks - 1), steps, g.max_blocks));
  p->recv_pieces = Divisor(PiecesPerRow(units, steps, g.max_blocks));
  p->ranks = Divisor(g.num_ranks);
  p->peers = Divisor(g.num_ranks - 1);
  p->tokens = Divisor(p->num_tokens);
  const int64_t positions = p->s.chunks > 1 ? (units + 31) / 32 : 0;  // token_dest_pos, a thread each
  *send_items = std::max(p->num_tokens * (g.num_ranks - 1) * p->send_pieces.value, positions);
  const int64_t groups = (p->num_rows + 31) / 32;
  const bool zeroes = p->expert_layout || p->align.value > 1;  // only then can rows inside the data be empty
  p->fill_pieces = Divisor(zeroes ? FillPieces(groups, steps, g.max_blocks) : 1);
  *recv_items = units * p->recv_pieces.value + groups * p->fill_pieces.value;
  return CheckItems(std::max(*send_items, *recv_items));
}

}  // namespace

Status LaunchDispatch(const DispatchCall& c, const GroupView& g, const NcclSwap& swap, cudaStream_t stream,
                      Phase phase) {
  const int R = g.num_ranks;
  Status status = CheckLimits(c.topk, c.num_experts);
  if (!status.ok()) return status;
  if (c.num_experts < R || c.num_experts % R != 0 || c.capacity < 1 || c.alignment < 1) {
    return Status::InvalidArgument("num_experts must be a positive multiple of R=" + std::to_string(R) + ", capacity "
                                   "and alignment positive; got num_experts=" + std::to_string(c.num_experts) +
                                   ", capacity=" + std::to_string(c.capacity) + ", alignment=" +
                                   std::to_string(c.alignment));
  }
  if (c.num_rows > kMaxItems) {
    return Status::InvalidArgument("the layout has " + std::to_string(c.num_rows) + " rows, more than the " +
                                   std::to_string(kMaxItems) + " the kernels index");
  }
  DispatchParams p{c};
  p.origin.split_start = phase == Phase::kStart;
  p.local_experts = c.num_experts / R;
  // Where the capacity holds every slot R ranks can route here and its padding, nothing drops, and "balanced" is
  // "expert": the kernel skips its search for the level.
  p.balanced = c.balanced && c.capacity < R * c.num_tokens * c.topk + p.local_experts * (c.alignment - 1);
  p.align = Divisor(c.alignment);
  p.experts_per_rank = Divisor(p.local_experts);
  p.s = RoutingScratch(c.num_tokens, c.topk, c.num_experts, R);
  p.region = DispatchRegion(c.num_tokens, c.topk, p.local_experts, c.row_bytes);
  const size_t tables = static_cast<size_t>((R + kTableArraysOfL) * p.local_experts) * sizeof(int32_t);
  if (tables > static_cast<size_t>(kTableSharedBytes)) {
    return Status::InvalidArgument("the receivers' row tables need " + std::to_string(tables) +
                                   " bytes of shared memory, more than " + std::to_string(kTableSharedBytes));
  }
  int64_t send_items, recv_items;
  status = Plan(&p, g, &send_items, &recv_items);
  if (!status.ok()) return status;
  bool route = false;  // the dispatch kernel's send launch routes
  if (phase != Phase::kFinish) {
    const bool start_only = phase == Phase::kStart && R == 1 && p.s.chunks == 1;  // nothing to send
    const int64_t scratch_words = (p.s.ints + 3) / 4, after_scratch = kTableSharedBytes - scratch_words * 16;
    route = !start_only && static_cast<int64_t>(tables) <= after_scratch &&
            OneBlockFits(c.num_tokens, c.topk, c.num_experts, R, p.s, kThreads, after_scratch);
    if (route) {
      p.scratch_words = scratch_words;
      status = CheckRouting(p.s, g);
      if (!status.ok()) return status;
    } else {
      const RoutingStart start = start_only ? RoutingStart{c.axis_index, c.sent, p.origin} : RoutingStart{};
      status = LaunchRouting(c.topk_idx, c.num_tokens, c.topk, c.num_experts, g, c.routed.slot_dest, c.routed.token_dest_pos,
                             start, stream);
      if (!status.ok() || start_only) return status;
    }
  }
  const size_t rows = route ? static_cast<size_t>(CountRows(kWarps).Bytes(c.num_experts, R)) : 0;
  const size_t shared = static_cast<size_t>(p.scratch_words * 16) + std::max(tables, rows);
  const auto launch = [&](bool send, bool receive, int64_t items) {
    p.do_send = send;
    p.do_receive = receive;
    const bool search = receive && p.balanced;
    const auto kernel = Instance(route && send, search, R == 1);
    kernel<<<BlocksFor(items, g.max_blocks), kThreads, shared, stream>>>(p, g);
    return LaunchStatus("DispatchKernel");
  };
  return RunTransfer(g, swap, p.region.bytes, send_items, recv_items, phase, launch);
}

Status PrepareKernels() {
  Status status = PrepareRoutingKernel();
  if (status.ok()) status = PrepareCombineKernels();
  if (status.ok()) status = PrepareCombineBackwardKernels();
  if (!status.ok()) return status;
  for (int i = 0; i < 8; ++i) {
    const auto kernel = Instance(i & 1, i & 2, i & 4);
    const cudaError_t error =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kTableSharedBytes);
    if (error != cudaSuccess) {
      return Status::Internal(std::string("cudaFuncSetAttribute(DispatchKernel): ") + cudaGetErrorString(error));
    }
  }
  return Status::Ok();
}

}  // namespace jax_ep
