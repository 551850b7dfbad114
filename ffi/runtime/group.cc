// Creation and release of the EP groups' GPU memory: peer access between the GPUs of this process, CUDA IPC
// for GPUs of other processes, NCCL for ranks without peer stores.
#include "group.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>

namespace jax_ep {
namespace {

// Never destroyed: at process exit no CUDA call may run, and the groups' memory goes with the process.
std::mutex& registry_mutex = *new std::mutex;
std::map<int64_t, std::shared_ptr<Group>>& registry = *new std::map<int64_t, std::shared_ptr<Group>>;

std::string Str(int64_t value) { return std::to_string(value); }

Status CudaError(const char* what, int ordinal, cudaError_t status) {
  return Status::Internal(std::string("jax_ep.initialize: ") + what + " on GPU " + Str(ordinal) +
                          " failed: " + cudaGetErrorString(status));
}

// Restores the calling thread's current device when it goes out of scope.
struct DeviceGuard {
  int saved = 0;
  DeviceGuard() { cudaGetDevice(&saved); }
  ~DeviceGuard() { cudaSetDevice(saved); }
};

struct IpcHandles {
  cudaIpcMemHandle_t staging;
  cudaIpcMemHandle_t signals;
};

uint32_t SiteOf(uint64_t tag) { return static_cast<uint32_t>((tag >> kTagSiteShift) & 0xffff); }

const char* OpName(int op) {
  switch (op) {
    case kOpDispatch: return "dispatch";
    case kOpCombineBackward: return "the backward pass of combine";
    case kOpCombine: return "combine (or the backward pass of dispatch)";
  }
  return "a jax_ep call";
}

}  // namespace

DeviceResources::~DeviceResources() {
  if (ordinal < 0) return;
  DeviceGuard guard;
  cudaSetDevice(ordinal);
  cudaDeviceSynchronize();  // kernels of calls still queued finish before their memory goes
  nccl.reset();
  for (void* mapped : opened) cudaIpcCloseMemHandle(mapped);
  cudaFree(staging);
  cudaFree(signals);
  cudaFree(peers);
  cudaFree(scratch);
  cudaFreeHost(status);
}

GroupView DeviceResources::View() const {
  GroupView view{};
  view.rank = rank;
  view.num_ranks = num_ranks;
  view.max_blocks = num_sms;
  view.staging = staging;
  view.half_bytes = half_bytes;
  view.signals = signals;
  view.peers = peers;
  view.status = status_on_device;
  view.timeout_ns = timeout_ns;
  view.first_timeout_ns = first_timeout_ns;
  view.nccl_ranks = nccl_ranks;
  view.outbox = nccl ? nccl->outbox() : nullptr;
  view.inbox = nccl ? nccl->inbox() : nullptr;
  view.scratch = scratch;
  view.scratch_ints = scratch_ints;
  return view;
}

std::string DeviceResources::Failure() const {
  const volatile HostStatus* s = status;
  const int code = s->code;
  if (code == kOk) return "";
  std::atomic_thread_fence(std::memory_order_acquire);  // the fields its writer stored before the code
  const std::string where = "GPU " + Str(ordinal) + " (rank " + Str(rank) + " of its EP group)";
  const std::string site = s->tag != 0 ? ", call site " + Str(SiteOf(s->tag)) : "";  // the watchdog knows none
  const std::string call = OpName(s->op) + std::string(" (call ") + Str(static_cast<int64_t>(s->call)) + site + ")";
  // Who saw it: this GPU, or another rank that told this one.
  const std::string who = s->relayed ? "rank " + Str(s->reporter) + " of the EP group of " + where : where;
  const std::string peer = s->relayed && s->peer == rank ? Str(s->peer) + " (this GPU)" : Str(s->peer);
  const std::string out_of_step =
      "; " + call + " on " + where + " gave up, its outputs hold NaN and the group is out of step: every later call "
      "fails until jax_ep.initialize is called again";
  switch (code) {
    case kMissingPeer:
      return "jax_ep: " + who + " gave up waiting for rank " + peer +
             " after the timeout_s given to jax_ep.initialize" + out_of_step + ". Find why rank " + Str(s->peer) +
             " stopped or came late (a crashed or stalled process, a hung GPU, a computation that runs on only part "
             "of the mesh)";
    case kOutOfOrder: {
      // What the other rank ran: the tag this GPU's wait saw, or, when another rank saw the failure and told this
      // GPU, that rank's own call (Signals::told), if that was at this position.
      const uint64_t seen = s->seen;
      if (seen >> kTagNumberShift == s->call && seen != s->tag) {
        const std::string other = s->relayed ? "rank " + Str(s->reporter) : "that rank";
        return "jax_ep: " + who + " met rank " + peer + " in another jax_ep call at the same position: " + other +
               " ran " + OpName(static_cast<int>(seen & 0xff)) + " from call site " + Str(SiteOf(seen)) +
               " where this GPU ran " + call + ". The ranks took different branches to jax_ep calls (a lax.cond or "
               "lax.switch on a value that differs between ranks), or ran independent calls in different orders; "
               "jax_ep.Group.check() names the call sites of this process" + out_of_step;
      }
      return "jax_ep: " + who + " met rank " + peer +
             " in another call: the ranks issued the group's jax_ep calls in different orders" + out_of_step;
    }
    case kWrongRank:
      return "jax_ep: on " + who + ", lax.axis_index " + Str(s->peer) +
             " differs from the kernels' rank (the rank jax_ep.initialize gave that GPU): the mesh inside shard_map "
             "orders its devices differently from the mesh given to jax_ep.initialize" + out_of_step;
    case kSplitOpen:
      return "jax_ep: " + who + " ran a call while a split op was open (a dispatch_start or combine_start, or "
             "the start half of a backward pass, whose finish had not run yet), or a finish without its start "
             "(open call tag " + Str(static_cast<int64_t>(s->seen)) + "): between a start and its finish the "
             "group must run no other jax_ep call" + out_of_step;
    case kStaleRegion:
      return "jax_ep: " + who + " received from rank " + peer + ", through NCCL, a region that does not belong to " +
             call + ": that rank gave up on the call (its own error says why)" + out_of_step;
    case kNcclTimeout:
      return "jax_ep: an NCCL swap on " + who +
             " with the ranks it reaches through NCCL did not finish within the timeout_s given to jax_ep.initialize, "
             "so its communicator was aborted" + out_of_step;
    case kNcclFailed:
      return "jax_ep: an NCCL call of a swap on " + who + " returned an error, so its communicator was aborted; "
             "the first jax_ep error raised in the process that holds that rank names NCCL's reason" + out_of_step;
  }
  return "jax_ep: " + who + " recorded failure code " + Str(code) + out_of_step;
}

Status Group::Allocate(int ordinal, int rank, int num_ranks, int64_t staging_bytes, int64_t scratch_ints,
                       int num_sms, double timeout_s, double first_timeout_s) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  if (num_ranks < 1 || num_ranks > kMaxRanks || rank < 0 || rank >= num_ranks) {
    return Status::InvalidArgument("jax_ep.initialize: an EP group must have 1 to " + Str(kMaxRanks) +
                                   " GPUs and rank in [0, R), got R=" + Str(num_ranks) + ", rank " + Str(rank));
  }
  if (devices_.count(ordinal)) {
    return Status::InvalidArgument("jax_ep.initialize: GPU " + Str(ordinal) + " appears in more than one EP group");
  }
  auto device = std::make_shared<DeviceResources>();
  devices_[ordinal] = device;
  device->ordinal = ordinal;
  device->rank = rank;
  device->num_ranks = num_ranks;
  device->half_bytes = staging_bytes / 2;
  device->scratch_ints = scratch_ints;
  device->timeout_ns = static_cast<uint64_t>(timeout_s * 1e9);
  device->first_timeout_ns = static_cast<uint64_t>(std::max(timeout_s, first_timeout_s) * 1e9);
  cudaError_t status = cudaSetDevice(ordinal);
  if (status != cudaSuccess) return CudaError("cudaSetDevice", ordinal, status);
  const Status prepared = PrepareKernels();
  if (!prepared.ok()) return prepared;
  int device_sms = 0;
  status = cudaDeviceGetAttribute(&device_sms, cudaDevAttrMultiProcessorCount, ordinal);
  if (status != cudaSuccess) return CudaError("cudaDeviceGetAttribute(MultiProcessorCount)", ordinal, status);
  device->num_sms = num_sms > 0 ? std::min(num_sms, device_sms) : DefaultNumSms(device_sms, num_ranks);
  if ((status = cudaMalloc(&device->staging, 2 * device->half_bytes)) != cudaSuccess ||
      (status = cudaMalloc(&device->signals, sizeof(Signals))) != cudaSuccess ||
      (status = cudaMemset(device->signals, 0, sizeof(Signals))) != cudaSuccess ||
      (status = cudaMalloc(&device->peers, sizeof(PeerTable))) != cudaSuccess ||
      (status = cudaMalloc(&device->scratch, scratch_ints * sizeof(int32_t))) != cudaSuccess) {
    return CudaError("allocating the staging memory", ordinal, status);
  }
  if ((status = cudaHostAlloc(&device->status, sizeof(HostStatus), cudaHostAllocMapped | cudaHostAllocPortable)) !=
          cudaSuccess ||
      (status = cudaHostGetDevicePointer(&device->status_on_device, device->status, 0)) != cudaSuccess) {
    return CudaError("allocating the host-mapped status", ordinal, status);
  }
  *device->status = HostStatus{};
  if ((status = cudaDeviceSynchronize()) != cudaSuccess) return CudaError("cudaDeviceSynchronize", ordinal, status);
  return Status::Ok();
}

