// The combine kernel: on the expert side, each token received from a peer gets its delivered rows summed in
// float32 in ascending row order, rounded to the partial type and stored once into the peer's staging half;
// then each source adds, for every token, the partial sums of all ranks in ascending rank order (its own
// computed on the spot from y, or staged like the others' in a split combine) and rounds once to y's type. With
// row values (the backward pass of dispatch), each slot's value travels back with its token.
#include <algorithm>

#include "launch.h"
#include "protocol.cuh"
#include "rows.cuh"

namespace jax_ep {

namespace {

// The call, and what the launcher derives from it for the kernels.
struct CombineParams : CombineCall {
  int width;  // elements a lane handles at once: CombineWide when the hidden size allows, else 1
  CombineRegion region;
  int send_pieces, recv_pieces;
  bool do_send, do_receive;
};

// One warp: a token's delivered rows (rows_by_k[k], -1 for none) in ascending order with their weights, into
// the warp's shared arrays. Returns how many there are.
__device__ int SortedRows(const int32_t* rows_by_k, int64_t topk, const float* weights, int32_t* rows, float* w,
                          int lane) {
  const int32_t a = lane < topk ? rows_by_k[lane] : -1;
  const int32_t b = lane + 32 < topk ? rows_by_k[lane + 32] : -1;
  int below_a = 0, below_b = 0;
  const int first_half = topk < 32 ? static_cast<int>(topk) : 32;
  for (int j = 0; j < first_half; ++j) {
    const int32_t other = __shfl_sync(0xffffffffu, a, j);
    below_a += other >= 0 && other < a;
    below_b += other >= 0 && other < b;
  }
  for (int j = 0; j + 32 < topk; ++j) {
    const int32_t other = __shfl_sync(0xffffffffu, b, j);
    below_a += other >= 0 && other < a;
    below_b += other >= 0 && other < b;
  }
  const int count = __popc(__ballot_sync(0xffffffffu, a >= 0)) + __popc(__ballot_sync(0xffffffffu, b >= 0));
  if (a >= 0) {
    rows[below_a] = a;
    w[below_a] = weights == nullptr ? 1.0f : weights[a];
  }
  if (b >= 0) {
    rows[below_b] = b;
    w[below_b] = weights == nullptr ? 1.0f : weights[b];
  }
  __syncwarp();
  return count;
}

// The float32 sum over the sorted rows of w * y[row][e : e + width], in row order.
template <typename T, int kWide>
__device__ inline void PartialSum(const T* y, int64_t hidden, const int32_t* rows, const float* w, int count,
                                  int64_t e, int width, float (&acc)[kWide]) {
  using Raw = Chunk<kWide * sizeof(T)>;
#pragma unroll
  for (int v = 0; v < kWide; ++v) acc[v] = 0.0f;
  if (width != kWide) {
    for (int j = 0; j < count; ++j) acc[0] += w[j] * ToFloat(y[rows[j] * hidden + e]);
    return;
  }
  constexpr int kLoadsInFlight = 4;
  for (int j0 = 0; j0 < count; j0 += kLoadsInFlight) {
    Raw raw[kLoadsInFlight];
#pragma unroll
    for (int m = 0; m < kLoadsInFlight; ++m) {
      if (j0 + m < count) raw[m] = *reinterpret_cast<const Raw*>(y + rows[j0 + m] * hidden + e);
    }
#pragma unroll
    for (int m = 0; m < kLoadsInFlight; ++m) {
      if (j0 + m >= count) break;
      const T* values = reinterpret_cast<const T*>(&raw[m]);
#pragma unroll
      for (int v = 0; v < kWide; ++v) acc[v] += w[j0 + m] * ToFloat(values[v]);
    }
  }
}

// kStageOwn (a split combine): this rank's partial sums are staged in the send phase like the peers'. kOneRank: a
// group of one GPU, which sums every token from y: its code leaves out the staged parts (at T=128 each warp runs
// most of the kernel once, and every stretch of code waits on its fetch).
template <typename Y, typename P, bool kStageOwn, bool kOneRank>
__global__ void __launch_bounds__(kThreads) CombineKernel(CombineParams p, GroupView g) {
  static_assert(!(kStageOwn && kOneRank), "a group of one GPU stages nothing");
  constexpr int kWide = CombineWide<Y, P>();
  __shared__ int32_t held_rows[kWarps][kMaxTopk];
  __shared__ float held_weights[kWarps][kMaxTopk];
  const Call call = CurrentCall(g, kOpCombine, p.origin);
  const GridWarp<kWarps> at;
  const int R = kOneRank ? 1 : g.num_ranks, me = kOneRank ? 0 : g.rank;
  const int64_t T = p.num_tokens, H = p.hidden, K = p.topk;
  const Y* y = static_cast<const Y*>(p.y);
  int32_t* rows = held_rows[at.warp];
  float* weights = held_weights[at.warp];
  const Phase phase = PhaseOf(p.do_send, p.do_receive);
  const bool may_run = CallMayRun(g, call, p.axis_index, phase);
  const uint32_t arrival = p.do_receive ? ArriveCall(g) : 0;

  if (p.do_send) {
    if (p.sent != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *p.sent = 0.0f;
    SendShares(g, call, phase, p.region.bytes, [&](uint32_t share) {
      if constexpr (!kOneRank) {
        if (!may_run) return;
        const int64_t sources = kStageOwn ? R : R - 1;
        for (int64_t item = static_cast<int64_t>(share) * kWarps + at.warp; item < sources * T * p.send_pieces;
             item += at.stride) {
          const UnitPiece up = SplitItem(item, p.send_pieces);
          const int32_t peer_index = up.unit / static_cast<int32_t>(T);
          const int32_t i = up.unit - peer_index * static_cast<int32_t>(T);
          // Rank me + 1 + peer_index (mod R; me + peer_index with kStageOwn): the ranks start at different peers, so
          // that they do not all store into one GPU at a time.
          const int shifted = me + (kStageOwn ? 0 : 1) + peer_index;
          const int source = shifted < R ? shifted : shifted - R;
          if (i >= p.recv_counts[source]) continue;
          const int32_t* rows_by_k = p.recv_rows + (source * T + i) * K;
          const int count = SortedRows(rows_by_k, K, p.weights, rows, weights, at.lane);
          char* region = RegionAt(g, call, source, p.region.bytes);
          P* dst = reinterpret_cast<P*>(region + p.region.rows + i * p.region.stride);
          int64_t begin, end;
          PieceElements(H, p.width, p.send_pieces, up.piece, &begin, &end);
          for (int64_t e = begin + at.lane * p.width; e < end; e += 32 * p.width) {
            float acc[kWide];
            PartialSum(y, H, rows, weights, count, e, p.width, acc);
            StoreValues<P, kWide>(dst + e, acc, p.width);
          }
          if (up.piece == 0 && p.row_values != nullptr) {
            float* values = reinterpret_cast<float*>(region + p.region.values) + i * K;
            for (int64_t k = at.lane; k < K; k += 32) {
              values[k] = rows_by_k[k] >= 0 ? p.row_values[rows_by_k[k]] : 0.0f;
            }
          }
          __syncwarp();
        }
      }
    });
  }
  if (!p.do_receive) return;
  if (!kOneRank) NoteSwapDone(g, call);
  if (!may_run || (!kOneRank && !WaitPeers(g, call, p.region.bytes))) {
    Poison(p.outputs.out, T * H * static_cast<int64_t>(sizeof(Y)));
    Poison(p.outputs.slot_values, T * K * 4);
    FinishCall(g, call, arrival);
    return;
  }

  Y* out = static_cast<Y*>(p.outputs.out);
  for (int64_t item = at.first; item < T * p.recv_pieces; item += at.stride) {
    const UnitPiece up = SplitItem(item, p.recv_pieces);
    const int64_t t = up.unit;
    const int32_t* dest_pos = p.token_dest_pos + t * R;
    const int32_t own_pos = dest_pos[me];
    const int count = own_pos < 0 || kStageOwn
                          ? 0
                          : SortedRows(p.recv_rows + (me * T + own_pos) * K, K, p.weights, rows, weights, at.lane);
    int64_t begin, end;
    PieceElements(H, p.width, p.recv_pieces, up.piece, &begin, &end);
    for (int64_t e = begin + at.lane * p.width; e < end; e += 32 * p.width) {
      float total[kWide] = {};
      for (int d = 0; d < R; ++d) {
        const int32_t pos = dest_pos[d];
        if (pos < 0) continue;
        float part[kWide];
        if (kOneRank || (d == me && !kStageOwn)) {
          PartialSum(y, H, rows, weights, count, e, p.width, part);
#pragma unroll
          for (int v = 0; v < kWide; ++v) part[v] = ToFloat(FromFloat<P>(part[v]));  // the partial's rounding
        } else {
          const char* region = RegionFrom(g, call, d, p.region.bytes);
          LoadStaged<P, kWide>(reinterpret_cast<const P*>(region + p.region.rows + pos * p.region.stride) + e, part,
                               p.width);
        }
#pragma unroll
        for (int v = 0; v < kWide; ++v) total[v] += part[v];
      }
      StoreValues<Y, kWide>(out + t * H + e, total, p.width);
    }
    if (up.piece == 0 && p.outputs.slot_values != nullptr) {
      for (int64_t k = at.lane; k < K; k += 32) {
        const int32_t d = p.slot_dest[t * K + k];
        float value = 0.0f;
        if (d >= 0 && dest_pos[d] >= 0) {
          if (kOneRank || (d == me && !kStageOwn)) {
            const int32_t row = p.recv_rows[(me * T + dest_pos[d]) * K + k];
            value = row >= 0 ? p.row_values[row] : 0.0f;
          } else {
            const char* region = RegionFrom(g, call, d, p.region.bytes);
            value = __ldcg(reinterpret_cast<const float*>(region + p.region.values) + dest_pos[d] * K + k);
          }
        }
        p.outputs.slot_values[t * K + k] = value;
      }
    }
    __syncwarp();
  }
  FinishCall(g, call, arrival);
}

template <typename Y, typename P>
Status Run(CombineParams p, const GroupView& g, const NcclSwap& swap, cudaStream_t stream, Phase phase,
           bool stage_own) {
  const int R = g.num_ranks;
  p.width = p.hidden % CombineWide<Y, P>() == 0 ? CombineWide<Y, P>() : 1;
  const int64_t steps = SumSteps(p.hidden, p.width), sources = stage_own ? R : R - 1;
  p.send_pieces = PiecesPerRow(sources * p.num_tokens, steps, g.max_blocks);
  p.recv_pieces = PiecesPerRow(p.num_tokens, steps, g.max_blocks);
  const int64_t send_items = sources * p.num_tokens * p.send_pieces, recv_items = p.num_tokens * p.recv_pieces;
  const Status checked = CheckItems(std::max(send_items, recv_items));
  if (!checked.ok()) return checked;
  const auto launch = [&](bool send, bool receive, int64_t items) {
    p.do_send = send;
    p.do_receive = receive;
    const auto kernel = stage_own ? CombineKernel<Y, P, true, false>
                        : R == 1  ? CombineKernel<Y, P, false, true>
                                  : CombineKernel<Y, P, false, false>;
    kernel<<<BlocksFor(items, g.max_blocks), kThreads, 0, stream>>>(p, g);
    return LaunchStatus("CombineKernel");
  };
  return RunTransfer(g, swap, p.region.bytes, send_items, recv_items, phase, launch);
}

}  // namespace

Status LaunchCombine(const CombineCall& c, const GroupView& g, const NcclSwap& swap, cudaStream_t stream,
                     Phase phase) {
  const Status limits = CheckLimits(c.topk, 0);
  if (!limits.ok()) return limits;
  const int64_t item = c.type == FloatType::kF32 || c.partial_f32 ? 4 : 2;
  CombineParams p{c};
  p.origin.split_start = phase == Phase::kStart;
  p.region = CombineRegion(c.num_tokens, c.topk, c.hidden * item);
  const Status staging = CheckStaging(p.region.bytes, g);
  if (!staging.ok()) return staging;
  if (c.stage_own && phase == Phase::kWhole) return Status::InvalidArgument("stage_own is for split combines");
  switch (c.type) {
    case FloatType::kF32:
      return Run<float, float>(p, g, swap, stream, phase, c.stage_own);
    case FloatType::kBF16:
      return c.partial_f32 ? Run<__nv_bfloat16, float>(p, g, swap, stream, phase, c.stage_own)
                           : Run<__nv_bfloat16, __nv_bfloat16>(p, g, swap, stream, phase, c.stage_own);
    case FloatType::kF16:
      return c.partial_f32 ? Run<__half, float>(p, g, swap, stream, phase, c.stage_own)
                           : Run<__half, __half>(p, g, swap, stream, phase, c.stage_own);
  }
  return Status::InvalidArgument("unknown float type");
}

template <typename Y, typename P>
Status LoadCombineKernels() {
  return LoadKernels(
      {
          reinterpret_cast<const void*>(CombineKernel<Y, P, false, false>),
          reinterpret_cast<const void*>(CombineKernel<Y, P, true, false>),
          reinterpret_cast<const void*>(CombineKernel<Y, P, false, true>),
      },
      "CombineKernel");
}

Status PrepareCombineKernels() {
  for (const Status& status :
       {LoadCombineKernels<float, float>(), LoadCombineKernels<__nv_bfloat16, __nv_bfloat16>(),
        LoadCombineKernels<__nv_bfloat16, float>(), LoadCombineKernels<__half, __half>(),
        LoadCombineKernels<__half, float>()}) {
    if (!status.ok()) return status;
  }
  return Status::Ok();
}

}  // namespace jax_ep
