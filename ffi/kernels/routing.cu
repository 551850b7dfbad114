// The routing kernel (first kernel of a dispatch): for one rank's topk_idx [T, K], each slot's rank among
// this rank's slots of its expert, each token's position in the send list to every rank, and the counts.
// Blocks take chunks of tokens; inside a chunk, warps take consecutive slots 32 at a time and rank them
// with __match_any_sync against per-warp counters, so every value is the same on every run. The last block
// turns the chunks' counts into prefixes; the dispatch kernel adds them (RoutingScratch).
// Decode sizes (one slot per thread, K a power of two) take RoutingKernelOneBlock instead (routing_one_block.cuh),
// or run that routing inside the dispatch kernel: the same values.
#include <algorithm>

#include "launch.h"
#include "protocol.cuh"
#include "routing_one_block.cuh"
#include "rows.cuh"

namespace jax_ep {

// A block of at most 8 warps ranks a chunk of up to 8 x 8 x 32 slots (T=4096, K=8: 16 blocks). The kernel's time
// is its instructions (each warp runs the same few hundred of fixed cost) and the chains between them, so a few
// warps with 8 batches each beat 32 warps with 2 (ncu at T=128 on one H200: docs/maintainers/performance_notes.md).
constexpr int kRoutingWarps = 8;
constexpr int kBatchesPerWarp = 8;
constexpr int kRoutingSharedBytes = 96 * 1024;

RoutingScratch::RoutingScratch(int64_t num_tokens, int64_t topk, int64_t num_experts, int64_t num_ranks) {
  warps = std::clamp<int64_t>(kRoutingSharedBytes / (2 * std::max<int64_t>(num_experts, 1)), 1, kRoutingWarps);
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

// The end of a routing that opens a split dispatch's call (one block, one chunk, a group of one GPU): once
// every position is written, leaves the call open, or poisons the start's outputs (positions and slot ranks)
// when the call may not run.
__device__ inline void EndStart(const GroupView& g, const Call& call, bool may_run, const RoutingStart& start,
                                int32_t* token_dest_pos, int32_t* slot_dest, int32_t num_tokens, int topk) {
  __syncthreads();
  if (!may_run) PoisonStart(token_dest_pos, slot_dest, num_tokens, g.num_ranks, topk);
  if (threadIdx.x == 0) {
    *start.link = 0.0f;
    if (may_run) OpenCall(g, call);
  }
}

// At least one block per SM: without it, ptxas held the kernel to 64 registers and spilled.
__global__ void __launch_bounds__(kRoutingWarps * 32, 1)
    RoutingKernel(const int32_t* __restrict__ topk_idx, int32_t num_tokens, int topk, int32_t num_experts,
                  Divisor local_experts, RoutingScratch s, GroupView g, int32_t* __restrict__ slot_dest,
                  int32_t* __restrict__ token_dest_pos, RoutingStart start) {
  const int num_ranks = g.num_ranks;
  int32_t* scratch = g.scratch;
  extern __shared__ uint16_t expert_seen[];  // [warps][E]: slots of each expert the warp ranked so far
  __shared__ int32_t rank_seen[kRoutingWarps][kMaxRanks];
  __shared__ int32_t invalid_seen[kRoutingWarps];
  const int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int32_t chunk = blockIdx.x;
  const int32_t t0 = chunk << s.chunk_shift;
  const int32_t t1 = min(num_tokens, t0 + (1 << s.chunk_shift));
  int32_t* slot_local = scratch + s.slot_local;
  int32_t* token_local = scratch + s.token_local;
  const int32_t seen_entries = warps * static_cast<int32_t>(num_experts);
  const int32_t seen_words = seen_entries / 8;  // 16-byte stores (dynamic shared memory is 16-byte aligned)
  for (int32_t i = threadIdx.x; i < seen_words; i += blockDim.x) reinterpret_cast<uint4*>(expert_seen)[i] = uint4{};
  for (int32_t i = seen_words * 8 + threadIdx.x; i < seen_entries; i += blockDim.x) expert_seen[i] = 0;
  for (int i = threadIdx.x; i < warps * kMaxRanks; i += blockDim.x) rank_seen[i / kMaxRanks][i % kMaxRanks] = 0;
  __syncthreads();

  // Slots: warp w ranks slots [w * per_warp, (w + 1) * per_warp) of the chunk, in order.
  const int32_t first_slot = t0 * topk;
  const int32_t chunk_slots = static_cast<int32_t>((t1 - t0) * topk);  // at most kThreads * kBatchesPerWarp
  const int32_t per_warp = (chunk_slots + warps - 1) / warps;
  int32_t expert_of[kBatchesPerWarp], rank_of[kBatchesPerWarp];
#pragma unroll
  for (int b = 0; b < kBatchesPerWarp; ++b) {  // every load in flight at once: the kernel is latency-bound
    const int32_t in_warp = b * 32 + lane;
    const int32_t slot = warp * per_warp + in_warp;
    expert_of[b] = in_warp < per_warp && slot < chunk_slots ? __ldg(topk_idx + first_slot + slot) : -1;
  }
  // A start that only opens its call: its checks load while the slots do.
  const bool opens_call = start.axis_index != nullptr;
  const Call call = opens_call ? CurrentCall(g, kOpDispatch, start.origin) : Call{};
  const bool may_run = !opens_call || CallMayRun(g, call, start.axis_index, Phase::kStart);
  int invalid = 0;
#pragma unroll
  for (int b = 0; b < kBatchesPerWarp; ++b) {
    if (b * 32 >= per_warp) break;  // the warp's slots are done (small T)
    const int32_t in_warp = b * 32 + lane;
    const int32_t slot = warp * per_warp + in_warp;
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
    if (in) slot_dest[first_slot + slot] = valid ? local_experts.Divide(e) : -1;
  }
  for (int offset = 16; offset > 0; offset /= 2) invalid += __shfl_down_sync(0xffffffffu, invalid, offset);
  if (lane == 0) invalid_seen[warp] = invalid;

  // Tokens: warp w takes tokens [w * per_warp_tokens, ...) of the chunk, 32 at a time, in order.
  const int32_t chunk_tokens = static_cast<int32_t>(t1 - t0);
  const int32_t per_warp_tokens = (chunk_tokens + warps - 1) / warps;
  for (int32_t b = 0; b * 32 < per_warp_tokens; ++b) {
    const int32_t in_warp = b * 32 + lane;
    const int32_t t = t0 + warp * per_warp_tokens + in_warp;
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
      const int seen = rank_seen[warp][d];
      if (in) token_local[t * num_ranks + d] = sends ? seen + __popc(senders & LanesBelow(lane)) : -1;
      __syncwarp();
      if (lane == 0) rank_seen[warp][d] = seen + __popc(senders);
      __syncwarp();
    }
  }
  __syncthreads();

  // Per expert and per rank: exclusive prefix over the warps, and the chunk's totals.
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
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
      const int32_t count = rank_seen[w][d];
      rank_seen[w][d] = running;
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
    const int32_t in_warp = b * 32 + lane;
    const int32_t slot = warp * per_warp + in_warp;
    if (in_warp < per_warp && slot < chunk_slots) {
      slot_local[first_slot + slot] = expert_of[b] < 0 ? -1 : expert_seen[warp * num_experts + expert_of[b]] + rank_of[b];
    }
  }
  if (warp > 0 || s.chunks == 1) {  // warp 0's offsets are 0
    for (int32_t in_warp = lane; in_warp < per_warp_tokens; in_warp += 32) {
      const int32_t t = t0 + warp * per_warp_tokens + in_warp;
      if (t >= t1) break;
      for (int d = 0; d < num_ranks; ++d) {
        int32_t& pos = token_local[t * num_ranks + d];
        if (pos >= 0) pos += rank_seen[warp][d];
        if (s.chunks == 1) token_dest_pos[t * num_ranks + d] = pos;  // final: no other chunk comes before
      }
    }
  }

