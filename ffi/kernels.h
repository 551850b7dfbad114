// Launchers of the jax_ep CUDA kernels: raw pointers, a stream, and the group's device memory.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <functional>
#include <string>

#include "signals.h"

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

// "" or the error of the kernel launched last, named.
std::string LaunchStatus(const char* kernel);

// Every transfer starts here: waits until all ranks of the group entered it, so every peer has finished
// reading its buffer in earlier transfers. send_counts [R] (may be null) reach each peer's counts_in.
std::string LaunchArrive(const int32_t* send_counts, const GroupView& group, cudaStream_t stream);

// What a transfer runs on the host between its send and receive kernels when some ranks are reached through
// NCCL (GroupView::nccl_ranks): the swap of region d of `send` (region_bytes) with each such rank d, and of
// send_counts (may be null); see NcclLink::Swap. Returns "" or an error.
using NcclSwap = std::function<std::string(const char* send, int64_t region_bytes, const int32_t* send_counts)>;

// The transfers below return "" or what failed.

// All-to-all of rows: rows [:send_counts[d]] of send[d] ([R, rows, row_bytes]) go to rank d; recv[r] gets
// rank r's rows and recv_counts [R] their number. Rows past recv_counts[r] are left unwritten.
std::string LaunchExchange(const char* send, const int32_t* send_counts, char* recv, int32_t* recv_counts,
                           int64_t rows, int64_t row_bytes, const GroupView& group, const NcclSwap& swap,
                           cudaStream_t stream);

// Dispatch's data movement: each token row of x [T, row_bytes] goes once to every rank d with
// token_dest_pos[t, d] >= 0; there the i-th token received from rank r (i < recv_counts[r]) fills the out rows
// ([N, row_bytes]) recv_rows[r, i, :] that are >= 0, and out rows with row_slot[n] < 0 get zeros.
// self_token [T] lists the tokens this rank sends to itself, in order.
std::string LaunchTokensToRows(const char* x, const int32_t* token_dest_pos, const int32_t* self_token,
                               const int32_t* recv_rows, const int32_t* recv_counts, const int32_t* row_slot,
                               char* out, int64_t num_tokens, int64_t row_bytes, int64_t num_rows, int64_t topk,
                               const GroupView& group, const NcclSwap& swap, cudaStream_t stream);

enum class FloatType { kF32, kBF16, kF16 };

// The fused combine keeps a token's delivered rows in shared memory: at most this many slots per token.
constexpr int kMaxFusedTopk = 64;

// Combine's data movement: for the i-th token received from rank r (i < recv_counts[r]), the float32 sum over
// k of weights[row] * y[row] with row = recv_rows[r, i, k] >= 0 goes back to rank r once; there
// out[t] = sum over ranks d of the partial sum for token_dest_pos[t, d] >= 0, rounded to y's type.
std::string LaunchRowsToTokens(const void* y, const float* weights, const int32_t* recv_rows,
                               const int32_t* recv_counts, const int32_t* token_dest_pos, void* out,
                               FloatType type, int64_t num_tokens, int64_t hidden, int64_t topk,
                               const GroupView& group, const NcclSwap& swap, cudaStream_t stream);

}  // namespace jax_ep
