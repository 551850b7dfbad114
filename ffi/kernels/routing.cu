// The routing kernel (first kernel of a dispatch): for one rank's topk_idx [T, K], each slot's rank among
// this rank's slots of its expert, each token's position in the send list to every rank, and the counts.
// Blocks take chunks of tokens; inside a chunk, warps take consecutive slots 32 at a time and rank them
// with __match_any_sync against per-warp counters, so every value is the same on every run. The last block
// turns the chunks' counts into prefixes; the dispatch kernel adds them (RoutingScratch).
#include <algorithm>

#include "launch.h"
#include "protocol.cuh"
#include "routing.cuh"

namespace jax_ep {

constexpr int kRoutingSharedBytes = 96 * 1024;

RoutingScratch::RoutingScratch(int64_t num_tokens, int64_t topk, int64_t num_experts, int64_t num_ranks) {
  warps = std::clamp<int64_t>(kRoutingSharedBytes / (2 * std::max<int64_t>(num_experts, 1)), 1, kWarps);
  const int64_t most = std::max<int64_t>(1, warps * 32 * kBatchesPerWarp / std::max<int64_t>(topk, 1));
  while ((int64_t{2} << chunk_shift) <= most) ++chunk_shift;  // a power of two: chunk = t >> chunk_shift
  tokens_per_chunk = int64_t{1} << chunk_shift;
  chunks = std::max<int64_t>(1, (num_tokens + tokens_per_chunk - 1) / tokens_per_chunk);
  slot_local = 0;
  token_local = slot_local + num_tokens * topk;
  chunk_expert = token_local + num_tokens * num_ranks;
  chunk_rank = chunk_expert + chunks * num_experts;
  chunk_invalid = chunk_rank + chunks * num_ranks;
  expert_count = chunk_invalid + chunks;
  rank_count = expert_count + num_experts;
  num_invalid = rank_count + num_ranks;
  ints = num_invalid + 1;
}

namespace {

// Exclusive prefix, in place, of the `count` values at values[c * stride]; returns their total. Eight loads go
// out at once (from L2: other blocks wrote them), since the last block's pass waits on memory, not arithmetic.
__device__ inline int32_t PrefixInPlace(int32_t* values, int64_t stride, int64_t count) {
  int32_t running = 0;
  for (int64_t c0 = 0; c0 < count; c0 += 8) {
    int32_t loaded[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) loaded[j] = c0 + j < count ? __ldcg(values + (c0 + j) * stride) : 0;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (c0 + j < count) {
        values[(c0 + j) * stride] = running;
        running += loaded[j];
      }
    }
  }
  return running;
}

__global__ void __launch_bounds__(kThreads)
    RoutingKernel(const int32_t* __restrict__ topk_idx, int64_t num_tokens, int topk, int64_t num_experts,
                  int num_ranks, Divisor local_experts, RoutingScratch s, int32_t* scratch,
                  int32_t* __restrict__ slot_dest, uint32_t* done) {
  extern __shared__ uint16_t expert_seen[];  // [warps][E]: slots of each expert the warp ranked so far
  __shared__ int32_t rank_seen[kWarps * kMaxRanks];
  __shared__ int32_t invalid_seen[kWarps];
  RouteChunk(topk_idx, num_tokens, topk, num_experts, num_ranks, local_experts, s, scratch, slot_dest, blockIdx.x,
             RoutingShared{expert_seen, rank_seen, invalid_seen});

  // The last block: prefixes over the chunks, and the totals.
  if (s.chunks == 1 || !LastBlock<false>(done)) return;
  for (int64_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    scratch[s.expert_count + e] = PrefixInPlace(scratch + s.chunk_expert + e, num_experts, s.chunks);
  }
  for (int d = threadIdx.x; d < num_ranks; d += blockDim.x) {
    scratch[s.rank_count + d] = PrefixInPlace(scratch + s.chunk_rank + d, num_ranks, s.chunks);
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int64_t c = 0; c < s.chunks; ++c) total += __ldcg(scratch + s.chunk_invalid + c);
    scratch[s.num_invalid] = total;
  }
}

}  // namespace

Status LaunchRouting(const int32_t* topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                     const GroupView& group, int32_t* slot_dest, cudaStream_t stream) {
  const RoutingScratch s(num_tokens, topk, num_experts, group.num_ranks);
  if (s.ints > group.scratch_ints) {
    return Status::Error(StatusCode::kResourceExhausted,
                         "this dispatch needs " + std::to_string(s.ints) + " ints of routing scratch, but "
                         "jax_ep.initialize reserved " + std::to_string(group.scratch_ints) +
                         "; initialize with the largest num_tokens, topk and num_experts you dispatch");
  }
  const size_t shared = static_cast<size_t>(s.warps * num_experts) * sizeof(uint16_t);
  RoutingKernel<<<static_cast<unsigned>(s.chunks), static_cast<unsigned>(s.warps * 32), shared, stream>>>(
      topk_idx, num_tokens, static_cast<int>(topk), num_experts, group.num_ranks,
      Divisor(num_experts / group.num_ranks), s, group.scratch, slot_dest, &group.signals->routing_done);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return Status::Internal(std::string("launching RoutingKernel: ") + cudaGetErrorString(status));
  return Status::Ok();
}

Status PrepareRoutingKernel() {
  const cudaError_t status =
      cudaFuncSetAttribute(RoutingKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRoutingSharedBytes);
  if (status != cudaSuccess) {
    return Status::Internal(std::string("cudaFuncSetAttribute(RoutingKernel): ") + cudaGetErrorString(status));
  }
  return Status::Ok();
}

}  // namespace jax_ep