Status Group::ExportHandles(int ordinal, std::string* handles) const {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  auto it = devices_.find(ordinal);
  if (it == devices_.end()) {
    return Status::Error(StatusCode::kFailedPrecondition, "jax_ep.initialize: GPU " + Str(ordinal) + " was not allocated");
  }
  IpcHandles exported;
  cudaError_t status = cudaSetDevice(ordinal);
  if (status == cudaSuccess) status = cudaIpcGetMemHandle(&exported.staging, it->second->staging);
  if (status == cudaSuccess) status = cudaIpcGetMemHandle(&exported.signals, it->second->signals);
  if (status != cudaSuccess) return CudaError("cudaIpcGetMemHandle", ordinal, status);
  handles->assign(reinterpret_cast<const char*>(&exported), sizeof(exported));
  return Status::Ok();
}

Status Group::CanOpenHandles(int ordinal, const std::string& handles, bool* ok) const {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  *ok = false;
  if (!devices_.count(ordinal)) {
    return Status::Error(StatusCode::kFailedPrecondition, "jax_ep.initialize: GPU " + Str(ordinal) + " was not allocated");
  }
  if (handles.size() != sizeof(IpcHandles)) {
    return Status::InvalidArgument("jax_ep.initialize: IPC handles must be " + Str(sizeof(IpcHandles)) +
                                   " bytes, got " + Str(handles.size()));
  }
  IpcHandles peer;
  handles.copy(reinterpret_cast<char*>(&peer), sizeof(peer));
  cudaError_t status = cudaSetDevice(ordinal);
  if (status != cudaSuccess) return CudaError("cudaSetDevice", ordinal, status);
  void* staging = nullptr;
  void* signals = nullptr;
  cudaError_t opened = cudaIpcOpenMemHandle(&staging, peer.staging, cudaIpcMemLazyEnablePeerAccess);
  if (opened == cudaSuccess) {
    opened = cudaIpcOpenMemHandle(&signals, peer.signals, cudaIpcMemLazyEnablePeerAccess);
    if (opened == cudaSuccess) status = cudaIpcCloseMemHandle(signals);
    const cudaError_t closed = cudaIpcCloseMemHandle(staging);
    if (status == cudaSuccess) status = closed;
  }
  if (opened != cudaSuccess) cudaGetLastError();  // not sticky: the answer is no, not an error
  if (status != cudaSuccess) return CudaError("cudaIpcCloseMemHandle", ordinal, status);
  *ok = opened == cudaSuccess;
  return Status::Ok();
}

