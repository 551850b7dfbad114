// The routing kernel (first kernel of a dispatch whose routing is more than one chunk, or of a split dispatch):
// blocks rank chunks of tokens (RouteChunk), and the last block turns the chunks' counts into prefixes; the
// dispatch kernel adds them (RoutingScratch).
#include <algorithm>

#include "launch.h"
#include "protocol.cuh"
#include "routing.cuh"
#include "rows.cuh"

namespace jax_ep {

constexpr int kRoutingSharedBytes = 96 * 1024;  // for the expert counts

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

// At least one block per SM: without it, ptxas held the kernel to 64 registers and spilled.
__global__ void __launch_bounds__(kRoutingWarps * 32, 1)
    RoutingKernel(RoutingArgs a, GroupView g, RoutingStart start) {
  extern __shared__ __align__(16) char routing_memory[];
  const RoutingShared shared = RoutingShared::At(routing_memory, blockDim.x / 32, a.s.tokens_per_chunk);
  // A start that only opens its call: its checks load while the slots do.
  const bool opens_call = start.axis_index != nullptr;
  const Call call = opens_call ? CurrentCall(g, kOpDispatch) : Call{};
  bool may_run = true;
  RouteChunk<kBatchesPerWarp>(a, blockIdx.x, shared, g.scratch, [&] {
    if (opens_call) may_run = CallMayRun(g, call, start.axis_index, Phase::kStart);
    return true;
  });
  const RoutingScratch& s = a.s;
  const int32_t num_experts = a.num_experts;
  const int num_ranks = a.num_ranks;
  int32_t* scratch = g.scratch;

  if (opens_call) {  // one block (one chunk): every position is written
    if (!may_run) Poison(a.token_dest_pos, static_cast<int64_t>(a.num_tokens) * num_ranks * 4);
    if (threadIdx.x == 0) {
      *start.link = 0.0f;
      if (may_run) *reinterpret_cast<volatile uint64_t*>(&g.signals->open) = call.tag;
    }
  }

  // The last block: prefixes over the chunks, and the totals.
  if (s.chunks == 1 || !LastBlock<Fence::kGpu>(&g.signals->routing_done)) return;
  const auto from_l2 = [](const int32_t* value) { return __ldcg(value); };  // other blocks wrote them
  for (int32_t e = threadIdx.x; e < num_experts; e += blockDim.x) {
    scratch[s.expert_count + e] = PrefixInPlace(scratch + s.chunk_expert + e, num_experts, s.chunks, from_l2);
  }
  for (int d = threadIdx.x; d < num_ranks; d += blockDim.x) {
    scratch[s.rank_count + d] = PrefixInPlace(scratch + s.chunk_rank + d, num_ranks, s.chunks, from_l2);
  }
  if (threadIdx.x == 0) {
    int32_t total = 0;
    for (int32_t c = 0; c < s.chunks; ++c) total += __ldcg(scratch + s.chunk_invalid + c);
    scratch[s.num_invalid] = total;
  }
}

}  // namespace

Status LaunchRouting(const int32_t* topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                     const GroupView& group, int32_t* slot_dest, int32_t* token_dest_pos, RoutingStart start,
                     cudaStream_t stream) {
  const RoutingScratch s(num_tokens, topk, num_experts, group.num_ranks);
  if (start.axis_index != nullptr && (s.chunks != 1 || group.num_ranks != 1)) {
    return Status::Internal("only a routing of one chunk in a group of one GPU can open a split dispatch's call");
  }
  if (s.ints > group.scratch_ints) {
    return Status::Error(StatusCode::kResourceExhausted,
                         "this dispatch needs " + std::to_string(s.ints) + " ints of routing scratch, but "
                         "jax_ep.initialize reserved " + std::to_string(group.scratch_ints) +
                         "; initialize with the largest num_tokens, topk and num_experts you dispatch");
  }
  if (s.ints > INT32_MAX) {  // the kernel indexes the scratch, topk_idx and slot_dest in 32 bits
    return Status::InvalidArgument("this dispatch's routing needs " + std::to_string(s.ints) +
                                   " ints of scratch, more than the kernel indexes; use fewer tokens per call");
  }
  const RoutingArgs args{topk_idx, static_cast<int32_t>(num_tokens), static_cast<int>(topk),
                         static_cast<int32_t>(num_experts), Divisor(num_experts / group.num_ranks), Divisor(topk),
                         s, group.num_ranks, slot_dest, token_dest_pos};
  const size_t shared = static_cast<size_t>(RoutingShared::Bytes(s.warps, s.tokens_per_chunk, num_experts));
  RoutingKernel<<<static_cast<unsigned>(s.chunks), static_cast<unsigned>(s.warps * 32), shared, stream>>>(args, group,
                                                                                                         start);
  const cudaError_t status = cudaGetLastError();
  if (status != cudaSuccess) return Status::Internal(std::string("launching RoutingKernel: ") + cudaGetErrorString(status));
  return Status::Ok();
}

Status PrepareRoutingKernel() {
  const cudaError_t status =
      cudaFuncSetAttribute(RoutingKernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           kRoutingSharedBytes + static_cast<int>(RoutingShared::CountBytes(kRoutingWarps, kMaxChunkTokens)));
  if (status != cudaSuccess) {
    return Status::Internal(std::string("cudaFuncSetAttribute(RoutingKernel): ") + cudaGetErrorString(status));
  }
  return Status::Ok();
}

}  // namespace jax_ep
