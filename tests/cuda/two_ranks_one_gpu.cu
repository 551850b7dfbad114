// Two ranks of one EP group on one GPU in one process, their kernels running at the same time on their own streams,
// next to a stand-in for an XLA collective: what a GPU of a real group goes through when XLA's NCCL kernels run
// beside jax_ep's. Built and run by tests/test_cuda_coresidency.py.
//
// Rank 0's dispatch is launched first and spins, waiting for rank 1. Rank 1 is launched only once a one-block
// "collective" kernel on a third stream has run, as a peer GPU's jax_ep call may wait behind an NCCL kernel that
// needs this GPU's SMs. Both ranks take the SM budget of a group of several GPUs (DefaultNumSms). The call finishes
// only if (1) rank 0 leaves SMs free, so that the collective gets one while rank 0 spins, and (2) rank 1 progresses
// with fewer SMs than its grid has blocks (its resident blocks claim every share of the send work: SendShares).
// Either protection reverted, rank 0 gives up after the timeout and the check fails. Then a combine goes back the
// same way. Every received row and every combined row is checked against the inputs.
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <vector>

#include "kernels/launch.h"

using namespace jax_ep;

namespace {

constexpr int R = 2, T = 256, H = 7168, K = 8, E = 16, L = E / R;
constexpr int64_t kRowBytes = H * 2;  // bf16
constexpr int64_t kRows = R * T * (K < L ? K : L);  // the default ragged capacity

int failures = 0;

void Check(bool ok, const char* what) {
  std::printf("%s: %s\n", ok ? "ok" : "FAILED", what);
  failures += !ok;
}

template <typename T>
T* Device(const std::vector<T>& host) {
  T* p = nullptr;
  cudaMalloc(&p, host.size() * sizeof(T));
  cudaMemcpy(p, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice);
  return p;
}

// Zeroed before it returns: the ranks' streams do not wait for the legacy stream that cudaMemset runs on.
template <typename T>
T* Zeros(size_t count) {
  T* p = nullptr;
  cudaMalloc(&p, count * sizeof(T));
  cudaMemset(p, 0, count * sizeof(T));
  cudaDeviceSynchronize();
  return p;
}

template <typename T>
std::vector<T> Host(const T* p, size_t count) {
  std::vector<T> host(count);
  cudaMemcpy(host.data(), p, count * sizeof(T), cudaMemcpyDeviceToHost);
  return host;
}

// The stand-in collective: one block that finishes at once, once it gets an SM.
__global__ void Collective(int* ran) { *ran = 1; }

struct Rank {
  GroupView view{};
  HostStatus* status = nullptr;
  std::vector<__nv_bfloat16> x;
  std::vector<int32_t> ids;
  std::vector<float> weights;
  DispatchCall dispatch{};
  cudaStream_t stream = nullptr;
};

}  // namespace

