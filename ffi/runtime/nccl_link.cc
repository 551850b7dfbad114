// NCCL communicators, outboxes, inboxes and the swap watchdog of the ranks that reach each other through NCCL.
#include "nccl_link.h"

#include <atomic>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <thread>

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

Status Timeout(const std::string& what, std::chrono::milliseconds timeout) {
  return Status::Error(StatusCode::kDeadlineExceeded, what + " did not finish within the timeout (" +
                                                          Str(timeout.count()) + " ms), so its NCCL communicator "
                                                          "was aborted");
}

// A call a non-blocking communicator took: done (ncclSuccess) or going on in the background (ncclInProgress).
bool Taken(ncclResult_t result) { return result == ncclSuccess || result == ncclInProgress; }

// The state of the communicator's last operation: ncclInProgress while NCCL's background thread works on it.
ncclResult_t StateOf(ncclComm_t comm) {
  ncclResult_t state = ncclSuccess;
  const ncclResult_t result = ncclCommGetAsyncError(comm, &state);
  return result == ncclSuccess ? state : result;
}

// Between polls: spins first (an enqueue takes microseconds), then sleeps, for a wait that runs to a timeout.
void Pause(int polls) {
  if (polls < 1000) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
}

// NVLink multicast (NVLS) off in the communicator's config where this NCCL has the field: jax_ep sends with
// ncclSend/ncclRecv only, and NVLS buffers would be multicast objects. (NCCL_NVLS_ENABLE=0, which jax_ep also sets,
// takes effect only before the process's first NCCL call, which may be XLA's.)
template <typename Config>
auto NvlsOff(Config* config, int) -> decltype(config->nvlsHostMode = 0, void()) {
  config->nvlsHostMode = INT_MAX;  // ncclNvlsHostModeDisable
}
template <typename Config>
void NvlsOff(Config*, long) {}

}  // namespace

// CTAs NCCL may run for jax_ep's swaps: XLA's own NCCL collectives and compute run beside them and need SMs too.
constexpr int kNcclMaxCtas = 8;

