// Dispatch's and combine's data movement, fused: tokens go straight from x into peers' receive buffers
// and from there into the layout; partial sums go straight from the expert side to the source's buffer.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <string>

#include "kernels.h"
#include "sync.cuh"

namespace jax_ep {
namespace {

// Writes `bytes` bytes of a token row to every layout row in rows[0:topk) that is >= 0, at out +
// row * row_stride. Each 2 KB part of the token is read once and stored to all of its rows, so a token
// routed to k local experts costs one read.
__device__ inline void ExpandRow(const char* __restrict__ src, const int32_t* __restrict__ rows, int64_t topk,
                                 char* __restrict__ out, int64_t row_stride, int64_t bytes, int lane) {
  if (bytes % 16 != 0) {
    for (int64_t k = 0; k < topk; ++k) {
      if (rows[k] >= 0) CopyRow(src, out + rows[k] * row_stride, bytes, lane);
    }
    return;
  }
  constexpr int kPerLane = 4;
  const int64_t n = bytes / 16;
  const uint4* s = reinterpret_cast<const uint4*>(src);
  for (int64_t base = 0; base < n; base += 32 * kPerLane) {
    uint4 piece[kPerLane];
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int64_t i = base + lane + 32 * m;
      if (i < n) piece[m] = s[i];
    }
    for (int64_t k = 0; k < topk; ++k) {
      const int32_t row = rows[k];
      if (row < 0) continue;
      uint4* d = reinterpret_cast<uint4*>(out + row * row_stride);
#pragma unroll
      for (int m = 0; m < kPerLane; ++m) {
        const int64_t i = base + lane + 32 * m;
        if (i < n) d[i] = piece[m];
      }
    }
  }
}

// Sends each token once to every peer rank it is routed to (peer items: pieces of (token, rank) pairs)
// while filling the layout rows that need no peer data (local items: pieces of this rank's own tokens,
// then of padding rows).
__global__ void __launch_bounds__(kThreads)
    TokensToRowsSendKernel(const char* __restrict__ x, const int32_t* __restrict__ token_dest_pos,
                           const int32_t* __restrict__ self_token, const int32_t* __restrict__ recv_rows,
                           const int32_t* __restrict__ recv_counts, const int32_t* __restrict__ row_slot,
                           char* __restrict__ out, int64_t num_tokens, int64_t row_bytes, int64_t num_rows,
                           int64_t topk, int pieces, GroupView group) {
  const uint64_t epoch = CurrentEpoch(group.signals);
  const int lane = threadIdx.x % 32;
  const int num_ranks = group.num_ranks;
  const uint32_t num_peers = static_cast<uint32_t>(num_ranks - 1);
  auto send_token = [&](uint32_t item) {  // item: piece of a (token, peer rank) pair
    const UnitPiece pair = SplitItem(item, pieces);
    const uint32_t t = num_peers == 1 ? pair.unit : pair.unit / num_peers;
    const int dest = OtherRank(pair.unit - t * num_peers, group.rank);
    const int32_t pos = token_dest_pos[t * num_ranks + dest];
    if (pos < 0) return;
    int64_t begin, end;
    PieceBytes(row_bytes, pieces, pair.piece, &begin, &end);
    char* row = SendRegion(group, dest, num_tokens * row_bytes) + pos * row_bytes;
    CopyRow(x + t * row_bytes + begin, row + begin, end - begin, lane);
  };
  auto fill_local = [&](uint32_t item) {
    const auto [unit, piece] = SplitItem(item, pieces);
    int64_t begin, end;
    PieceBytes(row_bytes, pieces, piece, &begin, &end);
    if (unit < num_tokens) {
      if (unit >= recv_counts[group.rank]) return;
      const int32_t* rows = recv_rows + (group.rank * num_tokens + unit) * topk;
      ExpandRow(x + self_token[unit] * row_bytes + begin, rows, topk, out + begin, row_bytes, end - begin, lane);
    } else if (row_slot[unit - num_tokens] < 0) {
      CopyRow(nullptr, out + (unit - num_tokens) * row_bytes + begin, end - begin, lane);
    }
  };
  DrainWorkLists(group, static_cast<uint32_t>(num_tokens * num_peers * pieces),
                 static_cast<uint32_t>((num_tokens + num_rows) * pieces), send_token, fill_local);
  SignalDataSent(group, epoch);
}

// Fills the layout rows of peers' tokens once all peers' stores have landed: one warp per piece of a
// received token.
__global__ void __launch_bounds__(kThreads)
    TokensToRowsExpandKernel(const int32_t* __restrict__ recv_rows, const int32_t* __restrict__ recv_counts,
                             char* __restrict__ out, int64_t num_tokens, int64_t row_bytes, int64_t topk,
                             int pieces, GroupView group) {
  const uint64_t epoch = CurrentEpoch(group.signals);
  WaitDataReceived(group, epoch);
  const int lane = threadIdx.x % 32;
  const uint32_t warps = gridDim.x * kWarps;
  const uint32_t items = static_cast<uint32_t>(group.num_ranks * num_tokens * pieces);
  for (uint32_t w = blockIdx.x * kWarps + threadIdx.x / 32; w < items; w += warps) {
    const auto [unit, piece] = SplitItem(w, pieces);
    const int source = static_cast<int>(unit / static_cast<uint32_t>(num_tokens));
    if (source == group.rank || unit - source * num_tokens >= recv_counts[source]) continue;
    int64_t begin, end;
    PieceBytes(row_bytes, pieces, piece, &begin, &end);
    const char* token = group.own_buffer + unit * row_bytes + begin;
    ExpandRow(token, recv_rows + unit * topk, topk, out + begin, row_bytes, end - begin, lane);
  }
  FinishTransfer(group, epoch);
}

__device__ inline float ToFloat(float v) { return v; }
__device__ inline float ToFloat(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ inline float ToFloat(__half v) { return __half2float(v); }

template <typename T>
__device__ inline T FromFloat(float v);
template <>
__device__ inline float FromFloat<float>(float v) {
  return v;
}
template <>
__device__ inline __nv_bfloat16 FromFloat<__nv_bfloat16>(float v) {
  return __float2bfloat16(v);
}
template <>
__device__ inline __half FromFloat<__half>(float v) {
  return __float2half(v);
}

// Elements each lane handles at once: 16 bytes of T when the hidden size allows, else one.
template <typename T>
__host__ __device__ inline int VectorWidth(int64_t hidden) {
  constexpr int kWide = 16 / sizeof(T);
  return hidden % kWide == 0 ? kWide : 1;
}

// Steps of a sum over `hidden` elements, `width` per lane.
__host__ __device__ inline int64_t SumSteps(int64_t hidden, int width) {
  return (hidden + 32 * width - 1) / (32 * width);
}

// Elements [begin, end) of a piece of such a sum.
__device__ inline void PieceElements(int64_t hidden, int width, int pieces, int piece, int64_t* begin,
                                     int64_t* end) {
  if (pieces == 1) {
    *begin = 0;
    *end = hidden;
    return;
  }
  const Piece p = PieceOf(SumSteps(hidden, width), pieces, piece);
  *begin = p.first * 32 * width;
  *end = p.last * 32 * width < hidden ? p.last * 32 * width : hidden;
}

// Sums each received token's delivered rows in float32 and stores the sum in its source rank's buffer
// (peer items: pieces of tokens from other ranks, over NVLink; local items: pieces of this rank's own tokens).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RowsToTokensSendKernel(const T* __restrict__ y, const float* __restrict__ weights,
                           const int32_t* __restrict__ recv_rows, const int32_t* __restrict__ recv_counts,
                           int64_t num_tokens, int64_t hidden, int64_t topk, int pieces, GroupView group) {
  constexpr int kWide = 16 / sizeof(T);
  // A token's delivered rows and weights, in k order, for the warp that sums them.
  __shared__ int32_t held_rows[kWarps][kMaxFusedTopk];
  __shared__ float held_weights[kWarps][kMaxFusedTopk];
  const uint64_t epoch = CurrentEpoch(group.signals);
  const int lane = threadIdx.x % 32;
  const int warp_in_block = threadIdx.x / 32;
  const int width = VectorWidth<T>(hidden);
  auto sum_token = [&](int source, uint32_t i, int piece) {
    if (i >= recv_counts[source]) return;
    const int64_t w = source * num_tokens + i;
    int held = 0;
    for (int64_t k0 = 0; k0 < topk; k0 += 32) {
      const int32_t row = k0 + lane < topk ? recv_rows[w * topk + k0 + lane] : -1;
      const unsigned valid = __ballot_sync(0xffffffffu, row >= 0);
      if (row >= 0) {
        const int at = held + __popc(valid & ((1u << lane) - 1));
        held_rows[warp_in_block][at] = row;
        held_weights[warp_in_block][at] = weights[row];
      }
      held += __popc(valid);
    }
    __syncwarp();
    float* dst = reinterpret_cast<float*>(SendRegion(group, source, num_tokens * hidden * 4)) + i * hidden;
    const int32_t* rows = held_rows[warp_in_block];
    const float* row_weights = held_weights[warp_in_block];
    int64_t first, last;
    PieceElements(hidden, width, pieces, piece, &first, &last);
    for (int64_t e = first + lane * width; e < last; e += 32 * width) {
      float acc[kWide] = {};
      if (width == kWide) {
        // Loads of kLoadsInFlight rows go out before their sums, in k order.
        constexpr int kLoadsInFlight = 4;
        for (int j0 = 0; j0 < held; j0 += kLoadsInFlight) {
          uint4 raw[kLoadsInFlight];
#pragma unroll
          for (int m = 0; m < kLoadsInFlight; ++m) {
            if (j0 + m < held) raw[m] = *reinterpret_cast<const uint4*>(y + rows[j0 + m] * hidden + e);
          }
#pragma unroll
          for (int m = 0; m < kLoadsInFlight; ++m) {
            if (j0 + m >= held) break;
            const T* values = reinterpret_cast<const T*>(&raw[m]);
#pragma unroll
            for (int v = 0; v < kWide; ++v) acc[v] += row_weights[j0 + m] * ToFloat(values[v]);
          }
        }
      } else {
        for (int j = 0; j < held; ++j) acc[0] += row_weights[j] * ToFloat(y[rows[j] * hidden + e]);
      }
      if (width % 4 == 0) {
        for (int m = 0; m < width; m += 4) {
          *reinterpret_cast<float4*>(dst + e + m) = make_float4(acc[m], acc[m + 1], acc[m + 2], acc[m + 3]);
        }
      } else {
        dst[e] = acc[0];
      }
    }
    __syncwarp();
  };
  auto sum_peer_token = [&](uint32_t item) {  // item: piece of the i-th token of a peer rank
    const auto [unit, piece] = SplitItem(item, pieces);
    const uint32_t peer = unit / static_cast<uint32_t>(num_tokens);
    sum_token(OtherRank(peer, group.rank), static_cast<uint32_t>(unit - peer * num_tokens), piece);
  };
  auto sum_own_token = [&](uint32_t item) {
    const auto [unit, piece] = SplitItem(item, pieces);
    sum_token(group.rank, unit, piece);
  };
  DrainWorkLists(group, static_cast<uint32_t>((group.num_ranks - 1) * num_tokens * pieces),
                 static_cast<uint32_t>(num_tokens * pieces), sum_peer_token, sum_own_token);
  SignalDataSent(group, epoch);
}

// Width of the reduce kernel's float32 loads.
__host__ __device__ inline int ReduceWidth(int64_t hidden) { return hidden % 4 == 0 ? 4 : 1; }

// Adds the ranks' partial sums of each token, one warp per piece of a token.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    RowsToTokensReduceKernel(const int32_t* __restrict__ token_dest_pos, T* __restrict__ out, int64_t num_tokens,
                             int64_t hidden, int pieces, GroupView group) {
  const uint64_t epoch = CurrentEpoch(group.signals);
  WaitDataReceived(group, epoch);
  const float* partial = reinterpret_cast<const float*>(group.own_buffer);
  const int lane = threadIdx.x % 32;
  const int width = ReduceWidth(hidden);
  const uint32_t warps = gridDim.x * kWarps;
  for (uint32_t w = blockIdx.x * kWarps + threadIdx.x / 32; w < num_tokens * pieces; w += warps) {
    const auto [t, piece] = SplitItem(w, pieces);
    int64_t first, last;
    PieceElements(hidden, width, pieces, piece, &first, &last);
    for (int64_t e = first + lane * width; e < last; e += 32 * width) {
      float acc[4] = {};
      for (int dest = 0; dest < group.num_ranks; ++dest) {
        const int32_t pos = token_dest_pos[t * group.num_ranks + dest];
        if (pos < 0) continue;
        const float* src = partial + (dest * num_tokens + pos) * hidden + e;
        if (width == 4) {
          const float4 v = *reinterpret_cast<const float4*>(src);
          acc[0] += v.x;
          acc[1] += v.y;
          acc[2] += v.z;
          acc[3] += v.w;
        } else {
          acc[0] += src[0];
        }
      }
      if (width == 4) {
#pragma unroll
        for (int j = 0; j < 4; ++j) out[t * hidden + e + j] = FromFloat<T>(acc[j]);
      } else {
        out[t * hidden + e] = FromFloat<T>(acc[0]);
      }
    }
  }
  FinishTransfer(group, epoch);
}