int main() {
  cudaSetDevice(0);
  const Status prepared = PrepareKernels();
  if (!prepared.ok()) {
    std::printf("FAILED: PrepareKernels: %s\n", prepared.message.c_str());
    return 1;
  }
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0);
  const int budget = DefaultNumSms(sms, R);
  std::printf("GPU of %d SMs; each rank's kernels take up to %d\n", sms, budget);

  const DispatchRegion region(T, K, L, kRowBytes);
  Rank ranks[R];
  PeerTable table{};
  for (int r = 0; r < R; ++r) {
    GroupView& g = ranks[r].view;
    g.rank = r;
    g.num_ranks = R;
    g.max_blocks = budget;
    g.half_bytes = R * region.bytes;
    g.timeout_ns = g.first_timeout_ns = 5'000'000'000ull;
    g.scratch_ints = RoutingScratch(T, K, E, R).ints;
    cudaMalloc(&g.staging, 2 * g.half_bytes);
    g.signals = Zeros<Signals>(1);
    g.scratch = Zeros<int32_t>(g.scratch_ints);
    cudaHostAlloc(&ranks[r].status, sizeof(HostStatus), cudaHostAllocMapped);
    std::memset(ranks[r].status, 0, sizeof(HostStatus));
    cudaHostGetDevicePointer(&g.status, ranks[r].status, 0);
    table.staging[r] = g.staging;
    table.signals[r] = g.signals;
    cudaStreamCreateWithFlags(&ranks[r].stream, cudaStreamNonBlocking);
  }
  PeerTable* peers = Device(std::vector<PeerTable>{table});
  for (Rank& rank : ranks) rank.view.peers = peers;

  // Every token to 8 distinct experts of 16 (so to both ranks), rows distinct per rank and token.
  for (int r = 0; r < R; ++r) {
    Rank& rank = ranks[r];
    rank.x.resize(T * H);
    rank.ids.resize(T * K);
    rank.weights.resize(T * K);
    for (int t = 0; t < T; ++t) {
      for (int e = 0; e < H; ++e) rank.x[t * H + e] = __float2bfloat16(0.25f * r + 0.01f * (t % 97) + 0.001f * (e % 13));
      for (int k = 0; k < K; ++k) {
        rank.ids[t * K + k] = (t * 3 + k * 2 + r) % E;
        rank.weights[t * K + k] = 0.125f * (1 + (t + k) % 4);
      }
    }
    DispatchCall& c = rank.dispatch;
    c.origin = CallOrigin{7, 0};
    c.x = reinterpret_cast<const char*>(Device(rank.x));
    c.topk_idx = Device(rank.ids);
    c.topk_weights = Device(rank.weights);
    c.axis_index = Device(std::vector<int32_t>{r});
    c.num_tokens = T;
    c.row_bytes = kRowBytes;
    c.topk = K;
    c.num_experts = E;
    c.capacity = kRows;
    c.alignment = 1;
    c.num_rows = kRows;
    c.expert_layout = false;
    c.received = DispatchReceived{Zeros<char>(kRows * kRowBytes), Zeros<float>(kRows), Zeros<int32_t>(L),
                                  Zeros<int32_t>(1), Zeros<int32_t>(1), Zeros<int32_t>(L), Zeros<int32_t>(R),
                                  Zeros<int32_t>(R * T * K), Zeros<int32_t>(R), Zeros<int32_t>(kRows)};
    c.routed = DispatchRouted{Zeros<int32_t>(T * R), Zeros<int32_t>(T * K)};
  }
  int* ran = Zeros<int>(1);
  cudaStream_t collective_stream = nullptr;
  cudaStreamCreateWithFlags(&collective_stream, cudaStreamNonBlocking);
  cudaEvent_t collective_done = nullptr;
  cudaEventCreateWithFlags(&collective_done, cudaEventDisableTiming);
  const NcclSwap no_swap = [](int64_t) { return Status::Internal("no rank goes through NCCL here"); };
  // Loaded now: a kernel's first launch loads its module (lazy loading), which waits for the kernels running.
  Collective<<<1, 32, 0, collective_stream>>>(ran);
  cudaDeviceSynchronize();

  // Rank 0, the collective, and rank 1 behind the collective, each on its own stream.
  const auto run = [&](auto launch, const char* what) {
    Status launched = launch(ranks[0]);
    Collective<<<1, 32, 0, collective_stream>>>(ran);
    cudaEventRecord(collective_done, collective_stream);
    cudaStreamWaitEvent(ranks[1].stream, collective_done);
    if (launched.ok()) launched = launch(ranks[1]);
    const cudaError_t synced = cudaDeviceSynchronize();
    std::printf("%s: rank 0 status %d (peer %d), rank 1 status %d (peer %d)\n", what, ranks[0].status->code,
                ranks[0].status->peer, ranks[1].status->code, ranks[1].status->peer);
    return launched.ok() && synced == cudaSuccess && ranks[0].status->code == kOk && ranks[1].status->code == kOk;
  };

  Check(run([&](Rank& rank) { return LaunchDispatch(rank.dispatch, rank.view, no_swap, rank.stream, Phase::kWhole); },
            "dispatch"),
        "dispatch: both ranks finish, the collective ran between them");
  // Each received slot's row holds its source token's row. The i-th token from rank s is its i-th token with an
  // expert on this rank, in token order.
  bool rows_right = true;
  for (int me = 0; me < R; ++me) {
    const DispatchCall& c = ranks[me].dispatch;
    const auto out = Host(reinterpret_cast<const __nv_bfloat16*>(c.received.x), kRows * H);
    const auto recv_rows = Host(c.received.recv_rows, R * T * K);
    for (int s = 0; s < R; ++s) {
      int i = 0;
      for (int t = 0; t < T; ++t) {
        bool here = false;
        for (int k = 0; k < K; ++k) here = here || ranks[s].ids[t * K + k] / L == me;
        if (!here) continue;
        for (int k = 0; k < K; ++k) {
          const int32_t row = recv_rows[(s * T + i) * K + k];
          const bool mine = ranks[s].ids[t * K + k] / L == me;
          rows_right = rows_right && (row >= 0) == mine;
          if (row < 0) continue;
          rows_right = rows_right && std::memcmp(&out[row * H], &ranks[s].x[t * H], kRowBytes) == 0;
        }
        ++i;
      }
    }
  }
  Check(rows_right, "dispatch: every delivered slot's row is its token's row, from either rank");

  // Combine the rows back with their weights (partial sums in bf16): out[t] = sum over k of w[t, k] * x[t].
  std::vector<CombineCall> combines(R);
  for (int r = 0; r < R; ++r) {
    const DispatchCall& d = ranks[r].dispatch;
    CombineCall& c = combines[r];
    c.origin = CallOrigin{8, 1};
    c.y = d.received.x;
    c.weights = d.received.weights;
    c.axis_index = d.axis_index;
    c.recv_rows = d.received.recv_rows;
    c.recv_counts = d.received.recv_counts;
    c.token_dest_pos = d.routed.token_dest_pos;
    c.slot_dest = d.routed.slot_dest;
    c.num_tokens = T;
    c.hidden = H;
    c.topk = K;
    c.type = FloatType::kBF16;
    c.outputs.out = Zeros<__nv_bfloat16>(T * H);
  }
  Check(run([&](Rank& rank) {
              return LaunchCombine(combines[rank.view.rank], rank.view, no_swap, rank.stream, Phase::kWhole);
            },
            "combine"),
        "combine: both ranks finish, the collective ran between them");
  bool sums_right = true;
  for (int r = 0; r < R; ++r) {
    const auto out = Host(static_cast<const __nv_bfloat16*>(combines[r].outputs.out), T * H);
    for (int t = 0; t < T; ++t) {
      float weight = 0.0f;
      for (int k = 0; k < K; ++k) weight += ranks[r].weights[t * K + k];
      for (int e = 0; e < H; e += 61) {
        const float want = weight * __bfloat162float(ranks[r].x[t * H + e]);
        sums_right = sums_right && std::fabs(__bfloat162float(out[t * H + e]) - want) <= 0.02f * std::fabs(want) + 1e-3f;
      }
    }
  }
  Check(sums_right, "combine: every token's row is its weighted sum");
  std::printf(failures == 0 ? "OK\n" : "%d FAILED\n", failures);
  return failures == 0 ? 0 : 1;
}