Status NcclLink::Create(const std::vector<Spec>& specs, std::chrono::milliseconds timeout,
                        std::chrono::milliseconds setup_timeout,
                        std::vector<std::unique_ptr<NcclLink>>* links) {
  for (const Spec& spec : specs) {
    if (spec.unique_id.size() != sizeof(ncclUniqueId)) {
      return Status::InvalidArgument("jax_ep.initialize: an NCCL unique id must have " + Str(sizeof(ncclUniqueId)) +
                                     " bytes, got " + Str(spec.unique_id.size()));
    }
  }
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
    link->first_timeout_ = std::max(timeout, spec.first_timeout);
    cudaError_t status = cudaSetDevice(spec.ordinal);
    if (status == cudaSuccess) status = cudaMalloc(&link->outbox_, spec.half_bytes);
    if (status == cudaSuccess) status = cudaMalloc(&link->inbox_, spec.half_bytes);
    links->push_back(std::move(link));
    if (status != cudaSuccess) {
      cudaSetDevice(saved);
      return CudaError("jax_ep.initialize: the NCCL outbox and inbox of GPU " + Str(spec.ordinal), status);
    }
  }
  // Non-blocking: ncclGroupEnd returns while NCCL inits (and later connects, enqueues) in the background.
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  config.maxCTAs = kNcclMaxCtas;
  NvlsOff(&config, 0);
  ncclResult_t result = ncclGroupStart();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& spec = specs[i];
    ncclUniqueId id;
    std::memcpy(&id, spec.unique_id.data(), sizeof(id));
    cudaSetDevice(spec.ordinal);
    const ncclResult_t init = ncclCommInitRankConfig(&(*links)[i]->comm_, spec.num_ranks, id, spec.rank, &config);
    if (Taken(result)) result = init;
  }
  ncclResult_t end = ncclGroupEnd();
  if (Taken(result)) result = end;
  Status error = Settle(*links, result, "jax_ep.initialize: ncclCommInitRankConfig", setup_timeout,
                        Clock::now() + setup_timeout);
  if (!error.ok()) {
    cudaSetDevice(saved);
    return error;
  }
  // Warm-up: NCCL connects peers on their first transfer, which must not happen during execution.
  const std::string warm_up = "jax_ep.initialize: the NCCL warm-up swap";
  const Clock::time_point deadline = Clock::now() + setup_timeout;
  std::vector<cudaStream_t> streams(specs.size(), nullptr);
  result = ncclGroupStart();
  for (size_t i = 0; i < specs.size(); ++i) {
    const Spec& spec = specs[i];
    cudaSetDevice(spec.ordinal);
    cudaStreamCreateWithFlags(&streams[i], cudaStreamNonBlocking);
    const int64_t region = spec.half_bytes / spec.num_ranks;
    NcclLink& link = *(*links)[i];
    for (int peer = 0; peer < spec.num_ranks; ++peer) {
      if (!ByNccl(spec.nccl_ranks, peer)) continue;
      const ncclResult_t send = ncclSend(link.outbox_ + peer * region, region, ncclUint8, peer, link.comm_, streams[i]);
      const ncclResult_t recv = ncclRecv(link.inbox_ + peer * region, region, ncclUint8, peer, link.comm_, streams[i]);
      if (Taken(result)) result = Taken(send) ? recv : send;
    }
  }
  end = ncclGroupEnd();
  if (Taken(result)) result = end;
  error = Settle(*links, result, warm_up, setup_timeout, deadline);
  // Then its transfers, polled as NCCL's docs poll a stream: the stream, and the communicator's async errors.
  for (size_t i = 0, polls = 0; error.ok() && i < specs.size();) {
    const cudaError_t status = cudaStreamQuery(streams[i]);
    const ncclResult_t state = StateOf((*links)[i]->comm_);
    if (status == cudaSuccess) {
      ++i;
    } else if (status != cudaErrorNotReady) {
      error = AbortAll(*links, CudaError(warm_up, status), /*timed_out=*/false);
    } else if (state != ncclSuccess) {
      error = AbortAll(*links, NcclError(warm_up, state, (*links)[i]->comm_), /*timed_out=*/false);
    } else if (Clock::now() >= deadline) {
      error = AbortAll(*links, Timeout(warm_up, setup_timeout), /*timed_out=*/true);
    } else {
      Pause(polls++);
    }
  }
  for (size_t i = 0; i < specs.size(); ++i) {
    cudaSetDevice(specs[i].ordinal);
    cudaStreamDestroy(streams[i]);  // does not wait: after an abort, freed once the aborted kernels return
  }
  cudaSetDevice(saved);
  return error;
}

Status NcclLink::Settle(const std::vector<std::unique_ptr<NcclLink>>& links, ncclResult_t result,
                        const std::string& what, std::chrono::milliseconds timeout, Clock::time_point deadline) {
  int polls = 0;
  for (size_t i = 0; i < links.size() && Taken(result);) {
    result = StateOf(links[i]->comm_);
    if (result == ncclSuccess) {
      ++i;
    } else if (result == ncclInProgress) {
      if (Clock::now() >= deadline) return AbortAll(links, Timeout(what, timeout), /*timed_out=*/true);
      Pause(polls++);
    }
  }
  if (Taken(result)) return Status::Ok();
  return AbortAll(links, NcclError(what, result, nullptr), /*timed_out=*/false);
}

// NCCL requires every communicator of a failed group to be aborted. Nothing else uses them yet: no watchdog.
Status NcclLink::AbortAll(const std::vector<std::unique_ptr<NcclLink>>& links, const Status& why, bool timed_out) {
  for (const auto& link : links) {
    ncclComm_t comm = nullptr;
    {
      std::lock_guard<std::mutex> lock(link->mutex_);
      link->AbortLocked(why, timed_out, &comm);
    }
    Abort(comm);
  }
  return why;
}

void NcclLink::Abort(ncclComm_t comm) {
  if (comm != nullptr) ncclCommAbort(comm);  // its kernels return, so the stream moves on
}

Status NcclLink::AbortLocked(const Status& why, bool timed_out, ncclComm_t* comm) {
  *comm = nullptr;
  if (aborted_) return failure_;
  // Every later call of this GPU fails with this code, before its kernels meet the call this one left undone.
  volatile HostStatus* failed = status_;
  if (failed->code == kOk) {
    failed->peer = -1;
    failed->reporter = rank_;
    failed->call = failed->nccl_started;
    std::atomic_thread_fence(std::memory_order_release);  // the fields before the code, for its readers
    failed->code = timed_out ? kNcclTimeout : kNcclFailed;
  }
  *comm = comm_;
  comm_ = nullptr;
  aborted_ = true;
  failure_ = why;
  return why;
}

