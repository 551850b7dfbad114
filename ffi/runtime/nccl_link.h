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
  };

  // Communicators of several local GPUs, created in one NCCL group (one thread drives them all), then one
  // swap of full regions with every NCCL rank and a synchronize, so no NCCL set-up is left for execution.
  static Status Create(const std::vector<Spec>& specs, std::chrono::milliseconds timeout,
                       std::vector<std::unique_ptr<NcclLink>>* links);
  ~NcclLink();

  // Enqueues the swap of one call on `stream`: region d of the outbox (region_bytes) goes to each NCCL rank d,
  // and its region lands in region d of the inbox. Sizes are fixed, so no count ever travels to the host.
  Status Swap(int64_t region_bytes, cudaStream_t stream);
  // The watchdog's poll: aborts the communicator once a swap has been unfinished for longer than the timeout.
  // The kernels report each swap's start and end in the host status, so captured swaps are watched too.
  void Check();

  char* outbox() const { return outbox_; }
  char* inbox() const { return inbox_; }

 private:
  using Clock = std::chrono::steady_clock;

  int ordinal_ = -1;
  int rank_ = -1;
  int num_ranks_ = 0;
  uint64_t nccl_ranks_ = 0;
  ncclComm_t comm_ = nullptr;
  char* outbox_ = nullptr;
  char* inbox_ = nullptr;
  HostStatus* status_ = nullptr;
  std::chrono::milliseconds timeout_{0};
  std::mutex mutex_;  // a swap being enqueued, the watchdog, and the abort exclude each other
  bool aborted_ = false;
  uint64_t pending_call_ = 0;  // the swap the watchdog has seen unfinished, and since when
  Clock::time_point pending_since_;
};

}  // namespace jax_ep
