// Library-owned, peer-mapped memory of the EP groups, created before execution.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "nccl_link.h"
#include "signals.h"

namespace jax_ep {

// One GPU's part of a group: its rank, its own buffers, and a device table of every rank's buffers.
struct DeviceResources {
  int ordinal = -1;
  int rank = -1;
  int num_ranks = 0;
  size_t capacity_bytes = 0;                  // receive buffer size
  int num_sms = 0;                            // SMs a transfer kernel may occupy: one block of each
  char* recv_buffer = nullptr;                // [R * rows * row_bytes] written by peers, per call
  Signals* signals = nullptr;                 // flags, counts and epoch in this GPU's memory
  PeerTable* peers = nullptr;                 // device copy of every rank's recv_buffer and signals
  int32_t* missing_peer = nullptr;            // pinned host memory, mapped for the kernels: GroupView::missing_peer
  int32_t* missing_peer_on_device = nullptr;  // the kernels' address of missing_peer
  std::vector<void*> opened;                  // peers' memory mapped from other processes, closed on release
  uint64_t nccl_ranks = 0;                    // bit r: rank r is reached through NCCL
  std::unique_ptr<NcclLink> nccl;             // set when a pair of the GPU's group goes through NCCL
};

// How one rank of a group is reached: through NCCL, a GPU of this process, or CUDA IPC handles from the
// process that has it.
struct RankAddress {
  bool nccl = false;        // no peer stores: rows go through NCCL (Resources::ConnectNccl)
  int ordinal = -1;         // >= 0: this process's GPU
  std::string ipc_handles;  // otherwise: what Resources::ExportHandles gave in that rank's process
};

// Every GPU of this process that takes part in an EP group, keyed by device ordinal. Made in two steps, so
// that processes can swap IPC handles in between: Allocate each local GPU, then Connect it to its group.
class Resources {
 public:
  Resources() = default;
  // Stops the watchdog. Without Release (at process exit) the NCCL links are left to the exit to free.
  ~Resources();
  // Buffers, signals and the timeout flag of local GPU `ordinal`, rank `rank` of a group of `num_ranks`; its
  // transfer kernels get min(num_sms, its SM count) SMs (all when num_sms is 0). Returns "" or an error.
  std::string Allocate(int ordinal, int rank, int num_ranks, size_t capacity_bytes, int num_sms);
  // CUDA IPC handles of an allocated GPU's receive buffer and signals.
  std::string ExportHandles(int ordinal, std::string* handles) const;
  // Maps every rank of the GPU's group into its address space (peer access or IPC), publishes the peer table
  // in its memory and synchronizes it. ranks[r] is rank r. Returns "" or an error.
  std::string Connect(int ordinal, const std::vector<RankAddress>& ranks);
  // Creates the NCCL links of the connected GPUs whose groups have pairs that go through NCCL, every one of
  // them in one call; unique_ids[i] is the ncclUniqueId of ordinals[i]'s group. Starts the swaps' watchdog.
  std::string ConnectNccl(const std::vector<int>& ordinals, const std::vector<std::string>& unique_ids,
                          int64_t timeout_ms);
  // Unmaps the memory of other processes' GPUs after synchronizing the devices. Before those processes free
  // it, every process unmaps (jax_ep.finalize puts a barrier in between).
  void ClosePeerMappings();
  // Frees everything after synchronizing the devices.
  void Release();
  // The resources of a device, or nullptr when it is in no group or was released.
  const DeviceResources* Find(int ordinal) const;
  // The fewest SMs any GPU's transfer kernels got.
  int MinSms() const;

 private:
  void StopWatchdog();

  mutable std::mutex mutex_;
  std::unordered_map<int, DeviceResources> devices_;
  std::thread watchdog_;
  std::atomic<bool> stop_watchdog_{false};
};

// The process-wide resources that jax_ep.initialize() sets up: BeginResources() releases the current ones and
// starts a new set, which the handlers see only after CommitResources().
std::shared_ptr<Resources> BeginResources();
void CommitResources();
std::shared_ptr<Resources> PendingResources();
std::shared_ptr<Resources> CurrentResources();
void ReleaseResources();
// ClosePeerMappings of the current (or pending) resources.
void CloseCurrentPeerMappings();

}  // namespace jax_ep
