// How warps move rows: 16-byte accesses, rows split into pieces when there are too few rows for the warps,
// and loads of staged data that bypass the non-coherent cache (peers wrote it during this kernel).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>

#include "protocol.cuh"

namespace jax_ep {

// Rows are split into pieces when there are too few rows to keep every warp of the block budget busy
// (small T): one warp then moves one piece, a run of whole steps (a step: 32 lanes x 16 bytes).
constexpr int kMaxPieces = 64;
constexpr int64_t kCopyStep = 32 * 16;

// Steps of a row copy; rows whose size is not a multiple of 16 bytes are never split.
__host__ __device__ inline int64_t CopySteps(int64_t row_bytes) {
  return row_bytes % 16 == 0 ? (row_bytes + kCopyStep - 1) / kCopyStep : 1;
}

// Pieces per row for `units` rows of `steps` steps each: 1 when the rows alone fill the budget (of blocks of
// `block_warps` warps).
inline int PiecesPerRow(int64_t units, int64_t steps, int max_blocks, int block_warps = kWarps) {
  const int64_t warps = static_cast<int64_t>(max_blocks) * block_warps;
  int64_t pieces = units < 1 ? 1 : (warps + units - 1) / units;
  if (pieces > steps) pieces = steps;
  if (pieces > kMaxPieces) pieces = kMaxPieces;
  return static_cast<int>(pieces < 1 ? 1 : pieces);
}

// Pieces per row for zeroing the empty rows among `groups` groups of 32 rows (one warp item a group and piece):
// a warp storing 32 whole rows of zeros one after another took 110 us for 458 KB on one H200 (T=128, H=7168), so
// the rows are split until the groups' pieces could fill the warps of the block budget.
inline int FillPieces(int64_t groups, int64_t steps, int max_blocks, int block_warps = kWarps) {
  return PiecesPerRow(groups, steps, max_blocks, block_warps);
}

// Grid size for `items` warp items, at most the group's block budget.
inline unsigned BlocksFor(int64_t items, int max_blocks, int block_warps = kWarps) {
  const int64_t blocks = (items + block_warps - 1) / block_warps;
  return static_cast<unsigned>(blocks < 1 ? 1 : (blocks > max_blocks ? max_blocks : blocks));
}

// Items of one launch are counted in 32 bits (the launchers check the count): index arithmetic in 64 bits
// costs tens of instructions per division, which small calls pay in latency.
constexpr int64_t kMaxItems = (int64_t{1} << 31) - 1;

// An item of a kernel whose rows are split: item = unit * pieces + piece.
struct UnitPiece {
  int32_t unit;
  int piece;
};
// The combine kernel divides by an int instead: its register-bound loop spilled more with a Divisor's operands
// live (T=4096: 141-147 against 137.6 us on one H200).
__device__ inline UnitPiece SplitItem(int64_t item, int pieces) {
  const int32_t i = static_cast<int32_t>(item);
  if (pieces == 1) return UnitPiece{i, 0};
  const int32_t unit = i / pieces;
  return UnitPiece{unit, static_cast<int>(i - unit * pieces)};
}
__device__ inline UnitPiece SplitItem(int64_t item, const Divisor& pieces) {
  const int32_t i = static_cast<int32_t>(item);
  const int32_t unit = pieces.Divide(i);
  return UnitPiece{unit, static_cast<int>(i - unit * pieces.value)};
}

// An item of a send phase, which moves pieces of tokens to every peer (every rank but this one):
// item = (token * (R - 1) + peer) * pieces + piece, where peer counts the ranks other than `me`.
struct PeerItem {
  int32_t token;
  int dest;
  int piece;
};
__device__ inline PeerItem SplitPeerItem(int64_t item, const Divisor& pieces, const Divisor& peers, int me) {
  const UnitPiece up = SplitItem(item, pieces);
  const int32_t token = peers.Divide(up.unit);
  const int peer = up.unit - token * peers.value;
  return PeerItem{token, peer < me ? peer : peer + 1, up.piece};
}

// Byte range [begin, end) of piece `piece` of a row copy.
__device__ inline void PieceBytes(int64_t row_bytes, const Divisor& pieces, int piece, int64_t* begin, int64_t* end) {
  if (pieces.value == 1) {
    *begin = 0;
    *end = row_bytes;
    return;
  }
  const int32_t steps = static_cast<int32_t>(CopySteps(row_bytes));
  const int32_t first = pieces.Divide(steps * piece), last = pieces.Divide(steps * (piece + 1));
  *begin = first * kCopyStep;
  *end = last * kCopyStep < row_bytes ? last * kCopyStep : row_bytes;
}

// Whether a launch of this many warp items can run.
inline Status CheckItems(int64_t items) {
  if (items <= kMaxItems) return Status::Ok();
  return Status::InvalidArgument("this call needs " + std::to_string(items) + " work items in one kernel, more than the " +
                                 std::to_string(kMaxItems) + " the kernels count; use fewer tokens per call");
}

// Whether a call's regions of `region_bytes` for every rank fit in a staging half of the group.
inline Status CheckStaging(int64_t region_bytes, const GroupView& group) {
  const int64_t need = group.num_ranks * region_bytes;
  if (need <= group.half_bytes) return Status::Ok();
  return Status::Error(StatusCode::kResourceExhausted,
                       "this call needs " + std::to_string(need) +
                           " bytes of staging per half on each GPU, but jax_ep.initialize reserved " +
                           std::to_string(group.half_bytes) +
                           "; initialize with larger sizes (see jax_ep.buffer_size_hint; float32 partial sums need "
                           "dtype=jnp.float32)");
}

// Loads kernels now (cudaFuncGetAttributes), not at their first launch: with lazy loading, a first launch that
// loads a module can stall the context while another kernel of the group spins waiting for this GPU.
inline Status LoadKernels(std::initializer_list<const void*> kernels, const char* name) {
  for (const void* kernel : kernels) {
    cudaFuncAttributes attributes;
    const cudaError_t status = cudaFuncGetAttributes(&attributes, kernel);
    if (status != cudaSuccess) {
      return Status::Internal(std::string("loading ") + name + ": " + cudaGetErrorString(status));
    }
  }
  return Status::Ok();
}

inline Status LaunchStatus(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return Status::Ok();
  return Status::Internal(std::string("launching ") + kernel + ": " + cudaGetErrorString(status));
}

// Runs a transfer, or the phase of it that a split op asks for. A whole transfer is one launch that sends and
// receives, or, with ranks reached through NCCL, a send launch, the swap of `region_bytes` per rank and a
// receive launch; a start is the send launch and the swap, a finish the receive launch. launch(send, receive,
// items) launches the kernel for that many warp items and returns LaunchStatus.
template <typename Launch>
Status RunTransfer(const GroupView& g, const NcclSwap& swap, int64_t region_bytes, int64_t send_items,
                   int64_t recv_items, Phase phase, Launch launch) {
  if (phase == Phase::kWhole && g.nccl_ranks == 0) return launch(true, true, std::max(send_items, recv_items));
  if (phase != Phase::kFinish) {
    Status status = launch(true, false, send_items);
    if (!status.ok()) return status;
    if (g.nccl_ranks != 0 && !(status = swap(region_bytes)).ok()) return status;
  }
  return phase == Phase::kStart ? Status::Ok() : launch(false, true, recv_items);
}

// A 16-byte load: from L2 for data peers stored during this kernel (staged), else a plain load.
template <bool kStaged>
__device__ inline uint4 Load16(const uint4* p) {
  if constexpr (kStaged) {
    return __ldcg(p);
  } else {
    return *p;
  }
}

// 16-byte words each lane holds at once when a warp copies a token to its rows (2 KB per warp; 8 spill at 64
// registers).
constexpr int kPerLane = 4;

// CopyToRows (below) byte by byte, for rows that are not 16-byte aligned; out of line, so that the common path
// stays short.
template <bool kStaged>
__device__ __noinline__ void CopyBytesToRows(const char* src, const int32_t* rows, int count, char* out,
                                             int64_t row_stride, int64_t bytes, int lane) {
  for (int j = 0; j < count; ++j) {
    char* dst = out + rows[j] * row_stride;
    for (int64_t b = lane; b < bytes; b += 32) dst[b] = src == nullptr ? 0 : (kStaged ? __ldcg(src + b) : src[b]);
  }
}

// Whether a copy of `bytes` from src to rows at out + row * row_stride can move 16-byte words.
__device__ inline bool Aligned16(const char* src, const char* out, int64_t row_stride, int64_t bytes) {
  return (bytes | reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(out) | row_stride) % 16 == 0;
}

// One warp writes `bytes` bytes of a token row to every row in rows[0:count) at out + row * row_stride;
// src == nullptr writes zeros. Each part of the token is read once and stored to all of its rows.
template <bool kStaged>
__device__ inline void CopyToRows(const char* src, const int32_t* rows, int count, char* out, int64_t row_stride,
                                  int64_t bytes, int lane) {
  if (count == 0) return;
  if (!Aligned16(src, out, row_stride, bytes)) {
    CopyBytesToRows<kStaged>(src, rows, count, out, row_stride, bytes, lane);
    return;
  }
  const int n = static_cast<int>(bytes / 16);
  const uint4* s = reinterpret_cast<const uint4*>(src);
  for (int base = 0; base < n; base += 32 * kPerLane) {
    uint4 part[kPerLane];
#pragma unroll
    for (int m = 0; m < kPerLane; ++m) {
      const int i = base + lane + 32 * m;
      part[m] = (i < n && s != nullptr) ? Load16<kStaged>(s + i) : make_uint4(0, 0, 0, 0);
    }
    for (int j = 0; j < count; ++j) {
      uint4* d = reinterpret_cast<uint4*>(out + rows[j] * row_stride);
#pragma unroll
      for (int m = 0; m < kPerLane; ++m) {
        const int i = base + lane + 32 * m;
        if (i < n) d[i] = part[m];
      }
    }
  }
}

// One warp copies one row (to a peer's staging, or locally).
__device__ inline void CopyRow(const char* src, char* dst, int64_t bytes, int lane) {
  const int32_t zero = 0;
  CopyToRows<false>(src, &zero, 1, dst, 0, bytes, lane);
}

// Fills `bytes` at p with 0xff (NaN in every float type, -1 in int32), grid-stride over all threads.
__device__ inline void Poison(void* p, int64_t bytes) {
  if (p == nullptr) return;
  const int64_t threads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  char* c = static_cast<char*>(p);
  for (int64_t i = first; i < bytes; i += threads) c[i] = static_cast<char>(0xff);
}

// One warp fills `bytes` at dst with 0xff (a failed call's outputs, as Poison).
__device__ inline void PoisonBytes(void* dst, int64_t bytes, int lane) {
  for (int64_t b = lane; b < bytes; b += 32) static_cast<char*>(dst)[b] = static_cast<char>(0xff);
}

// One thread fills the 4 bytes at dst with 0xff (a failed call's float output, as Poison).
__device__ inline void PoisonWord(void* dst) { *static_cast<uint32_t*>(dst) = 0xffffffffu; }

// Poisons a dispatch start's outputs: token_dest_pos [T, R] and slot_dest [T, K].
__device__ inline void PoisonStart(int32_t* token_dest_pos, int32_t* slot_dest, int64_t num_tokens, int64_t num_ranks,
                                   int64_t topk) {
  Poison(token_dest_pos, num_tokens * num_ranks * 4);
  Poison(slot_dest, num_tokens * topk * 4);
}

// One warp stores piece `piece` (of `pieces`) of token row x[t] at position `pos` of its region for rank `dest`:
// the send phase of a dispatch and of combine's backward pass.
__device__ inline void StoreTokenPiece(const GroupView& g, const Call& call, const DispatchRegion& region,
                                       const char* x, int64_t row_bytes, int32_t t, int dest, int32_t pos,
                                       const Divisor& pieces, int piece, int lane) {
  char* at = RegionAt(g, call, dest, region.bytes) + region.rows + pos * region.stride;
  int64_t begin, end;
  PieceBytes(row_bytes, pieces, piece, &begin, &end);
  CopyRow(x + t * row_bytes + begin, at + begin, end - begin, lane);
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

template <typename T>
constexpr int Wide() {
  return static_cast<int>(16 / sizeof(T));
}

// Values a lane of a combine handles at once: 16 bytes of the wider of y's and the partials' types, so that
// every store of partial sums is one 16-byte access (float32 partials of bf16 y: 8-byte loads of y).
template <typename Y, typename P>
constexpr int CombineWide() {
  return Wide<Y>() < Wide<P>() ? Wide<Y>() : Wide<P>();
}

// The access of kBytes (8 or 16) that moves kWide values at once.
template <int kBytes>
using Chunk = std::conditional_t<kBytes == 16, uint4, uint2>;

// Steps of a sum over `hidden` elements, `width` per lane, and the elements [begin, end) of a piece of a row of
// `steps` such steps.
__host__ __device__ inline int64_t SumSteps(int64_t hidden, int width) {
  return (hidden + 32 * width - 1) / (32 * width);
}
__device__ inline void StepElements(int64_t hidden, int width, int32_t first, int32_t last, int64_t* begin,
                                    int64_t* end) {
  *begin = first * 32 * width;
  *end = std::min<int64_t>(last * 32 * width, hidden);
}
__device__ inline void PieceElements(int64_t hidden, int width, int32_t steps, const Divisor& pieces, int piece,
                                     int64_t* begin, int64_t* end) {
  StepElements(hidden, width, pieces.Divide(steps * piece), pieces.Divide(steps * (piece + 1)), begin, end);
}
__device__ inline void PieceElements(int64_t hidden, int width, int pieces, int piece, int64_t* begin, int64_t* end) {
  const int32_t steps = static_cast<int32_t>(SumSteps(hidden, width));
  StepElements(hidden, width, steps * piece / pieces, steps * (piece + 1) / pieces, begin, end);
}

// `width` values of type P at dst from float32 (one 8- or 16-byte store when the width fills it).
template <typename P, int kWide>
__device__ inline void StoreValues(P* dst, const float (&acc)[kWide], int width) {
  if (width != kWide) {
    dst[0] = FromFloat<P>(acc[0]);
    return;
  }
  using Raw = Chunk<kWide * sizeof(P)>;
  alignas(16) P packed[kWide];
#pragma unroll
  for (int v = 0; v < kWide; ++v) packed[v] = FromFloat<P>(acc[v]);
  *reinterpret_cast<Raw*>(dst) = *reinterpret_cast<const Raw*>(packed);
}

// One value of type P at src, which a peer may have stored during this kernel, as float32.
template <typename P>
__device__ inline float LoadStagedOne(const P* src) {
  if constexpr (sizeof(P) == 4) {
    return __int_as_float(__ldcg(reinterpret_cast<const int*>(src)));
  } else {
    const unsigned short bits = __ldcg(reinterpret_cast<const unsigned short*>(src));
    return ToFloat(*reinterpret_cast<const P*>(&bits));
  }
}

// ... and back: `width` staged values of type P at src (stored by a peer during this kernel) as float32.
template <typename P, int kWide>
__device__ inline void LoadStaged(const P* src, float (&out)[kWide], int width) {
  if (width != kWide) {
    out[0] = LoadStagedOne(src);
    return;
  }
  using Raw = Chunk<kWide * sizeof(P)>;
  alignas(16) P packed[kWide];
  *reinterpret_cast<Raw*>(packed) = __ldcg(reinterpret_cast<const Raw*>(src));
#pragma unroll
  for (int v = 0; v < kWide; ++v) out[v] = ToFloat(packed[v]);
}

}  // namespace jax_ep
