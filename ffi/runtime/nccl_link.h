// The NCCL side of one GPU of an EP group: how it reaches the ranks it cannot reach by peer stores.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "../kernels/launch.h"

namespace jax_ep {

// A communicator over the whole group, the outbox the send kernels fill for the NCCL ranks and the inbox the
// swaps fill, and a watch on the swaps: one still unfinished after the timeout aborts the communicator (which
// ends its kernels) and records the failure, so the receive kernel gives up and the next call reports it.
// The communicator is non-blocking (ncclConfig_t::blocking = 0): no NCCL call waits for another rank, the
// work goes on in NCCL's background thread, and every wait for it is polled here up to the timeout, so an
// abort can always end it (NCCL's fault-tolerance rule) and the watchdog never waits behind an NCCL call.
class NcclLink {
 public:
  struct Spec {
    int ordinal;
    int rank;
    int num_ranks;
    uint64_t nccl_ranks;    // bit r: rank r is reached through NCCL
    std::string unique_id;  // the group's ncclUniqueId, the same in every process
    int64_t half_bytes;     // size of the outbox and the inbox
    HostStatus* status;     // the GPU's host-mapped status (the send/receive kernels write the swap's call number)
    std::chrono::milliseconds first_timeout;  // the watchdog's timeout for the first call of an FFI instance
  };

  // Communicators of several local GPUs, created in one NCCL group (one thread drives them all), then one
  // swap of full regions with every NCCL rank, waited for, so no NCCL set-up is left for execution. The init
  // and the warm-up each get `setup_timeout`, each later swap `timeout`; past it (or on an NCCL error) every
  // communicator is aborted.
  static Status Create(const std::vector<Spec>& specs, std::chrono::milliseconds timeout,
                       std::chrono::milliseconds setup_timeout,
                       std::vector<std::unique_ptr<NcclLink>>* links);
  ~NcclLink();

  // Enqueues the swap of one call on `stream`: region d of the outbox (region_bytes) goes to each NCCL rank d,
  // and its region lands in region d of the inbox. Sizes are fixed, so no count ever travels to the host.
  // Returns once NCCL has put it on the stream, or aborts the communicator if that takes longer than the timeout.
  Status Swap(int64_t region_bytes, cudaStream_t stream);
  // The watchdog's poll: aborts the communicator once a swap has been unfinished for longer than the timeout (the
  // first-call timeout for the first call of an FFI instance). The kernels report each swap's start and end in the
  // host status. Never blocks on an NCCL call: while a swap is being enqueued it leaves the check to the next poll.
  void Check();

  char* outbox() const { return outbox_; }
  char* inbox() const { return inbox_; }

 private:
  using Clock = std::chrono::steady_clock;

  // Polls every link's communicator until the background work that `result` (what ncclGroupEnd returned)
  // started is done; aborts them all on an error, or at `deadline` (`timeout` after the work began).
  static Status Settle(const std::vector<std::unique_ptr<NcclLink>>& links, ncclResult_t result,
                       const std::string& what, std::chrono::milliseconds timeout, Clock::time_point deadline);
  static Status AbortAll(const std::vector<std::unique_ptr<NcclLink>>& links, const Status& why, bool timed_out);
  // With mutex_ held: marks the link aborted (nothing uses comm_ again), records a timeout in the host status as the
  // watchdog does, and returns `why`, which later swaps report. Hands the communicator to *comm, which the caller
  // aborts with Abort once it has released mutex_ (ncclCommAbort can block; a swap waits for mutex_).
  Status AbortLocked(const Status& why, bool timed_out, ncclComm_t* comm);
  static void Abort(ncclComm_t comm);

  int ordinal_ = -1;
  int rank_ = -1;
  int num_ranks_ = 0;
  uint64_t nccl_ranks_ = 0;
  ncclComm_t comm_ = nullptr;
  char* outbox_ = nullptr;
  char* inbox_ = nullptr;
  HostStatus* status_ = nullptr;
  std::chrono::milliseconds timeout_{0};
  std::chrono::milliseconds first_timeout_{0};
  std::mutex mutex_;  // one NCCL call on comm_ at a time (the calls a swap makes), and aborted_ and comm_
  bool aborted_ = false;  // comm_ is null and no NCCL call uses it again
  Status failure_;  // why comm_ was aborted
  uint64_t pending_call_ = 0;  // the swap the watchdog has seen unfinished, and since when
  Clock::time_point pending_since_;
  std::chrono::milliseconds pending_timeout_{0};
};

}  // namespace jax_ep
