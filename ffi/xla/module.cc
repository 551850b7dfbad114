// The Python extension jax_ep._jax_ep_cuda: FFI handler capsules, the state type, the groups' set-up steps, and
// facts about CUDA and NCCL. Library errors (Status) become Python exceptions here.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nccl.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "../runtime/group.h"
#include "handlers.h"

namespace nb = nanobind;

namespace {

nb::capsule Capsule(void* pointer) { return nb::capsule(pointer); }

void ThrowIfError(const jax_ep::Status& status) {
  if (status.ok()) return;
  if (status.code == jax_ep::StatusCode::kInvalidArgument) throw nb::value_error(status.message.c_str());
  throw std::runtime_error(status.message);
}

std::shared_ptr<jax_ep::Group> Group(int64_t id) {
  std::shared_ptr<jax_ep::Group> group = jax_ep::FindGroup(id);
  if (!group) throw std::runtime_error("jax_ep: no group with id " + std::to_string(id));
  return group;
}

void Check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string("jax_ep timing: ") + what + ": " +
                                                      cudaGetErrorString(status));
}

// What a timing helper made (device memory, a stream, events) and the device it found current: released and
// restored on every path out, a thrown error included.
struct TimingScratch {
  int saved_device = 0;
  std::vector<std::pair<int, void*>> buffers;  // (device, pointer)
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  TimingScratch() { cudaGetDevice(&saved_device); }
  ~TimingScratch() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    for (const auto& [device, pointer] : buffers) {
      cudaSetDevice(device);
      cudaFree(pointer);
    }
    cudaSetDevice(saved_device);
  }
  void* Allocate(int device, size_t bytes) {
    void* pointer = nullptr;
    Check(cudaSetDevice(device), "cudaSetDevice");
    Check(cudaMalloc(&pointer, bytes), "cudaMalloc");
    buffers.emplace_back(device, pointer);
    return pointer;
  }
};

// Seconds per call of enqueue(stream) on the current device: 3 warm-up calls, then the mean of `iters` between
// two CUDA events.
template <typename Enqueue>
double SecondsPer(TimingScratch& scratch, int iters, Enqueue enqueue) {
  if (iters < 1) throw nb::value_error("jax_ep timing: iters must be at least 1");
  Check(cudaStreamCreate(&scratch.stream), "cudaStreamCreate");
  Check(cudaEventCreate(&scratch.start), "cudaEventCreate");
  Check(cudaEventCreate(&scratch.stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) enqueue(scratch.stream);
  Check(cudaEventRecord(scratch.start, scratch.stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) enqueue(scratch.stream);
  Check(cudaEventRecord(scratch.stop, scratch.stream), "cudaEventRecord");
  Check(cudaEventSynchronize(scratch.stop), "cudaEventSynchronize");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, scratch.start, scratch.stop), "cudaEventElapsedTime");
  return ms / 1e3 / iters;
}

// Fills device memory with pseudo-random bytes (a 64 MiB block, repeated), so that nothing in the memory system
// could make a copy of it cheaper than a copy of real data.
void FillRandom(void* device_pointer, size_t bytes) {
  std::vector<uint64_t> block(std::min<size_t>(bytes, size_t{64} << 20) / 8 + 1);
  std::mt19937_64 random(12345);
  for (uint64_t& word : block) word = random();
  char* to = static_cast<char*>(device_pointer);
  for (size_t at = 0; at < bytes; at += block.size() * 8) {
    Check(cudaMemcpy(to + at, block.data(), std::min(block.size() * 8, bytes - at), cudaMemcpyHostToDevice),
          "cudaMemcpy");
  }
}

// Seconds per cudaMemcpyPeerAsync of `bytes` from GPU src to GPU dst: the yardstick the benchmarks compare the
// exchange with.
double PeerCopySeconds(int src, int dst, size_t bytes, int iters) {
  TimingScratch scratch;
  void* to = scratch.Allocate(dst, bytes);
  void* from = scratch.Allocate(src, bytes);
  FillRandom(from, bytes);
  cudaDeviceEnablePeerAccess(dst, 0);
  cudaGetLastError();  // already enabled, or the same GPU: not an error here
  return SecondsPer(scratch, iters, [&](cudaStream_t stream) {
    Check(cudaMemcpyPeerAsync(to, dst, from, src, bytes, stream), "cudaMemcpyPeerAsync");
  });
}

