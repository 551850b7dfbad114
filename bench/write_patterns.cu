// The bytes of one dispatch at T=4096, H=7168 bf16, K=8, E=256 (uniform random distinct experts; rows laid out by
// expert, then token, as the ragged layout at R=1), moved in several patterns with every destination precomputed:
// what bounds DispatchKernel's scatter, apart from routing and the protocol. Standalone, no jax_ep code:
//   nvcc -arch=sm_90 -O3 -std=c++17 -o /tmp/write_patterns bench/write_patterns.cu && /tmp/write_patterns
// Prints device µs per launch (CUDA events, 20 launches after 3 warm-ups) and the write rate of each pattern;
// after each timing the rows are poisoned, written once more and compared with their tokens (x holds random
// bytes), and the exit status is 1 if any pattern wrote a wrong row.
#include <cuda_runtime.h>
#include <cstdio>
#include <cstring>
#include <cstdint>
#include <vector>
#include <random>
#include <algorithm>
constexpr int T = 4096, K = 8, E = 256, ROW = 7168 * 2, N = T * K, PER = 4;
#define CK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("%s: %s\n", #x, cudaGetErrorString(e)); return 1; } } while (0)

// One warp's step of a piece of n 16-byte words: lane's words base + lane + 32 m, for m < kPer.
template <int kPer>
__device__ __forceinline__ void LoadStep(const uint4* s, int base, int n, int lane, uint4 (&part)[kPer]) {
#pragma unroll
  for (int m = 0; m < kPer; ++m) { int i = base + lane + 32 * m; if (i < n) part[m] = s[i]; }
}
template <bool kStreaming, int kPer>
__device__ __forceinline__ void StoreStep(uint4* d, int base, int n, int lane, const uint4 (&part)[kPer]) {
#pragma unroll
  for (int m = 0; m < kPer; ++m) {
    int i = base + lane + 32 * m;
    if (i < n) { if (kStreaming) __stcs(d + i, part[m]); else d[i] = part[m]; }
  }
}

// The K layout rows of token t.
__device__ __forceinline__ void TokenRows(const int* dest, int t, int (&rows)[K]) {
#pragma unroll
  for (int k = 0; k < K; ++k) rows[k] = dest[t * K + k];
}
// Piece `piece` (of piece_bytes) of row `row` in an array of ROW-byte rows, as 16-byte words.
__device__ __forceinline__ const uint4* PieceOf(const char* rows, int row, int piece, int piece_bytes) {
  return reinterpret_cast<const uint4*>(rows + static_cast<size_t>(row) * ROW + piece * piece_bytes);
}
__device__ __forceinline__ uint4* PieceOf(char* rows, int row, int piece, int piece_bytes) {
  return reinterpret_cast<uint4*>(rows + static_cast<size_t>(row) * ROW + piece * piece_bytes);
}

template <int kMode>  // 0 plain stores, 1 __stcs stores, 2 row by row (reload from L1/L2)
__global__ void __launch_bounds__(1024) Scatter(const char* x, const int* dest, char* out, int pieces) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * 32, first = blockIdx.x * 32 + threadIdx.x / 32;
  const int piece_bytes = ROW / pieces;
  for (int item = first; item < T * pieces; item += warps) {
    const int t = item / pieces, piece = item % pieces;
    int rows[K];
    TokenRows(dest, t, rows);
    const uint4* s = PieceOf(x, t, piece, piece_bytes);
    const int n = piece_bytes / 16;
    uint4 part[PER];
    if constexpr (kMode == 2) {
      for (int k = 0; k < K; ++k) {
        uint4* d = PieceOf(out, rows[k], piece, piece_bytes);
        for (int base = 0; base < n; base += 32 * PER) {
          LoadStep(s, base, n, lane, part);
          StoreStep<false>(d, base, n, lane, part);
        }
      }
    } else {
      for (int base = 0; base < n; base += 32 * PER) {
        LoadStep(s, base, n, lane, part);
        for (int k = 0; k < K; ++k) {
          StoreStep<kMode == 1>(PieceOf(out, rows[k], piece, piece_bytes), base, n, lane, part);
        }
      }
    }
  }
}

