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

#include "signals.h"

namespace jax_ep {

// A communicator over the whole group, an outbox the send kernels fill for the NCCL ranks, and a watch on
// the swaps: one still pending after the timeout aborts the communicator (which ends its kernels) and marks
// the GPU's group as failed, so the next call reports it instead of every later call hanging.
class NcclLink {
 public:
  struct Spec {
    int ordinal;
    int rank;
    int num_ranks;
    uint64_t nccl_ranks;     // bit r: rank r is reached through NCCL
    std::string unique_id;   // the group's ncclUniqueId, the same in every process
    char* recv_buffer;       // this GPU's receive buffer
    size_t capacity_bytes;   // its size, and the outbox's
    int32_t* missing_peer;   // host-mapped failure flag of the GPU (GroupView::missing_peer)
  };

  // Communicators of several local GPUs, created in one NCCL group (one thread drives them all), then one
  // swap of full regions with every NCCL rank and a synchronize, so no NCCL set-up is left for execution.
  static std::string Create(const std::vector<Spec>& specs, std::chrono::milliseconds timeout,
                            std::vector<std::unique_ptr<NcclLink>>* links);
  ~NcclLink();

  // Enqueues on `stream` the swap of a transfer: region d of `send` (region_bytes) goes to each NCCL rank d
  // and its region arrives in region d of this GPU's receive buffer; send_counts[d] (may be null) goes along
  // into Signals::counts_by_nccl[rank]. Sizes are fixed, so no count ever travels to the host.
  std::string Swap(const GroupView& group, const char* send, int64_t region_bytes, const int32_t* send_counts,
                   cudaStream_t stream);
  // The watchdog's poll: aborts the communicator once the oldest pending swap is older than the timeout.
  void Check();

  char* outbox() const { return outbox_; }

 private:
  using Clock = std::chrono::steady_clock;
  struct Watched {
    cudaEvent_t event = nullptr;
    Clock::time_point enqueued;
  };
  static constexpr int kWatched = 256;  // swaps watched at once; later ones go unwatched until these finish

  int ordinal_ = -1;
  ncclComm_t comm_ = nullptr;
  char* outbox_ = nullptr;
  int32_t* missing_peer_ = nullptr;
  std::chrono::milliseconds timeout_{0};
  std::mutex mutex_;  // a swap being enqueued, the watchdog, and the abort exclude each other
  bool aborted_ = false;
  Watched watched_[kWatched];
  int first_ = 0, pending_ = 0;
  Clock::time_point last_done_;
};

}  // namespace jax_ep
