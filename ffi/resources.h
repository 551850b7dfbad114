// Library-owned, peer-mapped memory of one EP group of local GPUs, created before execution.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "signals.h"

namespace jax_ep {

// One GPU's part of a group: its rank, its own buffers, and a device table of every rank's buffers.
struct DeviceResources {
  int ordinal = -1;
  int rank = -1;
  int num_ranks = 0;
  size_t capacity_bytes = 0;   // receive buffer size
  int num_sms = 0;              // SMs a transfer kernel may occupy: one block of each
  char* recv_buffer = nullptr;  // [R * rows * row_bytes] written by peers, per call
  Signals* signals = nullptr;   // flags, counts and epoch in this GPU's memory
  PeerTable* peers = nullptr;   // device copy of every rank's recv_buffer and signals
  int32_t* missing_peer = nullptr;  // pinned host memory, mapped for the kernels: GroupView::missing_peer
  int32_t* missing_peer_on_device = nullptr;  // the kernels' address of missing_peer
};

// All groups made by one Initialize call, keyed by device ordinal.
class Resources {
 public:
  // Allocates and peer-maps buffers for each group of device ordinals; the transfer kernels of each GPU
  // get min(num_sms, its SM count) SMs (all of them when num_sms is 0). Returns "" or an error message.
  std::string Initialize(const std::vector<std::vector<int>>& groups, size_t capacity_bytes, int num_sms);
  // The fewest SMs any GPU's transfer kernels got.
  int MinSms() const;
  // Frees everything after synchronizing the devices.
  void Release();
  // The resources of a device, or nullptr when it is in no group or was released.
  const DeviceResources* Find(int ordinal) const;

 private:
  mutable std::mutex mutex_;
  std::unordered_map<int, DeviceResources> devices_;
};

// The process-wide resources that jax_ep.initialize() sets up.
std::shared_ptr<Resources> CurrentResources();
// Returns "" or an error message; *sms_used gets Resources::MinSms().
std::string InitializeResources(const std::vector<std::vector<int>>& groups, size_t capacity_bytes, int num_sms,
                                int* sms_used);
void ReleaseResources();

}  // namespace jax_ep
