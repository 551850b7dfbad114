// Arrive (the barrier every transfer starts with) and the plain all-to-all of rows.
#include "kernels.h"
#include "sync.cuh"

namespace jax_ep {
namespace {

__global__ void ArriveKernel(const int32_t* __restrict__ send_counts, GroupView group) {
  const uint64_t epoch = CurrentEpoch(group.signals);
  const int peer = threadIdx.x;
  if (peer >= group.num_ranks || ByNccl(group, peer)) return;  // NCCL ranks get the counts from the swap
  Signals* remote = group.peers->signals[peer];
  if (send_counts != nullptr) remote->counts_in[epoch & 1][group.rank] = send_counts[peer];
  __threadfence_system();
  StoreRelease(&remote->arrive[group.rank], epoch);
  WaitFor(&group.signals->arrive[peer], epoch, peer, group);
}

__global__ void __launch_bounds__(kThreads)
    ExchangeSendKernel(const char* __restrict__ send, const int32_t* __restrict__ send_counts, int64_t rows,
                       int64_t row_bytes, GroupView group) {
  const uint64_t epoch = CurrentEpoch(group.signals);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = blockIdx.x * kWarps + threadIdx.x / 32; w < group.num_ranks * rows; w += warps) {
    const int dest = static_cast<int>(w / rows);
    const int64_t row = w % rows;
    if (dest == group.rank || ByNccl(group, dest) || row >= send_counts[dest]) continue;  // NCCL sends from send
    const int64_t offset = (static_cast<int64_t>(group.rank) * rows + row) * row_bytes;
    CopyRow(send + w * row_bytes, group.peers->recv_buffer[dest] + offset, row_bytes, lane);
  }
  SignalDataSent(group, epoch);
}

__global__ void __launch_bounds__(kThreads)
    ExchangeReceiveKernel(const char* __restrict__ send, char* __restrict__ recv, int32_t* __restrict__ recv_counts,
                          int64_t rows, int64_t row_bytes, GroupView group) {
  const uint64_t epoch = CurrentEpoch(group.signals);
  WaitDataReceived(group, epoch);
  if (blockIdx.x == 0 && threadIdx.x < group.num_ranks) recv_counts[threadIdx.x] = CountFrom(group, epoch, threadIdx.x);
  const int lane = threadIdx.x % 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = blockIdx.x * kWarps + threadIdx.x / 32; w < group.num_ranks * rows; w += warps) {
    const int source = static_cast<int>(w / rows);
    if (w % rows >= CountFrom(group, epoch, source)) continue;
    const int64_t offset = w * row_bytes;
    CopyRow((source == group.rank ? send : group.own_buffer) + offset, recv + offset, row_bytes, lane);
  }
  FinishTransfer(group, epoch);
}

}  // namespace

std::string LaunchStatus(const char* kernel) {
  const cudaError_t status = cudaGetLastError();
  return status == cudaSuccess ? "" : std::string("launching ") + kernel + ": " + cudaGetErrorString(status);
}

std::string LaunchArrive(const int32_t* send_counts, const GroupView& group, cudaStream_t stream) {
  ArriveKernel<<<1, kMaxRanks, 0, stream>>>(send_counts, group);
  return LaunchStatus("ArriveKernel");
}

std::string LaunchExchange(const char* send, const int32_t* send_counts, char* recv, int32_t* recv_counts,
                           int64_t rows, int64_t row_bytes, const GroupView& group, const NcclSwap& swap,
                           cudaStream_t stream) {
  std::string error = LaunchArrive(send_counts, group, stream);
  if (!error.empty()) return error;
  const unsigned blocks = BlocksFor(group.num_ranks * rows, group);
  ExchangeSendKernel<<<blocks, kThreads, 0, stream>>>(send, send_counts, rows, row_bytes, group);
  if (!(error = LaunchStatus("ExchangeSendKernel")).empty()) return error;
  if (group.nccl_ranks != 0 && !(error = swap(send, rows * row_bytes, send_counts)).empty()) return error;
  ExchangeReceiveKernel<<<blocks, kThreads, 0, stream>>>(send, recv, recv_counts, rows, row_bytes, group);
  return LaunchStatus("ExchangeReceiveKernel");
}

}  // namespace jax_ep
