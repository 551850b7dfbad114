// Launchers of the jax_ep CUDA kernels: raw pointers and a stream only.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_ep {

// Routing facts of one rank's topk_idx [T, K] (all int32), as jax_ep/_layout.py:local_layout:
//   token_dest_pos [T, R]   row of token t in the send list to rank d, or -1
//   rank_token_count [R]    tokens sent to each rank
//   expert_count [E]        valid slots per global expert
//   slot_rank [T, K]        index of the slot among this rank's slots of its expert, or -1
//   num_invalid []          slots that are neither -1 nor in [0, E)
cudaError_t LaunchRoutingLayout(const int32_t* topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                                int64_t num_ranks, int32_t* token_dest_pos, int32_t* rank_token_count,
                                int32_t* expert_count, int32_t* slot_rank, int32_t* num_invalid, cudaStream_t stream);

}  // namespace jax_ep
