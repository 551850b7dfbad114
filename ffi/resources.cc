// Creation and release of the peer-mapped buffers of each EP group (one process, all its GPUs).
#include "resources.h"

#include <cuda_runtime.h>

namespace jax_ep {
namespace {

std::mutex current_mutex;
std::shared_ptr<Resources> current;

std::string CudaError(const char* what, int ordinal, cudaError_t status) {
  return std::string("jax_ep.initialize: ") + what + " on GPU " + std::to_string(ordinal) +
         " failed: " + cudaGetErrorString(status);
}

// Restores the calling thread's current device when it goes out of scope.
struct DeviceGuard {
  int saved = 0;
  DeviceGuard() { cudaGetDevice(&saved); }
  ~DeviceGuard() { cudaSetDevice(saved); }
};

}  // namespace

std::string Resources::Initialize(const std::vector<std::vector<int>>& groups, size_t capacity_bytes, int num_sms) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  for (const auto& group : groups) {
    const int num_ranks = static_cast<int>(group.size());
    if (num_ranks < 1 || num_ranks > kMaxRanks) {
      return "jax_ep.initialize: an EP group must have 1 to " + std::to_string(kMaxRanks) + " GPUs, got " +
             std::to_string(num_ranks);
    }
    PeerTable table{};
    for (int rank = 0; rank < num_ranks; ++rank) {
      const int ordinal = group[rank];
      if (devices_.count(ordinal)) {
        return "jax_ep.initialize: GPU " + std::to_string(ordinal) + " appears in more than one EP group";
      }
      DeviceResources& device = devices_[ordinal];
      device.ordinal = ordinal;
      device.rank = rank;
      device.num_ranks = num_ranks;
      device.capacity_bytes = capacity_bytes;
      cudaError_t status = cudaSetDevice(ordinal);
      if (status != cudaSuccess) return CudaError("cudaSetDevice", ordinal, status);
      int device_sms = 0;
      status = cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, ordinal);
      if (status != cudaSuccess) return CudaError("cudaDeviceGetAttribute(MultiProcessorCount)", ordinal, status);
      device.num_sms = num_sms > 0 && num_sms < device_sms ? num_sms : device_sms;
      for (int peer : group) {
        if (peer == ordinal) continue;
        int can_access = 0;
        cudaDeviceCanAccessPeer(&can_access, ordinal, peer);
        if (!can_access) {
          return "jax_ep.initialize: GPU " + std::to_string(ordinal) + " cannot access GPU " + std::to_string(peer) +
                 " by P2P; backend='cuda' needs NVLink/P2P peers in one process";
        }
        status = cudaDeviceEnablePeerAccess(peer, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else if (status != cudaSuccess) {
          return CudaError("cudaDeviceEnablePeerAccess", ordinal, status);
        }
      }
      if ((status = cudaMalloc(&device.recv_buffer, capacity_bytes)) != cudaSuccess ||
          (status = cudaMalloc(&device.signals, sizeof(Signals))) != cudaSuccess ||
          (status = cudaMemset(device.signals, 0, sizeof(Signals))) != cudaSuccess ||
          (status = cudaMalloc(&device.peers, sizeof(PeerTable))) != cudaSuccess) {
        return CudaError("allocating the receive buffer", ordinal, status);
      }
      if ((status = cudaHostAlloc(&device.missing_peer, sizeof(int32_t), cudaHostAllocMapped | cudaHostAllocPortable)) !=
              cudaSuccess ||
          (status = cudaHostGetDevicePointer(&device.missing_peer_on_device, device.missing_peer, 0)) != cudaSuccess) {
        return CudaError("allocating the host-mapped timeout flag", ordinal, status);
      }
      *device.missing_peer = 0;
      table.recv_buffer[rank] = device.recv_buffer;
      table.signals[rank] = device.signals;
    }
    for (int ordinal : group) {
      cudaSetDevice(ordinal);
      cudaError_t status = cudaMemcpy(devices_[ordinal].peers, &table, sizeof(PeerTable), cudaMemcpyHostToDevice);
      if (status == cudaSuccess) status = cudaDeviceSynchronize();
      if (status != cudaSuccess) return CudaError("publishing the peer table", ordinal, status);
    }
  }
  return "";
}

void Resources::Release() {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  for (auto& [ordinal, device] : devices_) {
    cudaSetDevice(ordinal);
    cudaDeviceSynchronize();
  }
  for (auto& [ordinal, device] : devices_) {
    cudaSetDevice(ordinal);
    cudaFree(device.recv_buffer);
    cudaFree(device.signals);
    cudaFree(device.peers);
    cudaFreeHost(device.missing_peer);
  }
  devices_.clear();
}

int Resources::MinSms() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int fewest = 0;
  for (const auto& [ordinal, device] : devices_) {
    if (fewest == 0 || device.num_sms < fewest) fewest = device.num_sms;
  }
  return fewest;
}

const DeviceResources* Resources::Find(int ordinal) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = devices_.find(ordinal);
  return it == devices_.end() ? nullptr : &it->second;
}

std::shared_ptr<Resources> CurrentResources() {
  std::lock_guard<std::mutex> lock(current_mutex);
  return current;
}

std::string InitializeResources(const std::vector<std::vector<int>>& groups, size_t capacity_bytes, int num_sms,
                                int* sms_used) {
  ReleaseResources();
  auto resources = std::make_shared<Resources>();
  std::string error = resources->Initialize(groups, capacity_bytes, num_sms);
  if (!error.empty()) {
    resources->Release();
    return error;
  }
  *sms_used = resources->MinSms();
  std::lock_guard<std::mutex> lock(current_mutex);
  current = std::move(resources);
  return "";
}

void ReleaseResources() {
  std::shared_ptr<Resources> released;
  {
    std::lock_guard<std::mutex> lock(current_mutex);
    released = std::move(current);
  }
  if (released) released->Release();
}

}  // namespace jax_ep
