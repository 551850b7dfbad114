// How one block ranks one chunk of a dispatch's routing (topk_idx [T, K]): each slot's rank among this rank's
// slots of its expert, each token's position in the send list to every rank, and the chunk's counts. The routing
// kernel runs it once per chunk into the group's scratch; a dispatch whose routing is one chunk runs it in every
// block of the dispatch kernel instead, into shared memory, so that no routing kernel runs before it.
// Warps take consecutive slots 32 at a time and rank them with __match_any_sync against per-warp counters, so
// every value is the same on every run and for any number of warps.
#pragma once

#include <cstdint>

#include "launch.h"
#include "protocol.cuh"

namespace jax_ep {

// A block of the routing kernel has at most 8 warps, each ranking up to 8 batches of 32 slots: a chunk is at most
// 8 x 8 x 32 slots (T=4096, K=8: 16 blocks). The kernel's time is its instructions (each warp runs the same few
// hundred of fixed cost) and the chains between them, so a few warps with 8 batches each beat 32 warps with 2
// (ncu at T=128 on one H200: docs/performance.md).
constexpr int kRoutingWarps = 8;
constexpr int kBatchesPerWarp = 8;
constexpr int64_t kMaxChunkTokens = kRoutingWarps * 32 * kBatchesPerWarp;  // topk = 1

// RouteChunk's working memory, in a block's dynamic shared memory: each token's ranks, and per warp, its counts
// of each rank's tokens, of invalid slots and of each expert's slots.
struct RoutingShared {
  uint64_t* token_ranks;  // [tokens per chunk]: bit d, the token has a slot on rank d
  int32_t* rank_seen;     // [warps][kMaxRanks]
  int32_t* invalid_seen;  // [warps]
  uint16_t* expert_seen;  // [warps][E], 16-byte aligned
  JAX_EP_HOST_DEVICE static int64_t CountBytes(int64_t warps, int64_t tokens) {
    return tokens * 8 + (warps * (kMaxRanks + 1) * 4 + 15) / 16 * 16;
  }
  JAX_EP_HOST_DEVICE static int64_t Bytes(int64_t warps, int64_t tokens, int64_t num_experts) {
    return CountBytes(warps, tokens) + (warps * num_experts * 2 + 15) / 16 * 16;
  }
  __device__ static RoutingShared At(char* memory, int warps, int64_t tokens) {
    uint64_t* token_ranks = reinterpret_cast<uint64_t*>(memory);
    int32_t* counts = reinterpret_cast<int32_t*>(token_ranks + tokens);
    return RoutingShared{token_ranks, counts, counts + warps * kMaxRanks,
                         reinterpret_cast<uint16_t*>(memory + CountBytes(warps, tokens))};
  }
};

struct RoutingArgs {
  const int32_t* topk_idx;
  int32_t num_tokens;
  int topk;
  int32_t num_experts;
  Divisor local_experts, topk_divisor;
  RoutingScratch s;
  int num_ranks;
  int32_t* slot_dest;       // outputs, written when the check says so
  int32_t* token_dest_pos;  // ... and only by a routing of one chunk (else the dispatch kernel adds the bases)
};

__device__ inline unsigned LanesBelow(int lane) { return (1u << lane) - 1; }

// Exclusive prefix, in place, of the `count` values at values[c * stride] (each read by load); returns their
// total. Eight loads go out at once: the pass is a chain of memory latencies, not arithmetic.
template <typename T, typename Load>
__device__ inline int32_t PrefixInPlace(T* values, int64_t stride, int64_t count, Load load) {
  int32_t running = 0;
  for (int64_t c0 = 0; c0 < count; c0 += 8) {
    int32_t loaded[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) loaded[j] = c0 + j < count ? load(values + (c0 + j) * stride) : 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (c0 + j < count) {
        values[(c0 + j) * stride] = static_cast<T>(running);
        running += loaded[j];
      }
    }
  }
  return running;
}