// "" when kernels of these many work items can run (SplitItem).
std::string CheckItems(int64_t send_items, int64_t receive_items) {
  const int64_t items = send_items > receive_items ? send_items : receive_items;
  if (items <= kMaxItems) return "";
  return "this call needs " + std::to_string(items) + " work items in one kernel, more than the " +
         std::to_string(kMaxItems) + " the kernels count; use fewer tokens per call";
}

template <typename T>
std::string LaunchRowsToTokensTyped(const T* y, const float* weights, const int32_t* recv_rows,
                                    const int32_t* recv_counts, const int32_t* token_dest_pos, T* out,
                                    int64_t num_tokens, int64_t hidden, int64_t topk, const GroupView& group,
                                    const NcclSwap& swap, cudaStream_t stream) {
  const int64_t units = group.num_ranks * num_tokens;  // peers' tokens, then this rank's own
  const int send_pieces = PiecesPerRow(units, SumSteps(hidden, VectorWidth<T>(hidden)), group);
  const int reduce_pieces = PiecesPerRow(num_tokens, SumSteps(hidden, ReduceWidth(hidden)), group);
  std::string error = CheckItems(units * send_pieces, num_tokens * reduce_pieces);
  if (!error.empty() || !(error = LaunchArrive(nullptr, group, stream)).empty()) return error;
  RowsToTokensSendKernel<T><<<BlocksFor(units * send_pieces, group), kThreads, 0, stream>>>(
      y, weights, recv_rows, recv_counts, num_tokens, hidden, topk, send_pieces, group);
  if (!(error = LaunchStatus("RowsToTokensSendKernel")).empty()) return error;
  const int64_t region_bytes = num_tokens * hidden * 4;
  if (group.nccl_ranks != 0 && !(error = swap(group.outbox, region_bytes, nullptr)).empty()) return error;
  RowsToTokensReduceKernel<T><<<BlocksFor(num_tokens * reduce_pieces, group), kThreads, 0, stream>>>(
      token_dest_pos, out, num_tokens, hidden, reduce_pieces, group);
  return LaunchStatus("RowsToTokensReduceKernel");
}

}  // namespace