// Rows in the order order[0..N) (nullptr: layout order), each loaded from its token.
template <int kMode>  // 0 gather plain, 1 gather with __stcs
__global__ void __launch_bounds__(1024) Gather(const char* x, const int* token_of_row, char* out, int pieces,
                                               const int* order = nullptr) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * 32, first = blockIdx.x * 32 + threadIdx.x / 32;
  const int piece_bytes = ROW / pieces;
  for (int item = first; item < N * pieces; item += warps) {
    const int r = order == nullptr ? item / pieces : order[item / pieces], piece = item % pieces;
    const int t = token_of_row[r];
    const uint4* s = PieceOf(x, t, piece, piece_bytes);
    uint4* d = PieceOf(out, r, piece, piece_bytes);
    const int n = piece_bytes / 16;
    uint4 part[PER];
    for (int base = 0; base < n; base += 32 * PER) {
      LoadStep(s, base, n, lane, part);
      StoreStep<kMode == 1>(d, base, n, lane, part);
    }
  }
}

// Scatter with kPer 16-byte words per lane, the next step's loads issued before the current step's stores.
template <int kPer>
__global__ void __launch_bounds__(1024) ScatterPipelined(const char* x, const int* dest, char* out, int pieces) {
  const int lane = threadIdx.x % 32;
  const int warps = gridDim.x * 32, first = blockIdx.x * 32 + threadIdx.x / 32;
  const int piece_bytes = ROW / pieces, n = piece_bytes / 16, step = 32 * kPer;
  for (int item = first; item < T * pieces; item += warps) {
    const int t = item / pieces, piece = item % pieces;
    int rows[K];
    TokenRows(dest, t, rows);
    const uint4* s = PieceOf(x, t, piece, piece_bytes);
    uint4 now[kPer], next[kPer];
    LoadStep(s, 0, n, lane, now);
    for (int base = 0; base < n; base += step) {
      LoadStep(s, base + step, n, lane, next);
      for (int k = 0; k < K; ++k) {
        StoreStep<false>(PieceOf(out, rows[k], piece, piece_bytes), base, n, lane, now);
      }
#pragma unroll
      for (int m = 0; m < kPer; ++m) now[m] = next[m];
    }
  }
}

__device__ __forceinline__ uint32_t SharedAddress(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Scatter by the Tensor Memory Accelerator: lane 0 of each of kIssuers warps bulk-loads a piece of a token into
// one of its kStages shared buffers (an mbarrier counts the bytes in) and bulk-stores it to the token's K rows,
// keeping kStages - 1 loads in flight behind the stores; the SM's threads issue nothing per 16 bytes.
template <int kIssuers, int kStages>
__global__ void __launch_bounds__(kIssuers * 32) ScatterTma(const char* x, const int* dest, char* out, int pieces) {
  extern __shared__ __align__(128) unsigned char staged[];
  __shared__ __align__(8) uint64_t landed[kIssuers][kStages];
  const int warp = threadIdx.x / 32;
  if (threadIdx.x % 32 != 0) return;
  const int piece_bytes = ROW / pieces;
  unsigned char* buffers = staged + static_cast<size_t>(warp) * kStages * piece_bytes;
  for (int s = 0; s < kStages; ++s) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;" ::"r"(SharedAddress(&landed[warp][s])));
  }
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
  const int issuers = gridDim.x * kIssuers, first = blockIdx.x * kIssuers + warp, items = T * pieces;
  auto load = [&](int j) {  // this issuer's j-th item into stage j % kStages
    const int item = first + j * issuers;
    if (item >= items) return;
    const int s = j % kStages;
    const uint32_t bar = SharedAddress(&landed[warp][s]);
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(piece_bytes) : "memory");
    const uint4* src = PieceOf(x, item / pieces, item % pieces, piece_bytes);
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
                 ::"r"(SharedAddress(buffers + s * piece_bytes)), "l"(src), "r"(piece_bytes), "r"(bar) : "memory");
  };
  for (int j = 0; j < kStages - 1; ++j) load(j);
  for (int j = 0; first + j * issuers < items; ++j) {
    const int item = first + j * issuers, t = item / pieces, piece = item % pieces, s = j % kStages;
    const uint32_t bar = SharedAddress(&landed[warp][s]), parity = (j / kStages) & 1;
    asm volatile(
        "{\n .reg .pred done;\n WAIT_%=:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
        " @!done bra WAIT_%=;\n}" ::"r"(bar), "r"(parity) : "memory");
    const uint32_t from = SharedAddress(buffers + s * piece_bytes);
    for (int k = 0; k < K; ++k) {
      uint4* to = PieceOf(out, dest[t * K + k], piece, piece_bytes);
      asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(to), "r"(from), "r"(piece_bytes)
                   : "memory");
    }
    asm volatile("cp.async.bulk.commit_group;" ::: "memory");
    asm volatile("cp.async.bulk.wait_group.read 1;" ::: "memory");  // item j - 1's buffer is free again
    load(j + kStages - 1);
  }
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
}

