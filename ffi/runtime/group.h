// Library-owned GPU memory of the EP groups, created by jax_ep.initialize before any computation runs.
#pragma once

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <thread>
#include <vector>

#include "../kernels/launch.h"
#include "nccl_link.h"

namespace jax_ep {

// One GPU's part of a group: its rank, its memory, and a device table of every rank's staging and signals.
struct DeviceResources {
  int ordinal = -1;
  int rank = -1;
  int num_ranks = 0;
  int num_sms = 0;                       // SMs a kernel may occupy: one block of each
  int64_t half_bytes = 0;                // each of the two staging halves
  int64_t scratch_ints = 0;
  uint64_t timeout_ns = 0;
  uint64_t first_timeout_ns = 0;         // the first call of each FFI instance
  char* staging = nullptr;               // [2][half_bytes], written by peers
  Signals* signals = nullptr;            // flags, abort word, call count
  PeerTable* peers = nullptr;            // device copy of every rank's staging and signals
  int32_t* scratch = nullptr;            // the routing kernel's scratch
  HostStatus* status = nullptr;          // pinned host memory, mapped for the kernels
  HostStatus* status_on_device = nullptr;
  std::vector<void*> opened;             // peers' memory mapped from other processes, closed on release
  uint64_t nccl_ranks = 0;               // bit r: rank r is reached through NCCL
  std::unique_ptr<NcclLink> nccl;        // set when a pair of the GPU's group goes through NCCL

  DeviceResources() = default;
  DeviceResources(const DeviceResources&) = delete;
  DeviceResources& operator=(const DeviceResources&) = delete;
  // Frees the memory once nothing uses it any more: after Group::Release and the last call that found it.
  ~DeviceResources();

  GroupView View() const;
  // "" or what the kernels recorded on this GPU, in words.
  std::string Failure() const;
};

// How one rank of a group is reached: through NCCL, a GPU of this process, or CUDA IPC handles from the
// process that has it.
struct RankAddress {
  bool nccl = false;        // no peer stores: rows go through NCCL (Group::ConnectNccl)
  int ordinal = -1;         // >= 0: this process's GPU
  std::string ipc_handles;  // otherwise: what Group::ExportHandles gave in that rank's process
};

// This process's GPUs of every EP group along one mesh axis (jax_ep.Group), keyed by device ordinal. Made in
// steps, so that processes can swap IPC handles in between: Allocate each local GPU, Connect it, Commit.
class Group {
 public:
  explicit Group(int64_t id) : id_(id) {}
  ~Group();  // stops the watchdog
  Group(const Group&) = delete;
  Group& operator=(const Group&) = delete;

  Status Allocate(int ordinal, int rank, int num_ranks, int64_t staging_bytes, int64_t scratch_ints, int num_sms,
                  double timeout_s, double first_timeout_s);
  Status ExportHandles(int ordinal, std::string* handles) const;
  // *ok: whether this GPU can map the memory of another process's GPU from the handles ExportHandles gave there
  // (closed again at once). False means no P2P between the two GPUs: the pair must go through NCCL.
  Status CanOpenHandles(int ordinal, const std::string& handles, bool* ok) const;
  // Maps every rank into this GPU's address space (peer access or IPC), publishes the peer table, syncs.
  Status Connect(int ordinal, const std::vector<RankAddress>& ranks);
  // NCCL links of the connected GPUs whose groups have pairs that go through NCCL, all in one call;
  // unique_ids[i] is the ncclUniqueId of ordinals[i]'s group. NCCL's set-up waits up to setup_timeout_ms
  // for the other processes, each swap up to timeout_ms. Starts the swaps' watchdog.
  Status ConnectNccl(const std::vector<int>& ordinals, const std::vector<std::string>& unique_ids,
                     int64_t timeout_ms, int64_t setup_timeout_ms);
  void Commit() { committed_ = true; }
  // Stops the group (Stop), then unmaps other processes' memory (jax_ep.finalize puts a barrier between this and
  // Release, so no process frees memory another still maps).
  void ClosePeerMappings();
  // Stops the group, and frees each GPU's memory once no call in flight holds it.
  void Release();

  // Held by an execute handler from its check that the group is usable to the return of its launches, so that
  // Stop, which waits for it, never frees or unmaps memory that a launch is about to reach.
  std::shared_lock<std::shared_mutex> LockLaunches() const { return std::shared_lock(launches_mutex_); }
  int64_t id() const { return id_; }
  bool usable() const { return committed_ && !released_; }
  // The resources of a GPU (kept alive by the pointer), or null when it is in no group of this axis.
  std::shared_ptr<const DeviceResources> Find(int ordinal) const;
  int MinSms() const;
  // "" or the first failure any of this process's GPUs recorded.
  std::string Failure() const;
  // Launches of the group's calls by the execute handlers, on the host: under XLA command buffers the handlers
  // run only when XLA records a graph, so there are fewer launches than calls.
  void CountLaunch() { launches_.fetch_add(1, std::memory_order_relaxed); }
  int64_t launches() const { return launches_.load(std::memory_order_relaxed); }

 private:
  void StopWatchdog();
  // Later launches fail (usable() is false); waits for launches under way (LockLaunches), then for every kernel
  // queued on the group's GPUs.
  void Stop();

  int64_t id_;
  mutable std::shared_mutex launches_mutex_;
  mutable std::mutex mutex_;
  std::map<int, std::shared_ptr<DeviceResources>> devices_;
  std::atomic<bool> committed_{false};
  std::atomic<bool> released_{false};
  std::atomic<int64_t> launches_{0};
  std::thread watchdog_;
  std::atomic<bool> stop_watchdog_{false};
};

// The groups of this process by id: jax_ep.initialize adds one, jax_ep.finalize releases and drops it.
std::shared_ptr<Group> AddGroup(int64_t id);
std::shared_ptr<Group> FindGroup(int64_t id);  // null when unknown
void DropGroup(int64_t id);

}  // namespace jax_ep