// Seconds per cudaMemsetAsync of `bytes` on GPU `device`: writes only, the ceiling of an op that mostly writes.
double FillSeconds(int device, size_t bytes, int iters) {
  TimingScratch scratch;
  void* to = scratch.Allocate(device, bytes);
  int value = 0;
  return SecondsPer(scratch, iters, [&](cudaStream_t stream) {
    Check(cudaMemsetAsync(to, 0x40 + (value++ & 0x1f), bytes, stream), "cudaMemsetAsync");
  });
}

}  // namespace

NB_MODULE(_jax_ep_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    const std::pair<const char*, void*> calls[] = {
        {"jax_ep_dispatch", reinterpret_cast<void*>(JaxEpDispatch)},
        {"jax_ep_dispatch_start", reinterpret_cast<void*>(JaxEpDispatchStart)},
        {"jax_ep_dispatch_finish", reinterpret_cast<void*>(JaxEpDispatchFinish)},
        {"jax_ep_combine_backward", reinterpret_cast<void*>(JaxEpCombineBackward)},
        {"jax_ep_combine_backward_start", reinterpret_cast<void*>(JaxEpCombineBackwardStart)},
        {"jax_ep_combine_backward_finish", reinterpret_cast<void*>(JaxEpCombineBackwardFinish)},
        {"jax_ep_combine", reinterpret_cast<void*>(JaxEpCombine)},
        {"jax_ep_combine_start", reinterpret_cast<void*>(JaxEpCombineStart)},
        {"jax_ep_combine_finish", reinterpret_cast<void*>(JaxEpCombineFinish)},
    };
    for (const auto& [name, execute] : calls) {
      nb::dict stages;
      stages["instantiate"] = Capsule(reinterpret_cast<void*>(JaxEpInstantiate));
      stages["execute"] = Capsule(execute);
      targets[name] = stages;
    }
    return targets;
  });
  m.def("type_registrations", []() {
    nb::dict types;
    nb::dict state;
    state["type_id"] = Capsule(reinterpret_cast<void*>(JaxEpGroupStateTypeId()));
    state["type_info"] = Capsule(const_cast<void*>(static_cast<const void*>(JaxEpGroupStateTypeInfo())));
    types["jax_ep_group_state"] = state;
    return types;
  });
  m.def(
      "routing_scratch_ints",
      [](int64_t num_ranks, int64_t num_tokens, int64_t topk, int64_t num_experts) {
        return jax_ep::RoutingScratch(num_tokens, topk, num_experts, num_ranks).ints;
      },
      nb::arg("num_ranks"), nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"));
  // jax_ep.initialize, step by step (jax_ep/_group.py swaps IPC handles between processes in between).
  m.def("begin", [](int64_t id) { jax_ep::AddGroup(id); }, nb::arg("group"));
  m.def(
      "allocate",
      [](int64_t id, int ordinal, int rank, int num_ranks, int64_t staging_bytes, int64_t scratch_ints, int num_sms,
         double timeout_s, double first_timeout_s) {
        ThrowIfError(Group(id)->Allocate(ordinal, rank, num_ranks, staging_bytes, scratch_ints, num_sms, timeout_s,
                                         first_timeout_s));
      },
      nb::arg("group"), nb::arg("ordinal"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("staging_bytes"),
      nb::arg("scratch_ints"), nb::arg("num_sms"), nb::arg("timeout_s"),
      nb::arg("first_timeout_s"));
  m.def(
      "export_handles",
      [](int64_t id, int ordinal) {
        std::string handles;
        ThrowIfError(Group(id)->ExportHandles(ordinal, &handles));
        return nb::bytes(handles.data(), handles.size());
      },
      nb::arg("group"), nb::arg("ordinal"));
  m.def(
      "can_open_handles",
      [](int64_t id, int ordinal, const nb::bytes& handles) {
        bool ok = false;
        ThrowIfError(Group(id)->CanOpenHandles(ordinal, std::string(handles.c_str(), handles.size()), &ok));
        return ok;
      },
      nb::arg("group"), nb::arg("ordinal"), nb::arg("handles"));
  m.def(
      "connect",
      [](int64_t id, int ordinal, const std::vector<int>& ordinals, const std::vector<nb::bytes>& handles,
         const std::vector<bool>& by_nccl) {
        std::vector<jax_ep::RankAddress> ranks(ordinals.size());
        for (size_t r = 0; r < ranks.size(); ++r) {
          ranks[r].ordinal = ordinals[r];
          if (r < handles.size()) ranks[r].ipc_handles.assign(handles[r].c_str(), handles[r].size());
          ranks[r].nccl = r < by_nccl.size() && by_nccl[r];
        }
        ThrowIfError(Group(id)->Connect(ordinal, ranks));
      },
      nb::arg("group"), nb::arg("ordinal"), nb::arg("ordinals"), nb::arg("handles"), nb::arg("by_nccl"));
  m.def("nccl_unique_id", []() {
    ncclUniqueId id;
    const ncclResult_t result = ncclGetUniqueId(&id);
    if (result != ncclSuccess) {
      throw std::runtime_error(std::string("jax_ep.initialize: ncclGetUniqueId failed: ") +
                               ncclGetErrorString(result));
    }
    return nb::bytes(id.internal, sizeof(id.internal));
  });
  m.def(
      "connect_nccl",
      [](int64_t id, const std::vector<int>& ordinals, const std::vector<nb::bytes>& unique_ids, int64_t timeout_ms,
         int64_t setup_timeout_ms) {
        std::vector<std::string> ids;
        for (const nb::bytes& unique_id : unique_ids) ids.emplace_back(unique_id.c_str(), unique_id.size());
        std::shared_ptr<jax_ep::Group> group = Group(id);
        nb::gil_scoped_release release;  // ncclCommInitRank waits for the other processes
        ThrowIfError(group->ConnectNccl(ordinals, ids, timeout_ms, setup_timeout_ms));
      },
      nb::arg("group"), nb::arg("ordinals"), nb::arg("unique_ids"), nb::arg("timeout_ms"),
      nb::arg("setup_timeout_ms"));
  m.def(
      "can_access_peer",
      [](int ordinal, int peer) {
        int can_access = 0;
        if (cudaDeviceCanAccessPeer(&can_access, ordinal, peer) != cudaSuccess) cudaGetLastError();
        return can_access != 0;
      },
      nb::arg("ordinal"), nb::arg("peer"));
  m.def("default_num_sms", &jax_ep::DefaultNumSms, nb::arg("device_sms"), nb::arg("num_ranks"));
  m.def(
      "commit",
      [](int64_t id) {
        std::shared_ptr<jax_ep::Group> group = Group(id);
        group->Commit();
        return group->MinSms();
      },
      nb::arg("group"));
  m.def(
      "close_peer_mappings",
      [](int64_t id) {
        if (std::shared_ptr<jax_ep::Group> group = jax_ep::FindGroup(id)) group->ClosePeerMappings();
      },
      nb::arg("group"));
  m.def("release", &jax_ep::DropGroup, nb::arg("group"));
  m.def(
      "group_error",
      [](int64_t id) {
        std::shared_ptr<jax_ep::Group> group = jax_ep::FindGroup(id);
        return group ? group->Failure() : std::string();
      },
      nb::arg("group"));
  m.def(
      "group_launches",
      [](int64_t id) {
        std::shared_ptr<jax_ep::Group> group = jax_ep::FindGroup(id);
        return group ? group->launches() : int64_t{0};
      },
      nb::arg("group"));
  m.def("peer_copy_seconds", &PeerCopySeconds, nb::arg("src"), nb::arg("dst"), nb::arg("bytes"), nb::arg("iters"));
  m.def("fill_seconds", &FillSeconds, nb::arg("device"), nb::arg("bytes"), nb::arg("iters"));
  m.def("cuda_versions", []() {
    int runtime = 0, driver = 0;
    if (cudaRuntimeGetVersion(&runtime) != cudaSuccess || cudaDriverGetVersion(&driver) != cudaSuccess) {
      throw std::runtime_error("jax_ep: cudaRuntimeGetVersion/cudaDriverGetVersion failed");
    }
    return std::vector<int>{runtime, driver};
  });
  m.def("nccl_version", []() {
    int version = 0;
    if (ncclGetVersion(&version) != ncclSuccess) throw std::runtime_error("jax_ep: ncclGetVersion failed");
    return version;
  });
}