// A block per token: its threads hold the token's words (kWords each) and the block writes the token's rows one
// after another, so the GPU writes about one row per block at a time; kPrefetch loads the block's next token
// before storing this one.
template <int kThreads, int kWords, bool kPrefetch>
__global__ void __launch_bounds__(kThreads) ScatterByBlock(const char* x, const int* dest, char* out) {
  constexpr int kRowWords = ROW / 16;
  static_assert(kThreads * kWords >= kRowWords, "a block holds a whole row");
  uint4 now[kWords], next[kWords];
  auto load = [&](int t, uint4 (&v)[kWords]) {
    const uint4* s = PieceOf(x, t, 0, 0);
#pragma unroll
    for (int m = 0; m < kWords; ++m) {
      const int i = threadIdx.x + m * kThreads;
      if (i < kRowWords && t < T) v[m] = s[i];
    }
  };
  load(blockIdx.x, now);
  for (int t = blockIdx.x; t < T; t += gridDim.x) {
    if (kPrefetch) load(t + gridDim.x, next);
    for (int k = 0; k < K; ++k) {
      uint4* d = PieceOf(out, dest[t * K + k], 0, 0);
#pragma unroll
      for (int m = 0; m < kWords; ++m) {
        const int i = threadIdx.x + m * kThreads;
        if (i < kRowWords) d[i] = now[m];
      }
    }
    if (kPrefetch) {
#pragma unroll
      for (int m = 0; m < kWords; ++m) now[m] = next[m];
    } else {
      load(t + gridDim.x, now);
    }
  }
}

// Writes only, each warp (kPerBlock false) or each block (true) filling one contiguous part of the rows.
template <bool kPerBlock>
__global__ void __launch_bounds__(1024) FillParts(uint4* out, size_t n) {
  const size_t parts = kPerBlock ? gridDim.x : gridDim.x * (blockDim.x / 32);
  const size_t part = kPerBlock ? blockIdx.x : blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
  const size_t lanes = kPerBlock ? blockDim.x : 32, lane = kPerBlock ? threadIdx.x : threadIdx.x % 32;
  const size_t per = (n + parts - 1) / parts, end = (part + 1) * per < n ? (part + 1) * per : n;
  for (size_t i = part * per + lane; i < end; i += lanes) out[i] = make_uint4(i, 2, 3, 4);
}

template <bool kVarying>  // the same word everywhere, or words that differ (a hash of the index)
__global__ void __launch_bounds__(1024) Fill(uint4* out, size_t n) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const unsigned h = static_cast<unsigned>(i) * 2654435761u;
    out[i] = kVarying ? make_uint4(h, h ^ 0x9e3779b9u, h * 40503u, ~h) : make_uint4(1, 2, 3, 4);
  }
}