  if (opens_call) EndStart(g, call, may_run, start, token_dest_pos, slot_dest, num_tokens, topk);

  // The last block: prefixes over the chunks, and the totals.
  if (s.chunks == 1 || !LastBlock<Fence::kGpu>(&g.signals->routing_done)) return;
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    scratch[s.expert_count + e] = PrefixInPlace(scratch + s.chunk_expert + e, num_experts, s.chunks);
  }
  for (int d = threadIdx.x; d < num_ranks; d += blockDim.x) {
    scratch[s.rank_count + d] = PrefixInPlace(scratch + s.chunk_rank + d, num_ranks, s.chunks);
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int32_t c = 0; c < s.chunks; ++c) total += __ldcg(scratch + s.chunk_invalid + c);
    scratch[s.num_invalid] = total;
  }
}

// A routing of one slot per thread (decode sizes; routing_one_block.cuh).
__global__ void __launch_bounds__(kThreads, 1)
    RoutingKernelOneBlock(const int32_t* __restrict__ topk_idx, int32_t num_tokens, int topk, int32_t num_experts,
                          Divisor local_experts, RoutingScratch s, GroupView g, int32_t* __restrict__ slot_dest,
                          int32_t* __restrict__ token_dest_pos, RoutingStart start) {
  extern __shared__ uint4 count_rows[];
  const CountRows rows(blockDim.x / 32);
  const int32_t num_slots = num_tokens * topk;
  const int32_t e = static_cast<int32_t>(threadIdx.x) < num_slots ? __ldg(topk_idx + threadIdx.x) : -1;
  const bool opens_call = start.axis_index != nullptr;
  const Call call = opens_call ? CurrentCall(g, kOpDispatch, start.origin) : Call{};
  OneBlockZero(count_rows, rows, num_experts, g.num_ranks);
  bool may_run = true;
  if (opens_call) {
    may_run = CallMayRun(g, call, start.axis_index, Phase::kStart);  // its barrier also ends the zeroing
  } else {
    __syncthreads();
  }
  const OneBlockSlot slot = OneBlockCount(count_rows, rows, e, num_slots, topk, num_experts, g.num_ranks, local_experts);
  __syncthreads();
  OneBlockWrite(count_rows, rows, slot, num_slots, topk, num_experts, g.num_ranks, s, g.scratch, slot_dest,
                token_dest_pos);
  if (opens_call) EndStart(g, call, may_run, start, token_dest_pos, slot_dest, num_tokens, topk);
}

}  // namespace