std::string LaunchTokensToRows(const char* x, const int32_t* token_dest_pos, const int32_t* self_token,
                               const int32_t* recv_rows, const int32_t* recv_counts, const int32_t* row_slot,
                               char* out, int64_t num_tokens, int64_t row_bytes, int64_t num_rows, int64_t topk,
                               const GroupView& group, const NcclSwap& swap, cudaStream_t stream) {
  const int64_t steps = CopySteps(row_bytes);
  const int64_t units = num_tokens * (group.num_ranks - 1) + num_tokens + num_rows;  // peer sends, own, rows
  const int send_pieces = PiecesPerRow(units, steps, group);
  const int expand_pieces = PiecesPerRow(group.num_ranks * num_tokens, steps, group);
  std::string error = CheckItems(units * send_pieces, group.num_ranks * num_tokens * expand_pieces);
  if (!error.empty() || !(error = LaunchArrive(nullptr, group, stream)).empty()) return error;
  TokensToRowsSendKernel<<<BlocksFor(units * send_pieces, group), kThreads, 0, stream>>>(
      x, token_dest_pos, self_token, recv_rows, recv_counts, row_slot, out, num_tokens, row_bytes, num_rows, topk,
      send_pieces, group);
  if (!(error = LaunchStatus("TokensToRowsSendKernel")).empty()) return error;
  if (group.nccl_ranks != 0 && !(error = swap(group.outbox, num_tokens * row_bytes, nullptr)).empty()) return error;
  TokensToRowsExpandKernel<<<BlocksFor(group.num_ranks * num_tokens * expand_pieces, group), kThreads, 0, stream>>>(
      recv_rows, recv_counts, out, num_tokens, row_bytes, topk, expand_pieces, group);
  return LaunchStatus("TokensToRowsExpandKernel");
}

std::string LaunchRowsToTokens(const void* y, const float* weights, const int32_t* recv_rows,
                               const int32_t* recv_counts, const int32_t* token_dest_pos, void* out,
                               FloatType type, int64_t num_tokens, int64_t hidden, int64_t topk,
                               const GroupView& group, const NcclSwap& swap, cudaStream_t stream) {
  switch (type) {
    case FloatType::kF32:
      return LaunchRowsToTokensTyped(static_cast<const float*>(y), weights, recv_rows, recv_counts, token_dest_pos,
                                     static_cast<float*>(out), num_tokens, hidden, topk, group, swap, stream);
    case FloatType::kBF16:
      return LaunchRowsToTokensTyped(static_cast<const __nv_bfloat16*>(y), weights, recv_rows, recv_counts,
                                     token_dest_pos, static_cast<__nv_bfloat16*>(out), num_tokens, hidden, topk,
                                     group, swap, stream);
    case FloatType::kF16:
      return LaunchRowsToTokensTyped(static_cast<const __half*>(y), weights, recv_rows, recv_counts, token_dest_pos,
                                     static_cast<__half*>(out), num_tokens, hidden, topk, group, swap, stream);
  }
  return "unknown float type";
}

}  // namespace jax_ep