Status Group::Connect(int ordinal, const std::vector<RankAddress>& ranks) {
  std::lock_guard<std::mutex> lock(mutex_);
  DeviceGuard guard;
  auto it = devices_.find(ordinal);
  if (it == devices_.end()) {
    return Status::Error(StatusCode::kFailedPrecondition, "jax_ep.initialize: GPU " + Str(ordinal) + " was not allocated");
  }
  DeviceResources& device = *it->second;
  if (static_cast<int>(ranks.size()) != device.num_ranks) {
    return Status::InvalidArgument("jax_ep.initialize: GPU " + Str(ordinal) + " needs the addresses of its " +
                                   Str(device.num_ranks) + " ranks, got " + Str(ranks.size()));
  }
  cudaError_t status = cudaSetDevice(ordinal);
  if (status != cudaSuccess) return CudaError("cudaSetDevice", ordinal, status);
  PeerTable table{};
  device.nccl_ranks = 0;
  for (int rank = 0; rank < device.num_ranks; ++rank) {
    const RankAddress& address = ranks[rank];
    if (address.nccl) {
      if (rank == device.rank) return Status::InvalidArgument("jax_ep.initialize: a GPU cannot reach itself through NCCL");
      device.nccl_ranks |= uint64_t{1} << rank;
      continue;
    }
    if (address.ordinal >= 0) {
      auto peer = devices_.find(address.ordinal);
      if (peer == devices_.end() || peer->second->rank != rank) {
        return Status::InvalidArgument("jax_ep.initialize: rank " + Str(rank) + " of GPU " + Str(ordinal) +
                                       "'s group should be GPU " + Str(address.ordinal) +
                                       " of this process, which was not allocated as that rank");
      }
      if (address.ordinal != ordinal) {
        int can_access = 0;
        cudaDeviceCanAccessPeer(&can_access, ordinal, address.ordinal);
        if (!can_access) {
          return Status::InvalidArgument("jax_ep.initialize: GPU " + Str(ordinal) + " cannot access GPU " +
                                         Str(address.ordinal) + " by P2P, so it must reach it through NCCL");
        }
        status = cudaDeviceEnablePeerAccess(address.ordinal, 0);
        if (status == cudaErrorPeerAccessAlreadyEnabled) {
          cudaGetLastError();
        } else if (status != cudaSuccess) {
          return CudaError("cudaDeviceEnablePeerAccess", ordinal, status);
        }
      }
      table.staging[rank] = peer->second->staging;
      table.signals[rank] = peer->second->signals;
      continue;
    }
    if (address.ipc_handles.size() != sizeof(IpcHandles)) {
      return Status::InvalidArgument("jax_ep.initialize: rank " + Str(rank) + "'s IPC handles must be " +
                                     Str(sizeof(IpcHandles)) + " bytes, got " + Str(address.ipc_handles.size()));
    }
    IpcHandles handles;
    address.ipc_handles.copy(reinterpret_cast<char*>(&handles), sizeof(handles));
    void* staging = nullptr;
    void* signals = nullptr;
    status = cudaIpcOpenMemHandle(&staging, handles.staging, cudaIpcMemLazyEnablePeerAccess);
    if (status == cudaSuccess) device.opened.push_back(staging);
    if (status == cudaSuccess) status = cudaIpcOpenMemHandle(&signals, handles.signals, cudaIpcMemLazyEnablePeerAccess);
    if (status == cudaSuccess) device.opened.push_back(signals);
    if (status != cudaSuccess) {
      return Status::Internal("jax_ep.initialize: GPU " + Str(ordinal) + " could not map the memory of rank " +
                              Str(rank) + " from its process (cudaIpcOpenMemHandle: " + cudaGetErrorString(status) +
                              "); GPUs of one host must reach each other by P2P, or pass transport='nccl'");
    }
    table.staging[rank] = static_cast<char*>(staging);
    table.signals[rank] = static_cast<Signals*>(signals);
  }
  status = cudaMemcpy(device.peers, &table, sizeof(PeerTable), cudaMemcpyHostToDevice);
  if (status == cudaSuccess) status = cudaDeviceSynchronize();
  if (status != cudaSuccess) return CudaError("publishing the peer table", ordinal, status);
  return Status::Ok();
}

