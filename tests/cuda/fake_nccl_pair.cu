// The combine kernels of rank 0 of a two-rank group whose rank 1 is reached through NCCL, with the swap faked on
// one GPU (NCCL puts no two ranks on one GPU): it delivers rank 0's own outbox region for rank 1 (a rank that
// mirrors rank 0), or, as a rank that gave up on the call would, the region of the call before. Built and run by
// tests/test_cuda_fake_nccl_pair.py:
//   fake_nccl_pair          a region of another call must fail the call (kStaleRegion) and poison its outputs;
//                           prints one line per check, exits 0 when all pass;
//   fake_nccl_pair stores   one combine of bf16 rows with float32 partial sums at T=1024, H=7168, for ncu to count
//                           the sectors of the send launch's stores.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include <cuda_bf16.h>

#include "kernels/launch.h"

using namespace jax_ep;

namespace {

int failures = 0;

void Check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  failures += !ok;
}

#define CUDA(call)                                                                                 \
  do {                                                                                             \
    const cudaError_t e = (call);                                                                  \
    if (e != cudaSuccess) {                                                                        \
      std::printf("FAILED: %s: %s\n", #call, cudaGetErrorString(e));                               \
      return 1;                                                                                    \
    }                                                                                              \
  } while (0)

template <typename T>
T* Device(const std::vector<T>& host) {
  T* p = nullptr;
  cudaMalloc(&p, host.size() * sizeof(T));
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  const bool stores = argc > 1 && std::strcmp(argv[1], "stores") == 0;
  constexpr int R = 2, K = 1;
  const int T = stores ? 1024 : 4, H = stores ? 7168 : 8, N = R * T;
  CUDA(cudaSetDevice(0));
  const Status prepared = PrepareKernels();
  if (!prepared.ok()) {
    std::printf("FAILED: PrepareKernels: %s\n", prepared.message.c_str());
    return 1;
  }
  const CombineRegion region(T, K, H * 4);  // float32 partials (of float32, or in `stores` bf16, rows)
  GroupView g{};
  g.rank = 0;
  g.num_ranks = R;
  g.max_blocks = 2;
  g.half_bytes = R * region.bytes;
  g.timeout_ns = 10'000'000'000ull;
  g.first_timeout_ns = g.timeout_ns;
  g.nccl_ranks = 1ull << 1;
  CUDA(cudaMalloc(&g.staging, 2 * g.half_bytes));
  CUDA(cudaMalloc(&g.signals, sizeof(Signals)));
  CUDA(cudaMemset(g.signals, 0, sizeof(Signals)));
  CUDA(cudaMalloc(&g.outbox, R * region.bytes));
  CUDA(cudaMalloc(&g.inbox, R * region.bytes));
  CUDA(cudaMemset(g.inbox, 0, R * region.bytes));
  char* previous = nullptr;  // rank 1's region of the call before
  CUDA(cudaMalloc(&previous, region.bytes));
  PeerTable table{};
  table.staging[0] = g.staging;
  table.signals[0] = g.signals;
  PeerTable* peers = nullptr;
  CUDA(cudaMalloc(&peers, sizeof(PeerTable)));
  CUDA(cudaMemcpy(peers, &table, sizeof(table), cudaMemcpyHostToDevice));
  g.peers = peers;
  HostStatus* status = nullptr;
  CUDA(cudaHostAlloc(&status, sizeof(HostStatus), cudaHostAllocMapped));
  std::memset(status, 0, sizeof(HostStatus));
  CUDA(cudaHostGetDevicePointer(&g.status, status, 0));

  // Row s * T + i is token i of source s; every token goes to both ranks, at its own position.
  std::vector<float> y(N * H), weights(N);
  for (int n = 0; n < N; ++n) {
    weights[n] = 0.5f + 0.25f * n;
    for (int e = 0; e < H; ++e) y[n * H + e] = 1.0f + n + 0.125f * e;
  }
  std::vector<int32_t> recv_rows(N), recv_counts{T, T}, token_dest_pos(T * R), slot_dest(T * K, 1), axis{0};
  for (int n = 0; n < N; ++n) recv_rows[n] = n;
  for (int t = 0; t < T; ++t) token_dest_pos[t * R] = token_dest_pos[t * R + 1] = t;
  CombineCall c{};
  std::vector<__nv_bfloat16> y16(y.begin(), y.end());
  c.y = stores ? static_cast<const void*>(Device(y16)) : static_cast<const void*>(Device(y));
  c.weights = Device(weights);
  c.axis_index = Device(axis);
  c.recv_rows = Device(recv_rows);
  c.recv_counts = Device(recv_counts);
  c.token_dest_pos = Device(token_dest_pos);
  c.slot_dest = Device(slot_dest);
  c.num_tokens = T;
  c.hidden = H;
  c.topk = K;
  c.type = stores ? FloatType::kBF16 : FloatType::kF32;
  c.partial_f32 = true;
  float* out = nullptr;
  CUDA(cudaMalloc(&out, T * H * sizeof(float)));
  c.outputs.out = out;

  bool stale = false;
  const NcclSwap swap = [&](int64_t bytes) {
    char* from = stale ? previous : g.outbox + 1 * bytes;  // rank 1 mirrors rank 0, or sends the call before's
    cudaMemcpyAsync(g.inbox + 1 * bytes, from, bytes, cudaMemcpyDeviceToDevice, nullptr);
    if (!stale) cudaMemcpyAsync(previous, from, bytes, cudaMemcpyDeviceToDevice, nullptr);
    return Status::Ok();
  };
  std::vector<float> got(T * H);
  if (stores) {
    const Status launched = LaunchCombine(c, g, swap, nullptr, Phase::kWhole);
    const bool ok = launched.ok() && cudaDeviceSynchronize() == cudaSuccess && status->code == kOk;
    std::printf(ok ? "OK\n" : "FAILED: the combine (%s)\n", launched.message.c_str());
    return ok ? 0 : 1;
  }
  const auto run = [&]() {
    cudaMemset(out, 0, T * H * sizeof(float));
    const Status launched = LaunchCombine(c, g, swap, nullptr, Phase::kWhole);
    cudaMemcpy(got.data(), out, got.size() * sizeof(float), cudaMemcpyDeviceToHost);
    return launched.ok() && cudaDeviceSynchronize() == cudaSuccess;
  };

  // Call 1: the region carries the call's tag; each token sums its row on both ranks (rank 1's partial is rank
  // 0's partial for rank 1: the rows of source 1).
  Check(run(), "call 1 launched");
  bool right = status->code == kOk;
  for (int t = 0; t < T; ++t) {
    for (int e = 0; e < H; ++e) {
      const float want = weights[t] * y[t * H + e] + weights[T + t] * y[(T + t) * H + e];
      right = right && std::fabs(got[t * H + e] - want) <= 1e-5f * std::fabs(want);
    }
  }
  Check(right, "call 1: a region with the call's tag is accepted, and out is the sum of both ranks' partials");

  // Call 2: rank 1 delivers call 1's region.
  stale = true;
  Check(run(), "call 2 launched");
  bool poisoned = true;
  for (const float v : got) poisoned = poisoned && std::isnan(v);
  Check(status->code == kStaleRegion && status->peer == 1 && status->call == 2,
        "call 2: a region of the call before fails the call with kStaleRegion about rank 1");
  Check(status->seen == TagOf(1, 0, kOpCombine), "call 2: the failure records the tag it found (call 1's)");
  Check(poisoned, "call 2: every output is NaN");

  // Call 3: the group is out of step; a region with the right tag does not bring it back.
  stale = false;
  Check(run(), "call 3 launched");
  poisoned = true;
  for (const float v : got) poisoned = poisoned && std::isnan(v);
  Check(poisoned && status->code == kStaleRegion, "call 3: the group stays failed, outputs NaN");
  std::printf(failures == 0 ? "OK\n" : "%d FAILED\n", failures);
  return failures == 0 ? 0 : 1;
}
