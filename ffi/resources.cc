// Creation and release of the peer-mapped buffers of each EP group: peer access between the GPUs of this
// process, CUDA IPC for GPUs of other processes.
#include "resources.h"

#include <cuda_runtime.h>

namespace jax_ep {
namespace {

std::mutex current_mutex;
std::shared_ptr<Resources> current;
std::shared_ptr<Resources> pending;

std::string Str(int64_t value) { return std::to_string(value); }

std::string CudaError(const char* what, int ordinal, cudaError_t status) {
  return std::string("jax_ep.initialize: ") + what + " on GPU " + Str(ordinal) + " failed: " +
         cudaGetErrorString(status);
}

// Restores the calling thread's current device when it goes out of scope.
struct DeviceGuard {
  int saved = 0;
  DeviceGuard() { cudaGetDevice(&saved); }
  ~DeviceGuard() { cudaSetDevice(saved); }
};

struct IpcHandles {
  cudaIpcMemHandle_t recv_buffer;
  cudaIpcMemHandle_t signals;
};

}  // namespace

std::string Resources::Allocate(int ordinal, int rank, int num_ranks, size_t capacity_bytes, int num_sms) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  if (num_ranks < 1 || num_ranks > kMaxRanks || rank < 0 || rank >= num_ranks) {
    return "jax_ep.initialize: an EP group must have 1 to " + Str(kMaxRanks) + " GPUs and rank in [0, R), got R=" +
           Str(num_ranks) + ", rank " + Str(rank);
  }
  if (devices_.count(ordinal)) return "jax_ep.initialize: GPU " + Str(ordinal) + " appears in more than one EP group";
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
  if ((status = cudaDeviceSynchronize()) != cudaSuccess) return CudaError("cudaDeviceSynchronize", ordinal, status);
  return "";
}

std::string Resources::ExportHandles(int ordinal, std::string* handles) const {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  auto it = devices_.find(ordinal);
  if (it == devices_.end()) return "jax_ep.initialize: GPU " + Str(ordinal) + " was not allocated";
  IpcHandles exported;
  cudaError_t status = cudaSetDevice(ordinal);
  if (status == cudaSuccess) status = cudaIpcGetMemHandle(&exported.recv_buffer, it->second.recv_buffer);
  if (status == cudaSuccess) status = cudaIpcGetMemHandle(&exported.signals, it->second.signals);
  if (status != cudaSuccess) return CudaError("cudaIpcGetMemHandle", ordinal, status);
  handles->assign(reinterpret_cast<const char*>(&exported), sizeof(exported));
  return "";
}

