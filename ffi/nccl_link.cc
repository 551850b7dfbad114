// NCCL communicators, outboxes and the swap watchdog of the ranks that reach each other through NCCL.
#include "nccl_link.h"

#include <cstdlib>
#include <cstring>

namespace jax_ep {
namespace {

std::string Str(int64_t value) { return std::to_string(value); }

std::string NcclError(const std::string& what, ncclResult_t result, ncclComm_t comm) {
  std::string text = what + " failed: " + ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return text;
}

std::string CudaError(const std::string& what, cudaError_t status) {
  return what + " failed: " + cudaGetErrorString(status);
}

}  // namespace

std::string NcclLink::Create(const std::vector<Spec>& specs, std::chrono::milliseconds timeout,
                             std::vector<std::unique_ptr<NcclLink>>* links) {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // NVLink multicast stays off unless the user chose
  int saved = 0;
  cudaGetDevice(&saved);
  std::string error;
  for (const Spec& spec : specs) {
    auto link = std::make_unique<NcclLink>();
    link->ordinal_ = spec.ordinal;
    link->missing_peer_ = spec.missing_peer;
    link->timeout_ = timeout;
    cudaError_t status = cudaSetDevice(spec.ordinal);
    if (status == cudaSuccess && spec.nccl_ranks != 0) status = cudaMalloc(&link->outbox_, spec.capacity_bytes);
    for (Watched& watched : link->watched_) {
      if (status == cudaSuccess) status = cudaEventCreateWithFlags(&watched.event, cudaEventDisableTiming);
    }
    links->push_back(std::move(link));
    if (status != cudaSuccess) {
      cudaSetDevice(saved);
      return CudaError("jax_ep.initialize: the NCCL outbox of GPU " + Str(spec.ordinal), status);
    }
  }
  ncclGroupStart();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& spec = specs[i];
    ncclUniqueId id;
    if (spec.unique_id.size() != sizeof(id)) {
      ncclGroupEnd();
      cudaSetDevice(saved);
      return "jax_ep.initialize: an NCCL unique id must have " + Str(sizeof(id)) + " bytes, got " +
             Str(spec.unique_id.size());
    }
    std::memcpy(&id, spec.unique_id.data(), sizeof(id));
    cudaSetDevice(spec.ordinal);
    ncclCommInitRank(&(*links)[i]->comm_, spec.num_ranks, id, spec.rank);
  }
  ncclResult_t result = ncclGroupEnd();
  if (result != ncclSuccess) {
    cudaSetDevice(saved);
    return NcclError("jax_ep.initialize: ncclCommInitRank", result, nullptr);
  }
  // Warm-up: NCCL connects peers on their first transfer, which must not happen during execution.
  std::vector<cudaStream_t> streams(specs.size(), nullptr);
  ncclGroupStart();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& spec = specs[i];
    cudaSetDevice(spec.ordinal);
    cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking);
    const size_t region = spec.capacity_bytes / spec.num_ranks;
    for (int peer = 0; peer < spec.num_ranks; ++peer) {
      if (!((spec.nccl_ranks >> peer) & 1)) continue;
      ncclSend((*links)[i]->outbox_ + peer * region, region, ncclUint8, peer, (*links)[i]->comm_, streams[i]);
      ncclRecv(spec.recv_buffer + peer * region, region, ncclUint8, peer, (*links)[i]->comm_, streams[i]);
    }
  }
  result = ncclGroupEnd();
  if (result != ncclSuccess) error = NcclError("jax_ep.initialize: the NCCL warm-up swap", result, nullptr);
  for (size_t i = 0; i < specs.size(); ++i) {
    cudaSetDevice(specs[i].ordinal);
    const cudaError_t status = cudaStreamSynchronize(streams[i]);
    if (error.empty() && status != cudaSuccess) error = CudaError("jax_ep.initialize: the NCCL warm-up swap", status);
    cudaStreamDestroy(streams[i]);
    (*links)[i]->last_done_ = Clock::now();
  }
  cudaSetDevice(saved);
  return error;
}

NcclLink::~NcclLink() {
  int saved = 0;
  cudaGetDevice(&saved);
  cudaSetDevice(ordinal_);
  cudaDeviceSynchronize();
  // Abort frees this process's side without waiting for the other ranks; nothing is in flight by now
  // (jax_ep.finalize puts a barrier between the processes first), or a rank is gone for good.
  if (comm_ != nullptr && !aborted_) ncclCommAbort(comm_);
  for (Watched& watched : watched_) {
    if (watched.event != nullptr) cudaEventDestroy(watched.event);
  }
  cudaFree(outbox_);
  cudaSetDevice(saved);
}

std::string NcclLink::Swap(const GroupView& group, const char* send, int64_t region_bytes,
                           const int32_t* send_counts, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) return "an earlier NCCL swap on this GPU timed out and its communicator was aborted";
  ncclGroupStart();
  for (int peer = 0; peer < group.num_ranks; ++peer) {
    if (!ByNccl(group, peer)) continue;
    ncclSend(send + peer * region_bytes, region_bytes, ncclUint8, peer, comm_, stream);
    ncclRecv(group.own_buffer + peer * region_bytes, region_bytes, ncclUint8, peer, comm_, stream);
    if (send_counts != nullptr) {
      ncclSend(send_counts + peer, 1, ncclInt32, peer, comm_, stream);
      ncclRecv(group.signals->counts_by_nccl + peer, 1, ncclInt32, peer, comm_, stream);
    }
  }
  const ncclResult_t result = ncclGroupEnd();
  if (result != ncclSuccess) return NcclError("the NCCL swap (ncclSend/ncclRecv)", result, comm_);
  if (pending_ < kWatched) {
    Watched& watched = watched_[(first_ + pending_) % kWatched];
    const cudaError_t status = cudaEventRecord(watched.event, stream);
    if (status != cudaSuccess) return CudaError("cudaEventRecord after the NCCL swap", status);
    watched.enqueued = Clock::now();
    ++pending_;
  }
  return "";
}

void NcclLink::Check() {
  std::lock_guard<std::mutex> lock(mutex_);
  cudaSetDevice(ordinal_);
  const Clock::time_point now = Clock::now();
  while (!aborted_ && pending_ > 0) {
    Watched& oldest = watched_[first_];
    if (cudaEventQuery(oldest.event) == cudaErrorNotReady) {
      // Queued work delays a swap's start: count from when the swap before it finished.
      const Clock::time_point started = oldest.enqueued > last_done_ ? oldest.enqueued : last_done_;
      if (now - started > timeout_) {
        *reinterpret_cast<volatile int32_t*>(missing_peer_) = -1;
        ncclCommAbort(comm_);  // its kernels return, so the stream moves on
        aborted_ = true;
      }
      return;
    }
    cudaGetLastError();
    last_done_ = now;
    first_ = (first_ + 1) % kWatched;
    --pending_;
  }
}

}  // namespace jax_ep
