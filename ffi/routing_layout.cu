// Routing layout of one rank: deterministic block scans, one block per destination rank,
// one per expert, and one for the invalid slots, so every output element is written once.
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include "kernels.h"

namespace jax_ep {
namespace {

constexpr int kThreads = 256;
constexpr int kSlotsPerThread = 16;

using BlockScan = cub::BlockScan<int32_t, kThreads>;

// Exclusive scan of one chunk of kThreads flags; chunk_total gets their sum.
__device__ int32_t ScanChunk(BlockScan::TempStorage& storage, int32_t flag, int32_t& chunk_total) {
  int32_t offset;
  BlockScan(storage).ExclusiveSum(flag, offset, chunk_total);
  __syncthreads();
  return offset;
}

__device__ bool IsValid(int32_t expert, int64_t num_experts) { return expert >= 0 && expert < num_experts; }

__global__ void RoutingLayoutKernel(const int32_t* __restrict__ topk_idx, int64_t num_tokens, int64_t topk,
                                    int64_t num_experts, int64_t num_ranks, int32_t* __restrict__ token_dest_pos,
                                    int32_t* __restrict__ rank_token_count, int32_t* __restrict__ expert_count,
                                    int32_t* __restrict__ slot_rank, int32_t* __restrict__ num_invalid) {
  __shared__ BlockScan::TempStorage scan;
  const int64_t local_experts = num_experts / num_ranks;
  const int64_t num_slots = num_tokens * topk;
  int32_t running = 0;
  if (blockIdx.x < num_ranks) {
    // Position of each token in the send list to this rank.
    const int64_t rank = blockIdx.x;
    for (int64_t base = 0; base < num_tokens; base += kThreads) {
      const int64_t t = base + threadIdx.x;
      int32_t sends = 0;
      if (t < num_tokens) {
        for (int64_t k = 0; k < topk; ++k) {
          const int32_t e = topk_idx[t * topk + k];
          sends |= IsValid(e, num_experts) && e / local_experts == rank;
        }
      }
      int32_t chunk_total;
      const int32_t offset = ScanChunk(scan, sends, chunk_total);
      if (t < num_tokens) token_dest_pos[t * num_ranks + rank] = sends ? running + offset : -1;
      running += chunk_total;
    }
    if (threadIdx.x == 0) rank_token_count[rank] = running;
  } else if (blockIdx.x < num_ranks + num_experts) {
    // Rank of each slot among this rank's slots of one expert, in (t, k) order. Each thread scans
    // kSlotsPerThread consecutive slots, so a block needs few synchronized scans.
    const int32_t expert = static_cast<int32_t>(blockIdx.x - num_ranks);
    for (int64_t base = 0; base < num_slots; base += kThreads * kSlotsPerThread) {
      const int64_t first = base + threadIdx.x * kSlotsPerThread;
      const int64_t last = first + kSlotsPerThread < num_slots ? first + kSlotsPerThread : num_slots;
      int32_t mine = 0;
      for (int64_t s = first; s < last; ++s) mine += topk_idx[s] == expert;
      int32_t chunk_total;
      int32_t next = running + ScanChunk(scan, mine, chunk_total);
      for (int64_t s = first; mine > 0 && s < last; ++s) {
        if (topk_idx[s] == expert) slot_rank[s] = next++;
      }
      running += chunk_total;
    }
    if (threadIdx.x == 0) expert_count[expert] = running;
  } else {
    // Unused and invalid slots: rank -1; invalid ones are counted.
    using Reduce = cub::BlockReduce<int32_t, kThreads>;
    __shared__ typename Reduce::TempStorage reduce;
    int32_t invalid = 0;
    for (int64_t s = threadIdx.x; s < num_slots; s += kThreads) {
      const int32_t e = topk_idx[s];
      if (!IsValid(e, num_experts)) {
        slot_rank[s] = -1;
        invalid += e != -1;
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