std::string Resources::Connect(int ordinal, const std::vector<RankAddress>& ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  auto it = devices_.find(ordinal);
  if (it == devices_.end()) return "jax_ep.initialize: GPU " + Str(ordinal) + " was not allocated";
  DeviceResources& device = it->second;
  if (static_cast<int>(ranks.size()) != device.num_ranks) {
    return "jax_ep.initialize: GPU " + Str(ordinal) + " needs the addresses of its " + Str(device.num_ranks) +
           " ranks, got " + Str(ranks.size());
  }
  cudaError_t status = cudaSetDevice(ordinal);
  if (status != cudaSuccess) return CudaError("cudaSetDevice", ordinal, status);
  PeerTable table{};
  device.nccl_ranks = 0;
  for (int rank = 0; rank < device.num_ranks; ++rank) {
    const RankAddress& address = ranks[rank];
    if (address.nccl) {
      if (rank == device.rank) return "jax_ep.initialize: a GPU cannot reach itself through NCCL";
      device.nccl_ranks |= uint64_t{1} << rank;
      continue;
    }
    if (address.ordinal >= 0) {
      auto peer = devices_.find(address.ordinal);
      if (peer == devices_.end() || peer->second.rank != rank) {
        return "jax_ep.initialize: rank " + Str(rank) + " of GPU " + Str(ordinal) + "'s group should be GPU " +
               Str(address.ordinal) + " of this process, which was not allocated as that rank";
      }
      if (address.ordinal != ordinal) {
        int can_access = 0;
        cudaDeviceCanAccessPeer(&can_access, ordinal, address.ordinal);
        if (!can_access) {
          return "jax_ep.initialize: GPU " + Str(ordinal) + " cannot access GPU " + Str(address.ordinal) +
                 " by P2P, so it must reach it through NCCL";
        }
        status = cudaDeviceEnablePeerAccess(address.ordinal, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else if (status != cudaSuccess) {
          return CudaError("cudaDeviceEnablePeerAccess", ordinal, status);
        }
      }
      table.recv_buffer[rank] = peer->second.recv_buffer;
      table.signals[rank] = peer->second.signals;
      continue;
    }
    if (address.ipc_handles.size() != sizeof(IpcHandles)) {
      return "jax_ep.initialize: rank " + Str(rank) + "'s IPC handles must be " + Str(sizeof(IpcHandles)) +
             " bytes, got " + Str(address.ipc_handles.size());
    }
    IpcHandles handles;
    address.ipc_handles.copy(reinterpret_cast<char*>(&handles), sizeof(handles));
    void* recv_buffer = nullptr;
    void* signals = nullptr;
    status = cudaIpcOpenMemHandle(&recv_buffer, handles.recv_buffer, cudaIpcMemLazyEnablePeerAccess);
    if (status == cudaSuccess) device.opened.push_back(recv_buffer);
    if (status == cudaSuccess) status = cudaIpcOpenMemHandle(&signals, handles.signals, cudaIpcMemLazyEnablePeerAccess);
    if (status == cudaSuccess) device.opened.push_back(signals);
    if (status != cudaSuccess) {
      return "jax_ep.initialize: GPU " + Str(ordinal) + " could not map the buffers of rank " + Str(rank) +
             " from its process (cudaIpcOpenMemHandle: " + cudaGetErrorString(status) +
             "); GPUs of one host must reach each other by P2P, or pass transport='nccl'";
    }
    table.recv_buffer[rank] = static_cast<char*>(recv_buffer);
    table.signals[rank] = static_cast<Signals*>(signals);
  }
  status = cudaMemcpy(device.peers, &table, sizeof(PeerTable), cudaMemcpyHostToDevice);
  if (status == cudaSuccess) status = cudaDeviceSynchronize();
  if (status != cudaSuccess) return CudaError("publishing the peer table", ordinal, status);
  return "";
}

std::string Resources::ConnectNccl(const std::vector<int>& ordinals, const std::vector<std::string>& unique_ids,
                                   int64_t timeout_ms) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ordinals.size() != unique_ids.size()) return "jax_ep.initialize: one NCCL unique id per GPU is needed";
  std::vector<NcclLink::Spec> specs;
  for (size_t i = 0; i < ordinals.size(); ++i) {
    auto it = devices_.find(ordinals[i]);
    if (it == devices_.end()) return "jax_ep.initialize: GPU " + Str(ordinals[i]) + " was not allocated";
    const DeviceResources& device = it->second;
    specs.push_back({device.ordinal, device.rank, device.num_ranks, device.nccl_ranks, unique_ids[i],
                     device.recv_buffer, device.capacity_bytes, device.missing_peer});
  }
  std::vector<std::unique_ptr<NcclLink>> links;
  std::string error = NcclLink::Create(specs, std::chrono::milliseconds(timeout_ms), &links);
  for (size_t i = 0; i < links.size(); ++i) devices_[ordinals[i]].nccl = std::move(links[i]);
  if (!error.empty()) return error;
  std::vector<NcclLink*> watched;  // fixed from here until Release, which stops the watchdog before freeing
  for (auto& [ordinal, device] : devices_) {
    if (device.nccl) watched.push_back(device.nccl.get());
  }
  StopWatchdog();
  stop_watchdog_ = false;
  watchdog_ = std::thread([this, watched] {
    while (!stop_watchdog_.load()) {
      for (NcclLink* link : watched) link->Check();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  return "";
}

Resources::~Resources() {
  StopWatchdog();
  for (auto& [ordinal, device] : devices_) device.nccl.release();  // NOLINT: no CUDA calls during exit
}

void Resources::StopWatchdog() {
  stop_watchdog_ = true;
  if (watchdog_.joinable()) watchdog_.join();
}

void Resources::ClosePeerMappings() {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  for (auto& [ordinal, device] : devices_) {
    cudaSetDevice(ordinal);
    cudaDeviceSynchronize();
    for (void* mapped : device.opened) cudaIpcCloseMemHandle(mapped);
    device.opened.clear();
  }
}

void Resources::Release() {
  ClosePeerMappings();
  StopWatchdog();
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  for (auto& [ordinal, device] : devices_) {
    device.nccl.reset();
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

std::shared_ptr<Resources> BeginResources() {
  ReleaseResources();
  std::lock_guard<std::mutex> lock(current_mutex);
  pending = std::make_shared<Resources>();
  return pending;
}

std::shared_ptr<Resources> PendingResources() {
  std::lock_guard<std::mutex> lock(current_mutex);
  return pending;
}

void CommitResources() {
  std::lock_guard<std::mutex> lock(current_mutex);
  current = std::move(pending);
}

std::shared_ptr<Resources> CurrentResources() {
  std::lock_guard<std::mutex> lock(current_mutex);
  return current;
}

void CloseCurrentPeerMappings() {
  std::shared_ptr<Resources> resources[2];
  {
    std::lock_guard<std::mutex> lock(current_mutex);
    resources[0] = current;
    resources[1] = pending;
  }
  for (auto& held : resources) {
    if (held) held->ClosePeerMappings();
  }
}

void ReleaseResources() {
  std::shared_ptr<Resources> released[2];
  {
    std::lock_guard<std::mutex> lock(current_mutex);
    released[0] = std::move(current);
    released[1] = std::move(pending);
  }
  for (auto& resources : released) {
    if (resources) resources->Release();
  }
}

}  // namespace jax_ep
