// The backward pass of combine: each token's cotangent g goes along the handle's routing to the ranks that hold
// its rows (the send phase of a dispatch), and each held row gets, where it lives, dy = w * g in y's type and
// dweights = <g, y[row]> in float32. Rows that hold no slot get 0, but for dy past the data (the ragged tail),
// which is not written. A token's pieces of H are consecutive warps of one block, which add their parts of each
// dot in piece order in shared memory, so every value is the same on every run.
#include "launch.h"
#include "protocol.cuh"
#include "rows.cuh"

namespace jax_ep {

namespace {

// The call, and what the launcher derives from it for the kernels.
struct BackwardParams : CombineBackwardCall {
  int64_t row_bytes;
  int width;  // elements a lane handles at once: 16 bytes of y's type when the hidden size allows, else 1
  int32_t steps;  // SumSteps(hidden, width)
  DispatchRegion region;
  Divisor send_pieces, recv_pieces;  // recv_pieces divides kSumWarps
  Divisor fill_pieces;               // pieces of the rows whose dy is zeroed (FillPieces)
  Divisor peers, tokens;
  bool do_send, do_receive;
};

// Blocks of half the threads of the other kernels, so that each thread may hold 128 registers: a warp keeps 2 steps
// (32 lanes x 16 bytes) of g, and of 8 rows of y, in flight at once.
constexpr int kSumThreads = 512;
constexpr int kSumWarps = kSumThreads / 32;
constexpr int kStepsHeld = 2;
constexpr int kRowsAtOnce = 8;

template <typename Y>
__device__ inline float Dot16(const uint4& a, const uint4& b) {
  const Y* u = reinterpret_cast<const Y*>(&a);
  const Y* v = reinterpret_cast<const Y*>(&b);
  float sum = 0.0f;
#pragma unroll
  for (int i = 0; i < Wide<Y>(); ++i) sum += ToFloat(u[i]) * ToFloat(v[i]);
  return sum;
}

template <typename Y>
__device__ inline uint4 Scale16(const uint4& a, float w) {
  uint4 out;
  const Y* u = reinterpret_cast<const Y*>(&a);
  Y* o = reinterpret_cast<Y*>(&out);
#pragma unroll
  for (int i = 0; i < Wide<Y>(); ++i) o[i] = FromFloat<Y>(ToFloat(u[i]) * w);
  return out;
}

__device__ inline float WarpSum(float value) {
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_xor_sync(0xffffffffu, value, offset);
  return value;
}

// A token's row weights on their way from memory: lane l loads those of its held rows l and l + 32 (by k), bound
// for w[to_a] and w[to_b] of the warp's shared array. The second (topk > 32 only) is stored at once; Store() puts
// the first there once the loads of g and y are in flight, so that its latency overlaps theirs instead of coming
// before them (at T=128, H=7168 on one H200: about 2 us of 18).
struct PendingWeight {
  float a = 1.0f;
  int at_a = -1;  // -1: nothing pending in this lane
  __device__ void Load(const float* weights, int32_t row_a, int32_t row_b, int to_a, int to_b, float* w) {
    at_a = row_a >= 0 ? to_a : -1;
    a = weights != nullptr && row_a >= 0 ? weights[row_a] : 1.0f;
    if (row_b >= 0) w[to_b] = weights == nullptr ? 1.0f : weights[row_b];
  }
  // Every lane of the warp calls it.
  __device__ void Store(float* w) {
    if (at_a >= 0) w[at_a] = a;
    at_a = -1;
    __syncwarp();
  }
};

// One warp: a token's rows that this rank holds (rows_by_k[k] >= 0) into the warp's shared array, and their
// weights on their way (PendingWeight). Returns how many rows there are.
__device__ inline int HeldRows(const int32_t* rows_by_k, int64_t topk, const float* weights, int32_t* rows,
                               float* w, PendingWeight& pending, int lane) {
  const int32_t a = lane < topk ? rows_by_k[lane] : -1;
  const int32_t b = lane + 32 < topk ? rows_by_k[lane + 32] : -1;
  const unsigned held_a = __ballot_sync(0xffffffffu, a >= 0), held_b = __ballot_sync(0xffffffffu, b >= 0);
  const unsigned below = (1u << lane) - 1;
  const int at_a = __popc(held_a & below), at_b = __popc(held_a) + __popc(held_b & below);
  pending.Load(weights, a, b, at_a, at_b, w);
  if (a >= 0) rows[at_a] = a;
  if (b >= 0) rows[at_b] = b;
  __syncwarp();
  return __popc(held_a) + __popc(held_b);
}

// One warp: elements [begin, end) of token row g, for each of its `count` rows: the dy row, and (with dots) this
// piece's part of <g, y[row]> added to dots[j] in step order.
template <typename Y>
__device__ void BackwardPiece(const BackwardParams& p, const Y* g, const int32_t* rows, float* w,
                              PendingWeight& pending, int count, int64_t begin, int64_t end, float* dots, int lane) {
  constexpr int kWide = Wide<Y>();
  const Y* y = static_cast<const Y*>(p.y);
  Y* dy = static_cast<Y*>(p.outputs.dy);
  const int64_t H = p.hidden;
  if (p.width == kWide) {
    for (int64_t e0 = begin; e0 < end; e0 += 32 * kWide * kStepsHeld) {
      uint4 gv[kStepsHeld];
#pragma unroll
      for (int m = 0; m < kStepsHeld; ++m) {
        const int64_t e = e0 + (m * 32 + lane) * kWide;
        if (e < end) gv[m] = __ldcg(reinterpret_cast<const uint4*>(g + e));
      }
      for (int j0 = 0; j0 < count; j0 += kRowsAtOnce) {
        uint4 yv[kRowsAtOnce][kStepsHeld];
        if (dots != nullptr) {  // every load of these rows in flight before any arithmetic
#pragma unroll
          for (int r = 0; r < kRowsAtOnce; ++r) {
#pragma unroll
            for (int m = 0; m < kStepsHeld; ++m) {
              const int64_t e = e0 + (m * 32 + lane) * kWide;
              if (j0 + r < count && e < end) yv[r][m] = *reinterpret_cast<const uint4*>(y + rows[j0 + r] * H + e);
            }
          }
        }
        pending.Store(w);
#pragma unroll
        for (int r = 0; r < kRowsAtOnce; ++r) {
          if (j0 + r >= count) break;
          const int64_t row = rows[j0 + r];
          float part = 0.0f;
#pragma unroll
          for (int m = 0; m < kStepsHeld; ++m) {
            const int64_t e = e0 + (m * 32 + lane) * kWide;
            if (e >= end) continue;
            *reinterpret_cast<uint4*>(dy + row * H + e) = Scale16<Y>(gv[m], w[j0 + r]);
            if (dots != nullptr) part += Dot16<Y>(gv[m], yv[r][m]);
          }
          if (dots != nullptr) {
            part = WarpSum(part);
            if (lane == 0) dots[j0 + r] += part;
          }
        }
      }
    }
    return;
  }
  pending.Store(w);
  for (int64_t e0 = begin; e0 < end; e0 += 32) {
    const int64_t e = e0 + lane;
    const float gvalue = e < end ? LoadStagedOne(g + e) : 0.0f;
    for (int j = 0; j < count; ++j) {
      const int64_t at = static_cast<int64_t>(rows[j]) * H + e;
      float part = 0.0f;
      if (e < end) {
        dy[at] = FromFloat<Y>(gvalue * w[j]);
        if (dots != nullptr) part = gvalue * ToFloat(y[at]);
      }
      if (dots != nullptr) {
        part = WarpSum(part);
        if (lane == 0) dots[j] += part;
      }
    }
  }
}

template <typename Y>
__global__ void __launch_bounds__(kSumThreads, 1) CombineBackwardKernel(BackwardParams p, GroupView g) {
  __shared__ int32_t held_rows[kSumWarps][kMaxTopk];
  __shared__ float held_weights[kSumWarps][kMaxTopk];
  __shared__ float dots[kSumWarps][kMaxTopk];
  const Call call = CurrentCall(g, kOpCombineBackward, p.origin);
  const GridWarp<kSumWarps> at;
  const int R = g.num_ranks, me = g.rank;
  const Phase phase = PhaseOf(p.do_send, p.do_receive);
  const int64_t T = p.num_tokens, K = p.topk, H = p.hidden;
  // The warp's first item of the empty-row loop below reads row_slot (an input, which no peer writes) before the
  // call check, so that the two loads overlap.
  const int64_t fill_items = (p.num_rows + 31) / 32 * p.fill_pieces.value;
  int32_t first_slot = 0;
  if (p.do_receive && at.first < fill_items) {
    const int64_t n = static_cast<int64_t>(SplitItem(at.first, p.fill_pieces).unit) * 32 + at.lane;
    if (n < p.num_rows) first_slot = p.row_slot[n];
  }
  const bool may_run = CallMayRun(g, call, p.axis_index, phase);
  const uint32_t arrival = p.do_receive ? ArriveCall(g) : 0;

  if (p.do_send) {
    if (p.sent != nullptr && blockIdx.x == 0 && threadIdx.x == 0) *p.sent = 0.0f;
    SendShares(g, call, phase, p.region.bytes, [&](uint32_t share) {
      if (!may_run) return;
      for (int64_t item = static_cast<int64_t>(share) * kSumWarps + at.warp; item < T * (R - 1) * p.send_pieces.value;
           item += at.stride) {
        const PeerItem up = SplitPeerItem(item, p.send_pieces, p.peers, me);
        const int32_t pos = p.token_dest_pos[up.token * R + up.dest];
        if (pos < 0) continue;
        StoreTokenPiece(g, call, p.region, static_cast<const char*>(p.g), p.row_bytes, up.token, up.dest, pos,
                        p.send_pieces, up.piece, at.lane);
      }
    });
  }
  if (!p.do_receive) return;
  NoteSwapDone(g, call);
  const bool with_dots = p.outputs.dweights != nullptr;
  float* my_dots = with_dots ? dots[at.warp] : nullptr;
  const Divisor& pieces = p.recv_pieces;
  // Rounds over items [first, last) of R * T * pieces, which every block of the grid runs alike (the pieces of a
  // token meet at __syncthreads to add their dots). Item unit u = s * T + i is token i of rank me + s (mod R): this
  // rank's own tokens, whose cotangent comes straight from g, are the first T units, done before the wait.
  const auto rounds = [&](int64_t first, int64_t last) {
    for (int64_t base = first + static_cast<int64_t>(blockIdx.x) * kSumWarps; base < last; base += at.stride) {
      const int64_t item = base + at.warp;
      int count = 0, piece = 0;
      if (item < last) {
        const UnitPiece up = SplitItem(item, pieces);
        const int shift = p.tokens.Divide(up.unit);
        const int source = me + shift < R ? me + shift : me + shift - R;
        const int32_t i = up.unit - shift * static_cast<int32_t>(T);
        piece = up.piece;
        const int32_t* rows_by_k = nullptr;
        const char* src = nullptr;
        if (source == me) {
          const int32_t pos = p.token_dest_pos[i * R + me];
          if (pos >= 0) {
            rows_by_k = p.recv_rows + (me * T + pos) * K;
            src = static_cast<const char*>(p.g) + i * p.row_bytes;
          }
        } else if (i < p.recv_counts[source]) {
          rows_by_k = p.recv_rows + (source * T + i) * K;
          src = RegionFrom(g, call, source, p.region.bytes) + p.region.rows + i * p.region.stride;
        }
        if (rows_by_k != nullptr) {
          PendingWeight pending;
          count = HeldRows(rows_by_k, K, p.weights, held_rows[at.warp], held_weights[at.warp], pending, at.lane);
          if (with_dots) {
            for (int j = at.lane; j < count; j += 32) my_dots[j] = 0.0f;
            __syncwarp();
          }
          int64_t begin, end;
          PieceElements(H, p.width, p.steps, pieces, piece, &begin, &end);
          BackwardPiece<Y>(p, reinterpret_cast<const Y*>(src), held_rows[at.warp], held_weights[at.warp], pending,
                           count, begin, end, my_dots, at.lane);
        }
      }
      if (with_dots) {
        __syncthreads();
        if (count > 0 && piece == 0) {  // warps warp .. warp + pieces - 1 hold this token's parts, in piece order
          for (int j = at.lane; j < count; j += 32) {
            float total = 0.0f;
            for (int w = 0; w < pieces.value; ++w) total += dots[at.warp + w][j];
            p.outputs.dweights[held_rows[at.warp][j]] = total;
          }
        }
        __syncthreads();
      }
    }
  };

  // What needs no peer goes before the wait for the peers: the rows that hold no slot (an item per 32 rows and
  // piece: dweights 0, and dy 0 inside the data; the ragged tail's dy is unspecified, and writing it would cost as
  // much as the data's at R = 2), then this rank's own tokens. The rows first: after the token rounds, their
  // values made ptxas spill the rounds' registers.
  const int64_t own_items = T * pieces.value;
  if (may_run) {
    for (int64_t item = at.first; item < fill_items; item += at.stride) {
      const UnitPiece up = SplitItem(item, p.fill_pieces);
      const int64_t n0 = static_cast<int64_t>(up.unit) * 32, n = n0 + at.lane;
      const int32_t slot = item == at.first ? first_slot : (n < p.num_rows ? p.row_slot[n] : 0);
      if (slot < 0 && with_dots && up.piece == 0) p.outputs.dweights[n] = 0.0f;
      int64_t begin, end;
      PieceBytes(p.row_bytes, p.fill_pieces, up.piece, &begin, &end);
      for (unsigned mask = __ballot_sync(0xffffffffu, slot == kNoSlot); mask != 0; mask &= mask - 1) {
        CopyRow(nullptr, static_cast<char*>(p.outputs.dy) + (n0 + __ffs(mask) - 1) * p.row_bytes + begin, end - begin,
                at.lane);
      }
    }
    rounds(0, own_items);
  }
  if (!may_run || !WaitPeers(g, call, p.region.bytes)) {
    Poison(p.outputs.dy, p.num_rows * p.row_bytes);
    Poison(p.outputs.dweights, p.num_rows * 4);
    if (may_run) {  // again what this block wrote before the wait, over which another block may have poisoned
      for (int64_t item = at.first; item < fill_items; item += at.stride) {
        const UnitPiece up = SplitItem(item, p.fill_pieces);
        const int64_t n0 = static_cast<int64_t>(up.unit) * 32;
        int64_t begin, end;
        PieceBytes(p.row_bytes, p.fill_pieces, up.piece, &begin, &end);
        for (int64_t n = n0; n < n0 + 32 && n < p.num_rows; ++n) {
          PoisonBytes(static_cast<char*>(p.outputs.dy) + n * p.row_bytes + begin, end - begin, at.lane);
        }
        if (with_dots && n0 + at.lane < p.num_rows) PoisonWord(p.outputs.dweights + n0 + at.lane);
      }
      for (int64_t item = static_cast<int64_t>(blockIdx.x) * kSumWarps + at.warp; item < own_items; item += at.stride) {
        const UnitPiece up = SplitItem(item, pieces);
        const int32_t pos = p.token_dest_pos[up.unit * R + me];
        if (pos < 0) continue;
        const int32_t* rows_by_k = p.recv_rows + (me * T + pos) * K;
        int64_t begin, end;
        PieceElements(H, p.width, p.steps, pieces, up.piece, &begin, &end);
        const int64_t item_bytes = H > 0 ? p.row_bytes / H : 0;
        for (int64_t k = 0; k < K; ++k) {
          const int32_t row = rows_by_k[k];
          if (row < 0) continue;
          PoisonBytes(static_cast<char*>(p.outputs.dy) + row * p.row_bytes + begin * item_bytes,
                      (end - begin) * item_bytes, at.lane);
          if (with_dots && up.piece == 0 && at.lane == 0) PoisonWord(p.outputs.dweights + row);
        }
      }
    }
    FinishCall(g, call, arrival);
    return;
  }
  rounds(own_items, R * T * pieces.value);
  FinishCall(g, call, arrival);
}

// The smallest power of two at least `pieces`, at most kSumWarps: it divides kSumWarps, so a token's
// pieces share a block (pieces past the row's steps are empty).
int PiecesInBlock(int pieces) {
  int result = 1;
  while (result < pieces && result < kSumWarps) result *= 2;
  return result;
}

template <typename Y>
Status Run(BackwardParams p, const GroupView& g, const NcclSwap& swap, cudaStream_t stream, Phase phase) {
  const int R = g.num_ranks;
  p.width = p.hidden % Wide<Y>() == 0 ? Wide<Y>() : 1;
  const int64_t units = p.num_tokens * R;
  p.steps = static_cast<int32_t>(SumSteps(p.hidden, p.width));
  p.send_pieces = Divisor(PiecesPerRow(p.num_tokens * (R - 1), CopySteps(p.row_bytes), g.max_blocks, kSumWarps));
  p.recv_pieces = Divisor(PiecesInBlock(PiecesPerRow(units, p.steps, g.max_blocks, kSumWarps)));
  p.peers = Divisor(R - 1);
  p.tokens = Divisor(p.num_tokens);
  const int64_t groups = (p.num_rows + 31) / 32;
  p.fill_pieces = Divisor(FillPieces(groups, CopySteps(p.row_bytes), g.max_blocks, kSumWarps));
  const int64_t send_items = p.num_tokens * (R - 1) * p.send_pieces.value;
  const int64_t recv_items = std::max(units * p.recv_pieces.value, groups * p.fill_pieces.value);
  const Status checked = CheckItems(std::max(send_items, recv_items));
  if (!checked.ok()) return checked;
  const auto launch = [&](bool send, bool receive, int64_t items) {
    p.do_send = send;
    p.do_receive = receive;
    CombineBackwardKernel<Y><<<BlocksFor(items, g.max_blocks, kSumWarps), kSumThreads, 0, stream>>>(p, g);
    return LaunchStatus("CombineBackwardKernel");
  };
  return RunTransfer(g, swap, p.region.bytes, send_items, recv_items, phase, launch);
}

}  // namespace

Status LaunchCombineBackward(const CombineBackwardCall& c, const GroupView& g, const NcclSwap& swap,
                             cudaStream_t stream, Phase phase) {
  const Status limits = CheckLimits(c.topk, 0);
  if (!limits.ok()) return limits;
  const int64_t item = c.type == FloatType::kF32 ? 4 : 2;
  BackwardParams p{c};
  p.origin.split_start = phase == Phase::kStart;
  p.row_bytes = c.hidden * item;
  if (c.weights == nullptr) p.outputs.dweights = nullptr;
  p.region = DispatchRegion(c.num_tokens, c.topk, 0, p.row_bytes);
  const Status staging = CheckStaging(p.region.bytes, g);
  if (!staging.ok()) return staging;
  switch (c.type) {
    case FloatType::kF32:
      return Run<float>(p, g, swap, stream, phase);
    case FloatType::kBF16:
      return Run<__nv_bfloat16>(p, g, swap, stream, phase);
    case FloatType::kF16:
      return Run<__half>(p, g, swap, stream, phase);
  }
  return Status::InvalidArgument("unknown float type");
}

Status PrepareCombineBackwardKernels() {
  return LoadKernels({reinterpret_cast<const void*>(CombineBackwardKernel<float>),
                      reinterpret_cast<const void*>(CombineBackwardKernel<__nv_bfloat16>),
                      reinterpret_cast<const void*>(CombineBackwardKernel<__half>)},
                     "CombineBackwardKernel");
}

}  // namespace jax_ep
