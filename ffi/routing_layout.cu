// Routing layout of one rank: deterministic block scans, one block per destination rank,
// one per expert, and one for the invalid slots, so every output element is written once.
// Blocks are 1024 threads and each thread holds several consecutive items in registers: a rank block
// covers 4096 tokens per scan, an expert block 16384 slots (T=4096, K=8: one and two scans).
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels.h"

namespace jax_ep {
namespace {

constexpr int kThreads = 1024;
constexpr int kTokensPerThread = 4;
constexpr int kSlotsPerThread = 16;

using BlockScan = cub::BlockScan<int32_t, kThreads>;

// Exclusive scan of one value per thread; chunk_total gets their sum.
__device__ int32_t ScanChunk(BlockScan::TempStorage& storage, int32_t value, int32_t& chunk_total) {
  int32_t offset;
  BlockScan(storage).ExclusiveSum(value, offset, chunk_total);
  __syncthreads();
  return offset;
}

__device__ bool IsValid(int32_t expert, int64_t num_experts) { return expert >= 0 && expert < num_experts; }

// Slots [first, first + kSlotsPerThread) of topk_idx, -1 past num_slots; 16-byte loads where aligned.
__device__ void LoadSlots(const int32_t* __restrict__ topk_idx, int64_t first, int64_t num_slots,
                          int32_t (&ids)[kSlotsPerThread]) {
  if (first + kSlotsPerThread <= num_slots && reinterpret_cast<uintptr_t>(topk_idx + first) % 16 == 0) {
#pragma unroll
    for (int q = 0; q < kSlotsPerThread / 4; ++q) {
      const int4 four = reinterpret_cast<const int4*>(topk_idx + first)[q];
      ids[4 * q] = four.x;
      ids[4 * q + 1] = four.y;
      ids[4 * q + 2] = four.z;
      ids[4 * q + 3] = four.w;
    }
  } else {
#pragma unroll
    for (int j = 0; j < kSlotsPerThread; ++j) ids[j] = first + j < num_slots ? topk_idx[first + j] : -1;
  }
}

__global__ void __launch_bounds__(kThreads)
    RoutingLayoutKernel(const int32_t* __restrict__ topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                        int64_t num_ranks, int32_t* __restrict__ token_dest_pos,
                        int32_t* __restrict__ rank_token_count, int32_t* __restrict__ expert_count,
                        int32_t* __restrict__ slot_rank, int32_t* __restrict__ num_invalid) {
  __shared__ BlockScan::TempStorage scan;
  const int64_t local_experts = num_experts / num_ranks;
  const int64_t num_slots = num_tokens * topk;
  int32_t running = 0;
  if (blockIdx.x < num_ranks) {
    // Position of each token in the send list to this rank; a thread takes kTokensPerThread consecutive tokens.
    const int64_t rank = blockIdx.x;
    for (int64_t base = 0; base < num_tokens; base += kThreads * kTokensPerThread) {
      const int64_t first = base + threadIdx.x * kTokensPerThread;
      bool sends[kTokensPerThread];
      int32_t mine = 0;
#pragma unroll
      for (int j = 0; j < kTokensPerThread; ++j) {
        sends[j] = false;
        if (first + j < num_tokens) {
          for (int64_t k = 0; k < topk; ++k) {
            const int32_t e = topk_idx[(first + j) * topk + k];
            sends[j] |= IsValid(e, num_experts) && e / local_experts == rank;
          }
        }
        mine += sends[j];
      }
      int32_t chunk_total;
      int32_t next = running + ScanChunk(scan, mine, chunk_total);
#pragma unroll
      for (int j = 0; j < kTokensPerThread; ++j) {
        if (first + j < num_tokens) token_dest_pos[(first + j) * num_ranks + rank] = sends[j] ? next++ : -1;
      }
      running += chunk_total;
    }
    if (threadIdx.x == 0) rank_token_count[rank] = running;
  } else if (blockIdx.x < num_ranks + num_experts) {
    // Rank of each slot among this rank's slots of one expert, in (t, k) order.
    const int32_t expert = static_cast<int32_t>(blockIdx.x - num_ranks);
    for (int64_t base = 0; base < num_slots; base += kThreads * kSlotsPerThread) {
      const int64_t first = base + threadIdx.x * kSlotsPerThread;
      int32_t ids[kSlotsPerThread];
      LoadSlots(topk_idx, first, num_slots, ids);
      uint32_t hits = 0;  // bit j: slot first + j is this expert's
#pragma unroll
      for (int j = 0; j < kSlotsPerThread; ++j) hits |= static_cast<uint32_t>(ids[j] == expert) << j;
      int32_t chunk_total;
      int32_t next = running + ScanChunk(scan, __popc(hits), chunk_total);
      for (; hits != 0; hits &= hits - 1) slot_rank[first + __ffs(hits) - 1] = next++;
      running += chunk_total;
    }
    if (threadIdx.x == 0) expert_count[expert] = running;
  } else {
    // Unused and invalid slots: rank -1; invalid ones are counted.
    using Reduce = cub::BlockReduce<int32_t, kThreads>;
    __shared__ typename Reduce::TempStorage reduce;
    int32_t invalid = 0;
    for (int64_t first = threadIdx.x * kSlotsPerThread; first < num_slots; first += kThreads * kSlotsPerThread) {
      int32_t ids[kSlotsPerThread];
      LoadSlots(topk_idx, first, num_slots, ids);
#pragma unroll
      for (int j = 0; j < kSlotsPerThread; ++j) {
        if (first + j < num_slots && !IsValid(ids[j], num_experts)) {
          slot_rank[first + j] = -1;
          invalid += ids[j] != -1;
        }
      }
    }
    const int32_t total = Reduce(reduce).Sum(invalid);
    if (threadIdx.x == 0) *num_invalid = total;
  }
}

}  // namespace

cudaError_t LaunchRoutingLayout(const int32_t* topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                                int64_t num_ranks, int32_t* token_dest_pos, int32_t* rank_token_count,
                                int32_t* expert_count, int32_t* slot_rank, int32_t* num_invalid, cudaStream_t stream) {
  const unsigned blocks = static_cast<unsigned>(num_ranks + num_experts + 1);
  RoutingLayoutKernel<<<blocks, kThreads, 0, stream>>>(topk_idx, num_tokens, topk, num_experts, num_ranks,
                                                       token_dest_pos, rank_token_count, expert_count, slot_rank,
                                                       num_invalid);
  return cudaGetLastError();
}

}  // namespace jax_ep