// Every thread of the block: ranks chunk `chunk` into `scratch` (laid out as RoutingScratch), the chunk's counts
// in chunk_expert/chunk_rank/chunk_invalid (of one chunk: the totals too, and 0 as its base). check() runs, in
// every thread, once the chunk's slots are loading; it returns whether this block writes slot_dest and
// token_dest_pos. Ends with a barrier: the block may read all of its scratch.
template <int kBatches, typename Check>
__device__ void RouteChunk(const RoutingArgs& a, int32_t chunk, RoutingShared sh, int32_t* scratch, Check check) {
  const RoutingScratch& s = a.s;
  const int32_t num_experts = a.num_experts, topk = a.topk;
  const int num_ranks = a.num_ranks;
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t t0 = chunk << s.chunk_shift;
  const int32_t t1 = min(a.num_tokens, t0 + (1 << s.chunk_shift));
  int32_t* slot_local = scratch + s.slot_local;
  int32_t* token_local = scratch + s.token_local;

  // Slots: warp w ranks slots [w * per_warp, (w + 1) * per_warp) of the chunk, in order.
  const int32_t first_slot = t0 * topk;
  const int32_t chunk_slots = (t1 - t0) * topk;  // at most warps * 32 * kBatches
  const int32_t per_warp = (chunk_slots + warps - 1) / warps;
  int32_t expert_of[kBatches], rank_of[kBatches];
#pragma unroll
  for (int b = 0; b < kBatches; ++b) {  // every load in flight at once: the routing is latency-bound
    const int32_t in_warp = b * 32 + lane;
    const int32_t slot = warp * per_warp + in_warp;
    expert_of[b] = in_warp < per_warp && slot < chunk_slots ? __ldg(a.topk_idx + first_slot + slot) : -1;
  }
  const int32_t seen_entries = warps * num_experts;
  const int32_t seen_words = seen_entries / 8;  // 16-byte stores
  for (int32_t i = threadIdx.x; i < seen_words; i += blockDim.x) reinterpret_cast<uint4*>(sh.expert_seen)[i] = uint4{};
  for (int32_t i = seen_words * 8 + threadIdx.x; i < seen_entries; i += blockDim.x) sh.expert_seen[i] = 0;
  for (int i = threadIdx.x; i < warps * kMaxRanks; i += blockDim.x) sh.rank_seen[i] = 0;
  for (int32_t i = threadIdx.x; i < t1 - t0; i += blockDim.x) sh.token_ranks[i] = 0;
  const bool writes = check();
  __syncthreads();

  uint16_t* expert_seen = sh.expert_seen + warp * num_experts;
  int32_t* rank_seen = sh.rank_seen + warp * kMaxRanks;
  int invalid = 0;
#pragma unroll
  for (int b = 0; b < kBatches; ++b) {
    if (b * 32 >= per_warp) break;  // the warp's slots are done (small T)
    const int32_t in_warp = b * 32 + lane;
    const int32_t slot = warp * per_warp + in_warp;
    const bool in = in_warp < per_warp && slot < chunk_slots;
    const int32_t e = expert_of[b];
    const bool valid = in && e >= 0 && e < num_experts;
    invalid += in && !valid && e != -1;
    const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
    const int before = __popc(same & LanesBelow(lane));
    const int seen = valid ? expert_seen[e] : 0;
    __syncwarp();
    if (valid && before == 0) expert_seen[e] = static_cast<uint16_t>(seen + __popc(same));
    __syncwarp();
    expert_of[b] = valid ? e : -1;
    rank_of[b] = seen + before;
    const int32_t dest = valid ? a.local_experts.Divide(e) : -1;
    if (valid) atomicOr(reinterpret_cast<unsigned long long*>(sh.token_ranks + a.topk_divisor.Divide(slot)), 1ull << dest);
    if (in && writes) a.slot_dest[first_slot + slot] = dest;
  }
  for (int offset = 16; offset > 0; offset /= 2) invalid += __shfl_down_sync(0xffffffffu, invalid, offset);
  if (lane == 0) sh.invalid_seen[warp] = invalid;
  __syncthreads();  // every token's ranks

  // Tokens: warp w takes tokens [w * per_warp_tokens, ...) of the chunk, 32 at a time, in order.
  const int32_t chunk_tokens = t1 - t0;
  const int32_t per_warp_tokens = (chunk_tokens + warps - 1) / warps;
  for (int32_t b = 0; b * 32 < per_warp_tokens; ++b) {
    const int32_t in_warp = b * 32 + lane;
    const int32_t t = t0 + warp * per_warp_tokens + in_warp;
    const bool in = in_warp < per_warp_tokens && t < t1;
    const uint64_t ranks = in ? sh.token_ranks[t - t0] : 0;
    for (int d = 0; d < num_ranks; ++d) {
      const bool sends = (ranks >> d) & 1;
      const unsigned senders = __ballot_sync(0xffffffffu, sends);
      const int seen = rank_seen[d];
      if (in) token_local[t * num_ranks + d] = sends ? seen + __popc(senders & LanesBelow(lane)) : -1;
      __syncwarp();
      if (lane == 0) rank_seen[d] = seen + __popc(senders);
      __syncwarp();
    }
  }
  __syncthreads();

  // Per expert and per rank: exclusive prefix over the warps, and the chunk's totals.
  const auto plain = [](const auto* value) { return *value; };
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t running = PrefixInPlace(sh.expert_seen + e, num_experts, warps, plain);
    if (s.chunks == 1) {  // no other chunk: the totals are final, the chunk's base is 0
      scratch[s.expert_count + e] = running;
      running = 0;
    }
    scratch[s.chunk_expert + chunk * num_experts + e] = running;
  }
  for (int d = threadIdx.x; d < num_ranks; d += blockDim.x) {
    int32_t running = PrefixInPlace(sh.rank_seen + d, kMaxRanks, warps, plain);
    if (s.chunks == 1) {
      scratch[s.rank_count + d] = running;
      running = 0;
    }
    scratch[s.chunk_rank + chunk * num_ranks + d] = running;
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < warps; ++w) total += sh.invalid_seen[w];
    scratch[s.chunk_invalid + chunk] = total;
    if (s.chunks == 1) scratch[s.num_invalid] = total;
  }
  __syncthreads();
#pragma unroll
  for (int b = 0; b < kBatches; ++b) {
    if (b * 32 >= per_warp) break;
    const int32_t in_warp = b * 32 + lane;
    const int32_t slot = warp * per_warp + in_warp;
    if (in_warp < per_warp && slot < chunk_slots) {
      slot_local[first_slot + slot] = expert_of[b] < 0 ? -1 : expert_seen[expert_of[b]] + rank_of[b];
    }
  }
  if (warp > 0 || s.chunks == 1) {  // warp 0's offsets are 0
    for (int32_t in_warp = lane; in_warp < per_warp_tokens; in_warp += 32) {
      const int32_t t = t0 + warp * per_warp_tokens + in_warp;
      if (t >= t1) break;
      for (int d = 0; d < num_ranks; ++d) {
        int32_t& pos = token_local[t * num_ranks + d];
        if (pos >= 0) pos += rank_seen[d];
        if (s.chunks == 1 && writes) a.token_dest_pos[t * num_ranks + d] = pos;  // final: no chunk comes before
      }
    }
  }
  __syncthreads();
}

}  // namespace jax_ep