template <typename F>
float Time(F f) {
  cudaEvent_t a, b; cudaEventCreate(&a); cudaEventCreate(&b);
  for (int i = 0; i < 3; ++i) f();
  cudaEventRecord(a);
  for (int i = 0; i < 20; ++i) f();
  cudaEventRecord(b); cudaEventSynchronize(b);
  float ms; cudaEventElapsedTime(&ms, a, b);
  return ms * 1000 / 20;
}

int main() {
  std::mt19937 rng(0);
  std::vector<int> idx(T * K);
  std::vector<int> experts(E); for (int e = 0; e < E; ++e) experts[e] = e;
  for (int t = 0; t < T; ++t) { std::shuffle(experts.begin(), experts.end(), rng); for (int k = 0; k < K; ++k) idx[t * K + k] = experts[k]; }
  std::vector<int> count(E, 0), start(E, 0);
  for (int s = 0; s < T * K; ++s) count[idx[s]]++;
  for (int e = 1; e < E; ++e) start[e] = start[e - 1] + count[e - 1];
  std::vector<int> dest(T * K), token_of_row(N), seen(E, 0);
  for (int t = 0; t < T; ++t) for (int k = 0; k < K; ++k) { int e = idx[t * K + k]; int r = start[e] + seen[e]++; dest[t * K + k] = r; token_of_row[r] = t; }
  char *x, *out; int *d_dest, *d_tok;
  CK(cudaMalloc(&x, (size_t)T * ROW)); CK(cudaMalloc(&out, (size_t)N * ROW));
  CK(cudaMalloc(&d_dest, T * K * 4)); CK(cudaMalloc(&d_tok, N * 4));
  std::vector<unsigned char> hx((size_t)T * ROW);
  for (size_t i = 0; i < hx.size(); ++i) hx[i] = static_cast<unsigned char>(rng() >> 7);
  CK(cudaMemcpy(x, hx.data(), hx.size(), cudaMemcpyHostToDevice));
  std::vector<unsigned char> hout((size_t)N * ROW);
  CK(cudaMemcpy(d_dest, dest.data(), T * K * 4, cudaMemcpyHostToDevice));
  CK(cudaMemcpy(d_tok, token_of_row.data(), N * 4, cudaMemcpyHostToDevice));
  const size_t bytes = (size_t)N * ROW;
  const double floor_bytes = bytes + (double)T * ROW;
  int wrong_variants = 0;
  const std::vector<int>* token_of = &token_of_row;
  // After a timing: poison the rows, run once more, and check every row against its token (writes-only: skipped).
  auto verify = [&](auto launch) {
    if (cudaMemset(out, 0xff, bytes) != cudaSuccess) return false;
    launch();
    if (cudaMemcpy(hout.data(), out, bytes, cudaMemcpyDeviceToHost) != cudaSuccess) return false;
    for (int r = 0; r < N; ++r) {
      if (memcmp(hout.data() + (size_t)r * ROW, hx.data() + (size_t)(*token_of)[r] * ROW, ROW) != 0) return false;
    }
    return true;
  };
  auto report = [&](const char* name, float us) { printf("%-48s %8.1f us  writes %6.0f GB/s\n", name, us, bytes / us / 1e3); };
  auto timed = [&](const char* name, auto launch) {
    const float us = Time(launch);
    const bool ok = verify(launch);
    wrong_variants += !ok;
    printf("%-48s %8.1f us  writes %6.0f GB/s  %s\n", name, us, bytes / us / 1e3, ok ? "rows checked" : "WRONG ROWS");
  };
  report("cudaMemsetAsync (writes only)", Time([&] { cudaMemsetAsync(out, 7, bytes); }));
  report("fill kernel 132x1024 (writes only)", Time([&] { Fill<false><<<132, 1024>>>((uint4*)out, bytes / 16); }));
  report("fill kernel 1056x1024 (writes only)", Time([&] { Fill<false><<<1056, 1024>>>((uint4*)out, bytes / 16); }));
  report("fill kernel 1056x1024, varying words", Time([&] { Fill<true><<<1056, 1024>>>((uint4*)out, bytes / 16); }));
  report("fill, a contiguous part per warp (4224 parts)", Time([&] { FillParts<false><<<132, 1024>>>((uint4*)out, bytes / 16); }));
  report("fill, a contiguous part per block (132 parts)", Time([&] { FillParts<true><<<132, 1024>>>((uint4*)out, bytes / 16); }));
  {  // does the data's content change what a copy costs? (the floors divide by a copy's bandwidth)
    char* from;
    CK(cudaMalloc(&from, bytes));
    CK(cudaMemset(from, 0x5a, bytes));
    const float constant_us = Time([&] { cudaMemcpyAsync(out, from, bytes, cudaMemcpyDeviceToDevice); });
    for (size_t at = 0; at < bytes; at += hx.size()) {
      CK(cudaMemcpy(from + at, hx.data(), std::min(hx.size(), bytes - at), cudaMemcpyHostToDevice));
    }
    const float random_us = Time([&] { cudaMemcpyAsync(out, from, bytes, cudaMemcpyDeviceToDevice); });
    printf("%-48s %8.1f us  read+write %6.0f GB/s\n", "cudaMemcpyAsync D2D, constant bytes", constant_us,
           2 * bytes / constant_us / 1e3);
    printf("%-48s %8.1f us  read+write %6.0f GB/s\n", "cudaMemcpyAsync D2D, random bytes", random_us,
           2 * bytes / random_us / 1e3);
    CK(cudaFree(from));
  }
  for (int pieces : {1, 2, 4}) {
    char name[64];
    snprintf(name, 64, "scatter plain, %d pieces", pieces); timed(name, [&] { Scatter<0><<<132, 1024>>>(x, d_dest, out, pieces); });
    snprintf(name, 64, "scatter __stcs, %d pieces", pieces); timed(name, [&] { Scatter<1><<<132, 1024>>>(x, d_dest, out, pieces); });
    snprintf(name, 64, "scatter row by row, %d pieces", pieces); timed(name, [&] { Scatter<2><<<132, 1024>>>(x, d_dest, out, pieces); });
    snprintf(name, 64, "gather plain, %d pieces", pieces); timed(name, [&] { Gather<0><<<132, 1024>>>(x, d_tok, out, pieces); });
    snprintf(name, 64, "gather __stcs, %d pieces", pieces); timed(name, [&] { Gather<1><<<132, 1024>>>(x, d_tok, out, pieces); });
  }
  {
    std::vector<int> seq(T * K), seq_token(N);
    for (int i = 0; i < T * K; ++i) seq[i] = i, seq_token[i] = i / K;
    CK(cudaMemcpy(d_dest, seq.data(), T * K * 4, cudaMemcpyHostToDevice));
    token_of = &seq_token;
    timed("broadcast to consecutive rows, 2 pieces", [&] { Scatter<0><<<132, 1024>>>(x, d_dest, out, 2); });
    timed("broadcast to consecutive rows __stcs", [&] { Scatter<1><<<132, 1024>>>(x, d_dest, out, 2); });
    token_of = &token_of_row;
    CK(cudaMemcpy(d_dest, dest.data(), T * K * 4, cudaMemcpyHostToDevice));
  }
  timed("scatter pipelined, 4 words a lane, 2 pieces", [&] { ScatterPipelined<4><<<132, 1024>>>(x, d_dest, out, 2); });
  timed("scatter pipelined, 2 words a lane, 2 pieces", [&] { ScatterPipelined<2><<<132, 1024>>>(x, d_dest, out, 2); });
  timed("scatter pipelined, 4 words a lane, 1 piece", [&] { ScatterPipelined<4><<<132, 1024>>>(x, d_dest, out, 1); });
  timed("scatter pipelined, 4 words, 2 pieces, 264 blocks", [&] { ScatterPipelined<4><<<264, 1024>>>(x, d_dest, out, 2); });
  timed("scatter plain 2 pieces, 264 blocks", [&] { Scatter<0><<<264, 1024>>>(x, d_dest, out, 2); });
  timed("gather plain 1 piece, 264 blocks", [&] { Gather<0><<<264, 1024>>>(x, d_tok, out, 1); });
  auto tma = [&](const char* name, auto kernel, int issuers, int stages, int pieces) {
    const int shared = issuers * stages * (ROW / pieces);
    if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared) != cudaSuccess) {
      printf("%-48s cannot get %d bytes of shared memory\n", name, shared);
      ++wrong_variants;
      return;
    }
    timed(name, [&] { kernel<<<132, issuers * 32, shared>>>(x, d_dest, out, pieces); });
  };
  tma("TMA scatter, 8 issuers, 3 stages, 2 pieces", ScatterTma<8, 3>, 8, 3, 2);
  tma("TMA scatter, 16 issuers, 3 stages, 4 pieces", ScatterTma<16, 3>, 16, 3, 4);
  tma("TMA scatter, 4 issuers, 3 stages, 1 piece", ScatterTma<4, 3>, 4, 3, 1);
  tma("TMA scatter, 8 issuers, 4 stages, 4 pieces", ScatterTma<8, 4>, 8, 4, 4);
  tma("TMA scatter, 32 issuers, 2 stages, 8 pieces", ScatterTma<32, 2>, 32, 2, 8);
  timed("scatter, a block per token, 1024 threads", [&] { ScatterByBlock<1024, 1, false><<<132, 1024>>>(x, d_dest, out); });
  timed("same, next token prefetched", [&] { ScatterByBlock<1024, 1, true><<<132, 1024>>>(x, d_dest, out); });
  timed("same, prefetched, 264 blocks", [&] { ScatterByBlock<1024, 1, true><<<264, 1024>>>(x, d_dest, out); });
  timed("same, 512 threads of 2 words, 264 blocks", [&] { ScatterByBlock<512, 2, true><<<264, 512>>>(x, d_dest, out); });
  timed("same, 256 threads of 4 words, 528 blocks", [&] { ScatterByBlock<256, 4, true><<<528, 256>>>(x, d_dest, out); });
  timed("scatter plain, 28 pieces (a step a warp)", [&] { Scatter<0><<<132, 1024>>>(x, d_dest, out, 28); });
  timed("scatter plain, 7 pieces", [&] { Scatter<0><<<132, 1024>>>(x, d_dest, out, 7); });
  {  // gathers that walk the tokens in chunks (x of a chunk stays in L2), each chunk's rows in layout order
    int* d_order;
    CK(cudaMalloc(&d_order, N * 4));
    for (int chunk : {128, 512, 2048}) {
      std::vector<int> order(N);
      for (int r = 0; r < N; ++r) order[r] = r;
      std::stable_sort(order.begin(), order.end(),
                       [&](int a, int b) { return token_of_row[a] / chunk < token_of_row[b] / chunk; });
      CK(cudaMemcpy(d_order, order.data(), N * 4, cudaMemcpyHostToDevice));
      char name[64];
      for (int pieces : {1, 2}) {
        snprintf(name, 64, "gather by chunks of %d tokens, %d pieces", chunk, pieces);
        timed(name, [&] { Gather<0><<<132, 1024>>>(x, d_tok, out, pieces, d_order); });
      }
    }
    CK(cudaFree(d_order));
  }
  CK(cudaGetLastError());
  printf("floor bytes %.1f MB; variants with wrong rows: %d\n", floor_bytes / 1e6, wrong_variants);
  return wrong_variants ? 1 : 0;
}
