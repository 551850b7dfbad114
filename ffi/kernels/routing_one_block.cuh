// The routing of one block (decode sizes): one slot per thread, every slot ranked at once, and a token's K slots
// in one warp (K a power of two), so that its destination ranks come from shuffles, not a second read of
// topk_idx. It runs as a kernel of its own (routing.cu) or inside the dispatch kernel (dispatch.cu), and gives
// the chunked routing kernel's values. Three steps, with a barrier after each of the first two:
// OneBlockZero, OneBlockCount, OneBlockWrite.
#pragma once

#include <algorithm>
#include <cstdint>

#include "launch.h"
#include "protocol.cuh"

namespace jax_ep {

// Rows of uint16 counts in shared memory, an entry per warp: one row per expert, then one per rank, then an int32
// of invalid ids per warp. A row's prefix over the warps is one to four 16-byte loads, not a chain; rows lie an
// odd number of 16-byte words apart, so that the threads of a quarter warp, reading consecutive rows, hit
// different banks.
struct CountRows {
  int words;   // 16-byte words of a row's counts
  int stride;  // uint16 entries from one row to the next
  JAX_EP_HOST_DEVICE explicit CountRows(int warps) : words((warps + 7) / 8), stride(((warps + 7) / 8 | 1) * 8) {}
  JAX_EP_HOST_DEVICE int64_t Bytes(int64_t num_experts, int64_t num_ranks) const {
    return (num_experts + num_ranks) * stride * 2 + kWarps * 4;
  }
};

// Threads of a one-block routing of T x K slots: the slots rounded up to whole warps.
inline int OneBlockThreads(int64_t num_tokens, int64_t topk) {
  return static_cast<int>(std::max<int64_t>(32, (num_tokens * topk + 31) / 32 * 32));
}

// Whether a routing can be one block of `threads`: one chunk, a slot per thread, K a power of two up to 32, and
// its rows within `shared_bytes`.
inline bool OneBlockFits(int64_t num_tokens, int64_t topk, int64_t num_experts, int64_t num_ranks,
                         const RoutingScratch& s, int threads, int64_t shared_bytes) {
  return s.chunks == 1 && num_tokens * topk <= threads && threads <= kThreads && topk >= 1 && topk <= 32 &&
         (topk & (topk - 1)) == 0 && CountRows(threads / 32).Bytes(num_experts, num_ranks) <= shared_bytes;
}

#ifdef __CUDACC__

__device__ inline unsigned LanesBelow(int lane) { return (1u << lane) - 1; }

// What a thread knows of its slot between OneBlockCount and OneBlockWrite.
struct OneBlockSlot {
  int32_t expert;  // -1: none (padding, -1 or an invalid id)
  int32_t dest;    // the expert's rank, or -1
  int before;      // slots of its expert before it in its warp
  uint64_t ranks;  // bit d: its token goes to rank d (the same in the token's K lanes)
};

// Exclusive prefix, in place, of a row of `words` 16-byte words of uint16 counts (at most 4), from loads that go
// out together; returns the total.
__device__ inline int32_t PrefixOfRow(uint16_t* row, int words) {
  uint4* row_words = reinterpret_cast<uint4*>(row);
  uint4 loaded[4];
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (q < words) loaded[q] = row_words[q];
  }
  uint32_t running = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    if (q >= words) break;
    uint32_t pairs[4] = {loaded[q].x, loaded[q].y, loaded[q].z, loaded[q].w};
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t low = running;
      running += pairs[j] & 0xffff;
      const uint32_t high = running;
      running += pairs[j] >> 16;
      pairs[j] = low | (high << 16);
    }
    row_words[q] = uint4{pairs[0], pairs[1], pairs[2], pairs[3]};
  }
  return static_cast<int32_t>(running);
}

// Step 1: zeroes the rows (`memory`, 16-byte aligned).
__device__ inline void OneBlockZero(uint4* memory, const CountRows& rows, int32_t num_experts, int num_ranks) {
  const int32_t words = (num_experts + num_ranks) * rows.stride / 8;
  for (int32_t i = threadIdx.x; i < words; i += blockDim.x) memory[i] = uint4{};
}