Status Group::ConnectNccl(const std::vector<int>& ordinals, const std::vector<std::string>& unique_ids,
                          int64_t timeout_ms, int64_t setup_timeout_ms) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (ordinals.size() != unique_ids.size()) {
    return Status::InvalidArgument("jax_ep.initialize: one NCCL unique id per GPU is needed");
  }
  std::vector<NcclLink::Spec> specs;
  for (size_t i = 0; i < ordinals.size(); ++i) {
    auto it = devices_.find(ordinals[i]);
    if (it == devices_.end()) {
      return Status::Error(StatusCode::kFailedPrecondition,
                           "jax_ep.initialize: GPU " + Str(ordinals[i]) + " was not allocated");
    }
    const DeviceResources& device = *it->second;
    specs.push_back({device.ordinal, device.rank, device.num_ranks, device.nccl_ranks, unique_ids[i],
                     device.half_bytes, device.status,
                     std::chrono::milliseconds(static_cast<int64_t>(device.first_timeout_ns / 1000000))});
  }
  std::vector<std::unique_ptr<NcclLink>> links;
  Status error = NcclLink::Create(specs, std::chrono::milliseconds(timeout_ms), std::chrono::milliseconds(setup_timeout_ms),
                                  &links);
  for (size_t i = 0; i < links.size(); ++i) devices_[ordinals[i]]->nccl = std::move(links[i]);
  if (!error.ok()) return error;
  std::vector<NcclLink*> watched;  // fixed from here until Release, which stops the watchdog before freeing
  for (auto& [ordinal, device] : devices_) {
    if (device->nccl) watched.push_back(device->nccl.get());
  }
  StopWatchdog();
  stop_watchdog_ = false;
  watchdog_ = std::thread([this, watched] {
    while (!stop_watchdog_.load()) {
      for (NcclLink* link : watched) link->Check();
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  });
  return Status::Ok();
}