Status CheckRouting(const RoutingScratch& s, const GroupView& group) {
  if (s.ints > group.scratch_ints) {
    return Status::Error(StatusCode::kResourceExhausted,
                         "this dispatch needs " + std::to_string(s.ints) + " ints of routing scratch, but "
                         "jax_ep.initialize reserved " + std::to_string(group.scratch_ints) +
                         "; initialize with the largest num_tokens, topk and num_experts you dispatch");
  }
  if (s.ints > INT32_MAX) {  // the kernels index the scratch, topk_idx and slot_dest in 32 bits
    return Status::InvalidArgument("this dispatch's routing needs " + std::to_string(s.ints) +
                                   " ints of scratch, more than the kernel indexes; use fewer tokens per call");
  }
  return Status::Ok();
}

Status LaunchRouting(const int32_t* topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                     const GroupView& group, int32_t* slot_dest, int32_t* token_dest_pos, RoutingStart start,
                     cudaStream_t stream) {
  const RoutingScratch s(num_tokens, topk, num_experts, group.num_ranks);
  if (start.axis_index != nullptr && (s.chunks != 1 || group.num_ranks != 1)) {
    return Status::Internal("only a routing of one chunk in a group of one GPU can open a split dispatch's call");
  }
  const Status checked = CheckRouting(s, group);
  if (!checked.ok()) return checked;
  const int one_block = OneBlockThreads(num_tokens, topk);
  if (OneBlockFits(num_tokens, topk, num_experts, group.num_ranks, s, one_block, kRoutingSharedBytes)) {
    const size_t shared = static_cast<size_t>(CountRows(one_block / 32).Bytes(num_experts, group.num_ranks));
    RoutingKernelOneBlock<<<1, static_cast<unsigned>(one_block), shared, stream>>>(
        topk_idx, static_cast<int32_t>(num_tokens), static_cast<int>(topk), static_cast<int32_t>(num_experts),
        Divisor(num_experts / group.num_ranks), s, group, slot_dest, token_dest_pos, start);
    return LaunchStatus("RoutingKernelOneBlock");
  }
  const size_t shared = static_cast<size_t>(s.warps * num_experts) * sizeof(uint16_t);
  RoutingKernel<<<static_cast<unsigned>(s.chunks), static_cast<unsigned>(s.warps * 32), shared, stream>>>(
      topk_idx, static_cast<int32_t>(num_tokens), static_cast<int>(topk), static_cast<int32_t>(num_experts),
      Divisor(num_experts / group.num_ranks), s, group, slot_dest, token_dest_pos, start);
  return LaunchStatus("RoutingKernel");
}

Status PrepareRoutingKernel() {
  for (const auto& [kernel, name] : {std::pair{&RoutingKernel, "RoutingKernel"},
                                     std::pair{&RoutingKernelOneBlock, "RoutingKernelOneBlock"}}) {
    const cudaError_t status =
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kRoutingSharedBytes);
    if (status != cudaSuccess) {
      return Status::Internal(std::string("cudaFuncSetAttribute(") + name + "): " + cudaGetErrorString(status));
    }
  }
  return Status::Ok();
}

}  // namespace jax_ep
