// NCCL communicators, outboxes, inboxes and the swap watchdog of the ranks that reach each other through NCCL.
#include "nccl_link.h"

#include <cstdlib>
#include <cstring>

namespace jax_ep {
namespace {

std::string Str(int64_t value) { return std::to_string(value); }

Status NcclError(const std::string& what, ncclResult_t result, ncclComm_t comm) {
  std::string text = what + " failed: " + ncclGetErrorString(result);
  const char* last = ncclGetLastError(comm);
  if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
  return Status::Internal(text);
}

Status CudaError(const std::string& what, cudaError_t status) {
  return Status::Internal(what + " failed: " + cudaGetErrorString(status));
}

}  // namespace

Status NcclLink::Create(const std::vector<Spec>& specs, std::chrono::milliseconds timeout,
                        std::vector<std::unique_ptr<NcclLink>>* links) {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);  // NVLink multicast stays off unless the user chose
  int saved = 0;
  cudaGetDevice(&saved);
  for (const Spec& spec : specs) {
    auto link = std::make_unique<NcclLink>();
    link->ordinal_ = spec.ordinal;
    link->rank_ = spec.rank;
    link->num_ranks_ = spec.num_ranks;
    link->nccl_ranks_ = spec.nccl_ranks;
    link->status_ = spec.status;
    link->timeout_ = timeout;
    cudaError_t status = cudaSetDevice(spec.ordinal);
    if (status == cudaSuccess) status = cudaMalloc(&link->outbox_, spec.half_bytes);
    if (status == cudaSuccess) status = cudaMalloc(&link->inbox_, spec.half_bytes);
    links->push_back(std::move(link));
    if (status != cudaSuccess) {
      cudaSetDevice(saved);
      return CudaError("jax_ep.initialize: the NCCL outbox and inbox of GPU " + Str(spec.ordinal), status);
    }
  }
  ncclGroupStart();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& spec = specs[i];
    ncclUniqueId id;
    if (spec.unique_id.size() != sizeof(id)) {
      ncclGroupEnd();
      cudaSetDevice(saved);
      return Status::InvalidArgument("jax_ep.initialize: an NCCL unique id must have " + Str(sizeof(id)) +
                                     " bytes, got " + Str(spec.unique_id.size()));
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
  Status error;
  ncclGroupStart();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& spec = specs[i];
    cudaSetDevice(spec.ordinal);
    cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking);
    const int64_t region = spec.half_bytes / spec.num_ranks;
    NcclLink& link = *(*links)[i];
    for (int peer = 0; peer < spec.num_ranks; ++peer) {
      if (!ByNccl(spec.nccl_ranks, peer)) continue;
      ncclSend(link.outbox_ + peer * region, region, ncclUint8, peer, link.comm_, streams[i]);
      ncclRecv(link.inbox_ + peer * region, region, ncclUint8, peer, link.comm_, streams[i]);
    }
  }
  result = ncclGroupEnd();
  if (result != ncclSuccess) error = NcclError("jax_ep.initialize: the NCCL warm-up swap", result, nullptr);
  for (size_t i = 0; i < specs.size(); ++i) {
    cudaSetDevice(specs[i].ordinal);
    const cudaError_t status = cudaStreamSynchronize(streams[i]);
    if (error.ok() && status != cudaSuccess) error = CudaError("jax_ep.initialize: the NCCL warm-up swap", status);
    cudaStreamDestroy(streams[i]);
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
  cudaFree(outbox_);
  cudaFree(inbox_);
  cudaSetDevice(saved);
}

Status NcclLink::Swap(int64_t region_bytes, cudaStream_t stream) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) {
    return Status::Error(StatusCode::kDeadlineExceeded,
                         "an earlier NCCL swap on this GPU timed out and its communicator was aborted");
  }
  ncclGroupStart();
  for (int peer = 0; peer < num_ranks_; ++peer) {
    if (!ByNccl(nccl_ranks_, peer)) continue;
    ncclSend(outbox_ + peer * region_bytes, region_bytes, ncclUint8, peer, comm_, stream);
    ncclRecv(inbox_ + peer * region_bytes, region_bytes, ncclUint8, peer, comm_, stream);
  }
  const ncclResult_t result = ncclGroupEnd();
  if (result != ncclSuccess) return NcclError("the NCCL swap (ncclSend/ncclRecv)", result, comm_);
  return Status::Ok();
}

void NcclLink::Check() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_) return;
  const volatile HostStatus* status = status_;
  const uint64_t started = status->nccl_started, done = status->nccl_done;
  if (started == done) {
    pending_call_ = 0;
    return;
  }
  const Clock::time_point now = Clock::now();
  if (pending_call_ != started) {  // a swap not seen before: its time starts now
    pending_call_ = started;
    pending_since_ = now;
    return;
  }
  if (now - pending_since_ <= timeout_) return;
  volatile HostStatus* failed = status_;
  if (failed->code == kOk) {
    failed->peer = -1;
    failed->reporter = rank_;
    failed->call = started;
    failed->code = kNcclTimeout;
  }
  ncclCommAbort(comm_);  // its kernels return, so the stream moves on
  aborted_ = true;
}

}  // namespace jax_ep