// Step 2: ranks this thread's slot (its topk_idx entry is e) among its warp's slots of the same expert, and counts
// each warp's slots per expert, tokens per rank and invalid ids into the rows.
__device__ inline OneBlockSlot OneBlockCount(uint4* memory, const CountRows& rows, int32_t e, int32_t num_slots,
                                             int topk, int32_t num_experts, int num_ranks, Divisor local_experts) {
  uint16_t* counts = reinterpret_cast<uint16_t*>(memory);
  int32_t* invalid_seen = reinterpret_cast<int32_t*>(counts + (num_experts + num_ranks) * rows.stride);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t slot = threadIdx.x;
  const bool valid = e >= 0 && e < num_experts;
  const int invalid = __reduce_add_sync(0xffffffffu, slot < num_slots && !valid && e != -1);
  if (lane == 0) invalid_seen[warp] = invalid;
  const unsigned same = __match_any_sync(0xffffffffu, valid ? e : -1 - lane);
  OneBlockSlot s;
  s.before = __popc(same & LanesBelow(lane));
  if (valid && s.before == 0) counts[e * rows.stride + warp] = static_cast<uint16_t>(__popc(same));
  s.expert = valid ? e : -1;
  s.dest = valid ? local_experts.Divide(e) : -1;
  s.ranks = valid ? uint64_t{1} << s.dest : 0;
  for (int offset = 1; offset < topk; offset *= 2) s.ranks |= __shfl_xor_sync(0xffffffffu, s.ranks, offset);
  const bool leader = lane % topk == 0 && slot < num_slots;  // lane k = 0 of a token
  for (int d = 0; d < num_ranks; ++d) {
    const unsigned senders = __ballot_sync(0xffffffffu, leader && ((s.ranks >> d) & 1));
    if (lane == 0) counts[(num_experts + d) * rows.stride + warp] = static_cast<uint16_t>(__popc(senders));
  }
  return s;
}

// Step 3: the counts per expert and rank and num_invalid into the scratch, then each slot's rank among this
// rank's slots of its expert and each token's position in its send lists (scratch, token_dest_pos), and
// slot_dest. token_dest_pos and slot_dest may be null.
__device__ inline void OneBlockWrite(uint4* memory, const CountRows& rows, const OneBlockSlot& slot_state,
                                     int32_t num_slots, int topk, int32_t num_experts, int num_ranks,
                                     const RoutingScratch& s, int32_t* scratch, int32_t* slot_dest,
                                     int32_t* token_dest_pos) {
  uint16_t* counts = reinterpret_cast<uint16_t*>(memory);
  const int32_t* invalid_seen = reinterpret_cast<const int32_t*>(counts + (num_experts + num_ranks) * rows.stride);
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  for (int32_t i = threadIdx.x; i < num_experts + num_ranks; i += blockDim.x) {  // rank_count follows expert_count
    scratch[s.expert_count + i] = PrefixOfRow(counts + i * rows.stride, rows.words);
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int w = 0; w < static_cast<int>(blockDim.x / 32); ++w) total += invalid_seen[w];
    scratch[s.num_invalid] = total;
  }
  __syncthreads();

  const int32_t slot = threadIdx.x;
  if (slot < num_slots) {
    scratch[s.slot_local + slot] = slot_state.expert >= 0 ? counts[slot_state.expert * rows.stride + warp] +
                                                                slot_state.before
                                                          : -1;
    if (slot_dest != nullptr) slot_dest[slot] = slot_state.dest;
  }
  const int32_t t = slot / topk;
  const bool leader = lane % topk == 0 && slot < num_slots;
  for (int d = 0; d < num_ranks; ++d) {
    const bool sends = (slot_state.ranks >> d) & 1;
    const unsigned senders = __ballot_sync(0xffffffffu, leader && sends);
    if (leader) {
      const int32_t pos = sends ? counts[(num_experts + d) * rows.stride + warp] + __popc(senders & LanesBelow(lane))
                                : -1;
      scratch[s.token_local + t * num_ranks + d] = pos;
      if (token_dest_pos != nullptr) token_dest_pos[t * num_ranks + d] = pos;
    }
  }
}

#endif  // __CUDACC__

}  // namespace jax_ep