NcclLink::~NcclLink() {
  int saved = 0;
  cudaGetDevice(&saved);
  cudaSetDevice(ordinal_);
  cudaDeviceSynchronize();
  // Abort frees this process's side without waiting for the other ranks; nothing is in flight by now
  // (jax_ep.finalize puts a barrier between the processes first), or a rank is gone for good. An aborted
  // communicator is freed already (comm_ is null).
  Abort(comm_);
  cudaFree(outbox_);
  cudaFree(inbox_);
  cudaSetDevice(saved);
}

Status NcclLink::Swap(int64_t region_bytes, cudaStream_t stream) {
  const std::string what = "the NCCL swap (ncclSend/ncclRecv) of GPU " + Str(ordinal_);
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &capture) != cudaSuccess || capture != cudaStreamCaptureStatusNone) {
    cudaGetLastError();
    return Status::Error(StatusCode::kFailedPrecondition,
                         what + " was asked for while its stream is captured into a CUDA graph: a group that "
                         "reaches a rank through NCCL must not run inside command buffers (jax_ep calls of such "
                         "groups use FFI targets that XLA does not capture; see docs/cuda_backend.md)");
  }
  const Clock::time_point deadline = Clock::now() + timeout_;
  ncclComm_t aborted = nullptr;
  Status status = Status::Ok();
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) {
      return Status::Error(failure_.code, "the NCCL communicator of GPU " + Str(ordinal_) +
                                              " was aborted after an earlier failure: " + failure_.message);
    }
    ncclResult_t result = ncclGroupStart();
    for (int peer = 0; peer < num_ranks_; ++peer) {
      if (!ByNccl(nccl_ranks_, peer)) continue;
      const ncclResult_t send = ncclSend(outbox_ + peer * region_bytes, region_bytes, ncclUint8, peer, comm_, stream);
      const ncclResult_t recv = ncclRecv(inbox_ + peer * region_bytes, region_bytes, ncclUint8, peer, comm_, stream);
      if (Taken(result)) result = Taken(send) ? recv : send;
    }
    const ncclResult_t end = ncclGroupEnd();
    if (Taken(result)) result = end;
    if (result == ncclSuccess) return Status::Ok();  // on the stream already
    if (result != ncclInProgress) status = AbortLocked(NcclError(what, result, comm_), /*timed_out=*/false, &aborted);
  }
  if (!status.ok()) {
    Abort(aborted);
    return status;
  }
  // NCCL enqueues in the background (connecting first if it must); the stream gets nothing else before it has.
  // mutex_ is free between polls, so the watchdog may abort meanwhile: then this swap reports its failure.
  for (int polls = 0;; ++polls) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (aborted_) return failure_;
      const ncclResult_t state = StateOf(comm_);
      if (state == ncclSuccess) return Status::Ok();
      if (state != ncclInProgress) {
        status = AbortLocked(NcclError(what, state, comm_), /*timed_out=*/false, &aborted);
      } else if (Clock::now() >= deadline) {
        status = AbortLocked(Timeout(what, timeout_), /*timed_out=*/true, &aborted);
      }
    }
    if (!status.ok()) {
      Abort(aborted);
      return status;
    }
    Pause(polls);
  }
}

void NcclLink::Check() {
  // A swap holds mutex_ only inside NCCL calls that return at once: the next poll looks.
  ncclComm_t aborted = nullptr;
  {
    std::unique_lock<std::mutex> lock(mutex_, std::try_to_lock);
    if (!lock.owns_lock() || aborted_) return;
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
      pending_timeout_ = status->nccl_first ? first_timeout_ : timeout_;
      return;
    }
    if (now - pending_since_ <= pending_timeout_) return;
    AbortLocked(Timeout("an NCCL swap of GPU " + Str(ordinal_) + " (call " + Str(static_cast<int64_t>(started)) + ")",
                        pending_timeout_),
                /*timed_out=*/true, &aborted);
  }
  Abort(aborted);
}

}  // namespace jax_ep