Group::~Group() { StopWatchdog(); }

void Group::StopWatchdog() {
  stop_watchdog_ = true;
  if (watchdog_.joinable()) watchdog_.join();
}

void Group::Stop() {
  {
    std::unique_lock<std::shared_mutex> launches(launches_mutex_);
    released_ = true;
  }
  std::vector<int> ordinals;
  {
    std::lock_guard<std::mutex> lock(mutex_);  // not held while waiting: Failure() and Find() stay answerable
    for (const auto& [ordinal, device] : devices_) ordinals.push_back(ordinal);
  }
  DeviceGuard guard;
  for (int ordinal : ordinals) {
    cudaSetDevice(ordinal);
    cudaDeviceSynchronize();
  }
}

void Group::ClosePeerMappings() {
  Stop();
  std::lock_guard<std::mutex> lock(mutex_);
  for (auto& [ordinal, device] : devices_) {
    for (void* mapped : device->opened) cudaIpcCloseMemHandle(mapped);
    device->opened.clear();
  }
}

void Group::Release() {
  ClosePeerMappings();
  StopWatchdog();
  std::map<int, std::shared_ptr<DeviceResources>> devices;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    devices.swap(devices_);
  }
}

std::shared_ptr<const DeviceResources> Group::Find(int ordinal) const {
  std::lock_guard<std::mutex> lock(mutex_);
  auto it = devices_.find(ordinal);
  return it == devices_.end() ? nullptr : it->second;
}

int Group::MinSms() const {
  std::lock_guard<std::mutex> lock(mutex_);
  int fewest = 0;
  for (const auto& [ordinal, device] : devices_) {
    if (fewest == 0 || device->num_sms < fewest) fewest = device->num_sms;
  }
  return fewest;
}

std::string Group::Failure() const {
  std::lock_guard<std::mutex> lock(mutex_);
  for (const auto& [ordinal, device] : devices_) {
    std::string failure = device->Failure();
    if (!failure.empty()) return failure;
  }
  return "";
}

std::shared_ptr<Group> AddGroup(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto group = std::make_shared<Group>(id);
  registry[id] = group;
  return group;
}

std::shared_ptr<Group> FindGroup(int64_t id) {
  std::lock_guard<std::mutex> lock(registry_mutex);
  auto it = registry.find(id);
  return it == registry.end() ? nullptr : it->second;
}

void DropGroup(int64_t id) {
  std::shared_ptr<Group> group;
  {
    std::lock_guard<std::mutex> lock(registry_mutex);
    auto it = registry.find(id);
    if (it == registry.end()) return;
    group = std::move(it->second);
    registry.erase(it);
  }
  group->Release();
}

}  // namespace jax_ep
