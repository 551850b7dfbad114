// The routing of one chunk of tokens by one block: each slot's rank among the chunk's slots of its expert, each
// token's position in the chunk's send list to every rank, and the chunk's counts (RoutingScratch). Warps take
// consecutive slots 32 at a time and rank them with __match_any_sync against per-warp counters, so every value
// is the same on every run. The routing kernel runs it once per chunk; a dispatch small enough for one chunk
// runs it in every block of the dispatch kernel, with the scratch in shared memory.
#pragma once

#include <algorithm>

#include "launch.h"
#include "protocol.cuh"

namespace jax_ep {

// A warp ranks at most 2 x 32 slots of a chunk: small chunks spread the routing kernel, which is latency-bound,
// over many SMs (T=4096, K=8: 16 blocks).
constexpr int kBatchesPerWarp = 2;

__device__ inline unsigned LanesBelow(int lane) { return (1u << lane) - 1; }

// Shared memory of one block's routing: expert_seen [warps][E] counters (uint16), rank_seen [warps][R] and
// invalid_seen [warps] (int32).
struct RoutingShared {
  uint16_t* expert_seen;
  int32_t* rank_seen;
  int32_t* invalid_seen;
};

// Block-wide: routes chunk `chunk` (tokens [chunk << s.chunk_shift, ...)) into `scratch` (global or shared), and
// slot_dest (skipped when null). With one chunk the counts are final; otherwise the chunk's totals go to
// s.chunk_expert / chunk_rank / chunk_invalid for the routing kernel's last block. Ends with the block in sync.
__device__ inline void RouteChunk(const int32_t* __restrict__ topk_idx, int64_t num_tokens, int topk,
                                  int64_t num_experts, int num_ranks, const Divisor& local_experts,
                                  const RoutingScratch& s, int32_t* scratch, int32_t* slot_dest, int64_t chunk,
                                  RoutingShared shared) {
  uint16_t* expert_seen = shared.expert_seen;
  int32_t* invalid_seen = shared.invalid_seen;
  auto rank_seen = [&](int w, int d) -> int32_t& { return shared.rank_seen[w * num_ranks + d]; };
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int64_t t0 = chunk * s.tokens_per_chunk;
  const int64_t t1 = std::min<int64_t>(num_tokens, t0 + s.tokens_per_chunk);
  int32_t* slot_local = scratch + s.slot_local;
  int32_t* token_local = scratch + s.token_local;
  const int32_t seen_entries = warps * static_cast<int32_t>(num_experts);
  for (int32_t i = threadIdx.x; i < seen_entries; i += blockDim.x) expert_seen[i] = 0;
  for (int i = threadIdx.x; i < warps * num_ranks; i += blockDim.x) shared.rank_seen[i] = 0;
  __syncthreads();

  // Slots: warp w ranks slots [w * per_warp, (w + 1) * per_warp) of the chunk, in order.
  const int64_t first_slot = t0 * topk;
  const int32_t chunk_slots = static_cast<int32_t>((t1 - t0) * topk);  // at most kThreads * kBatchesPerWarp
  const int32_t per_warp = (chunk_slots + warps - 1) / warps;
  int32_t expert_of[kBatchesPerWarp], rank_of[kBatchesPerWarp];
#pragma unroll
  for (int b = 0; b < kBatchesPerWarp; ++b) {  // every load in flight at once: the kernel is latency-bound
    const int64_t in_warp = b * 32 + lane;
    const int64_t slot = warp * per_warp + in_warp;
    expert_of[b] = in_warp < per_warp && slot < chunk_slots ? __ldg(topk_idx + first_slot + slot) : -1;
  }
  int invalid = 0;
#pragma unroll
  for (int b = 0; b < kBatchesPerWarp; ++b) {
    if (b * 32 >= per_warp) break;  // the warp's slots are done (small T)
    const int64_t in_warp = b * 32 + lane;
    const int64_t slot = warp * per_warp + in_warp;
    const bool in = in_warp < per_warp && slot < chunk_slots;
    const int32_t e = expert_of[b];
    const bool valid = in && e >= 0 && e < num_experts;
    invalid += in && !valid && e != -1;
    const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
    const int before = __popc(same & LanesBelow(lane));
    const int seen = valid ? expert_seen[warp * num_experts + e] : 0;
    __syncwarp();
    if (valid && before == 0) expert_seen[warp * num_experts + e] = static_cast<uint16_t>(seen + __popc(same));
    __syncwarp();
    expert_of[b] = valid ? e : -1;
    rank_of[b] = seen + before;
    if (in && slot_dest != nullptr) slot_dest[first_slot + slot] = valid ? local_experts.Divide(e) : -1;
  }
  for (int offset = 16; offset > 0; offset /= 2) invalid += __shfl_down_sync(0xffffffffu, invalid, offset);
  if (lane == 0) invalid_seen[warp] = invalid;

  // Tokens: warp w takes tokens [w * per_warp_tokens, ...) of the chunk, 32 at a time, in order.
  const int32_t chunk_tokens = static_cast<int32_t>(t1 - t0);
  const int32_t per_warp_tokens = (chunk_tokens + warps - 1) / warps;
  for (int64_t b = 0; b * 32 < per_warp_tokens; ++b) {
    const int64_t in_warp = b * 32 + lane;
    const int64_t t = t0 + warp * per_warp_tokens + in_warp;
    const bool in = in_warp < per_warp_tokens && t < t1;
    uint64_t ranks = 0;
    if (in && topk % 4 == 0 && topk <= 16) {  // 16-byte loads, all in flight at once (rows are 16-byte aligned)
      const int4* row = reinterpret_cast<const int4*>(topk_idx + t * topk);
      int4 ids[4];
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (q < topk / 4) ids[q] = __ldg(row + q);
      }
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        if (q >= topk / 4) break;
        for (const int32_t e : {ids[q].x, ids[q].y, ids[q].z, ids[q].w}) {
          if (e >= 0 && e < num_experts) ranks |= uint64_t{1} << local_experts.Divide(e);
        }
      }
    } else {
      for (int k = 0; in && k < topk; ++k) {
        const int32_t e = topk_idx[t * topk + k];
        if (e >= 0 && e < num_experts) ranks |= uint64_t{1} << local_experts.Divide(e);
      }
    }
    for (int d = 0; d < num_ranks; ++d) {
      const bool sends = (ranks >> d) & 1;
      const unsigned senders = __ballot_sync(0xffffffffu, sends);
      const int seen = rank_seen(warp, d);
      if (in) token_local[t * num_ranks + d] = sends ? seen + __popc(senders & LanesBelow(lane)) : -1;
      __syncwarp();
      if (lane == 0) rank_seen(warp, d) = seen + __popc(senders);
      __syncwarp();
    }
  }
  __syncthreads();

  // Per expert and per rank: exclusive prefix over the warps, and the chunk's totals.
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < warps; ++w) {
      const int32_t count = expert_seen[w * num_experts + e];
      expert_seen[w * num_experts + e] = static_cast<uint16_t>(running);
      running += count;
    }
    if (s.chunks == 1) {  // no other chunk: the totals are final, the chunk's base is 0
      scratch[s.expert_count + e] = running;
      running = 0;
    }
    scratch[s.chunk_expert + chunk * num_experts + e] = running;
  }
  for (int d = threadIdx.x; d < num_ranks; d += blockDim.x) {
    int32_t running = 0;
    for (int w = 0; w < warps; ++w) {
      const int32_t count = rank_seen(w, d);
      rank_seen(w, d) = running;
      running += count;
    }
    if (s.chunks == 1) {
      scratch[s.rank_count + d] = running;
      running = 0;
    }
    scratch[s.chunk_rank + chunk * num_ranks + d] = running;
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < warps; ++w) total += invalid_seen[w];
    scratch[s.chunk_invalid + chunk] = total;
    if (s.chunks == 1) scratch[s.num_invalid] = total;
  }
  __syncthreads();
#pragma unroll
  for (int b = 0; b < kBatchesPerWarp; ++b) {
    if (b * 32 >= per_warp) break;
    const int64_t in_warp = b * 32 + lane;
    const int64_t slot = warp * per_warp + in_warp;
    if (in_warp < per_warp && slot < chunk_slots) {
      slot_local[first_slot + slot] = expert_of[b] < 0 ? -1 : expert_seen[warp * num_experts + expert_of[b]] + rank_of[b];
    }
  }
  if (warp > 0) {
    for (int64_t in_warp = lane; in_warp < per_warp_tokens; in_warp += 32) {
      const int64_t t = t0 + warp * per_warp_tokens + in_warp;
      if (t >= t1) break;
      for (int d = 0; d < num_ranks; ++d) {
        int32_t& pos = token_local[t * num_ranks + d];
        if (pos >= 0) pos += rank_seen(warp, d);
      }
    }
  }

  __syncthreads();
}

}  // namespace jax_ep
