// The Python extension jax_ep._jax_ep_cuda: FFI handler capsules, state types, resources and NCCL facts.
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "handlers.h"
#include "resources.h"

namespace nb = nanobind;

namespace {

nb::capsule Capsule(void* pointer) { return nb::capsule(pointer); }

void ThrowIfError(const std::string& error) {
  if (!error.empty()) throw std::runtime_error(error);
}

std::shared_ptr<jax_ep::Resources> Pending() {
  std::shared_ptr<jax_ep::Resources> pending = jax_ep::PendingResources();
  if (!pending) throw std::runtime_error("jax_ep: initialize steps out of order (no begin)");
  return pending;
}

void Check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string("jax_ep.peer_copy_seconds: ") + what + ": " +
                                                      cudaGetErrorString(status));
}

// Seconds per cudaMemcpyPeerAsync of `bytes` from GPU src to GPU dst (mean of `iters` after a warm-up, by CUDA events):
// the yardstick the benchmarks compare the exchange with.
double PeerCopySeconds(int src, int dst, size_t bytes, int iters) {
  int saved = 0;
  cudaGetDevice(&saved);
  void *from = nullptr, *to = nullptr;
  Check(cudaSetDevice(dst), "cudaSetDevice");
  Check(cudaMalloc(&to, bytes), "cudaMalloc");
  Check(cudaSetDevice(src), "cudaSetDevice");
  Check(cudaMalloc(&from, bytes), "cudaMalloc");
  Check(cudaMemset(from, 0x5a, bytes), "cudaMemset");
  cudaDeviceEnablePeerAccess(dst, 0);
  cudaGetLastError();
  cudaStream_t stream;
  cudaEvent_t start, stop;
  Check(cudaStreamCreate(&stream), "cudaStreamCreate");
  Check(cudaEventCreate(&start), "cudaEventCreate");
  Check(cudaEventCreate(&stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) Check(cudaMemcpyPeerAsync(to, dst, from, src, bytes, stream), "cudaMemcpyPeerAsync");
  Check(cudaEventRecord(start, stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) Check(cudaMemcpyPeerAsync(to, dst, from, src, bytes, stream), "cudaMemcpyPeerAsync");
  Check(cudaEventRecord(stop, stream), "cudaEventRecord");
  Check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float ms = 0;
  cudaEventElapsedTime(&ms, start, stop);
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  cudaStreamDestroy(stream);
  cudaFree(from);
  cudaSetDevice(dst);
  cudaFree(to);
  cudaSetDevice(saved);
  return ms / 1e3 / iters;
}

}  // namespace

NB_MODULE(_jax_ep_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_ep_routing_layout"] = Capsule(reinterpret_cast<void*>(JaxEpRoutingLayout));
    const std::pair<const char*, void*> transfers[] = {
        {"jax_ep_exchange", reinterpret_cast<void*>(JaxEpExchangeExecute)},
        {"jax_ep_tokens_to_rows", reinterpret_cast<void*>(JaxEpTokensToRowsExecute)},
        {"jax_ep_rows_to_tokens", reinterpret_cast<void*>(JaxEpRowsToTokensExecute)},
    };
    for (const auto& [name, execute] : transfers) {
      nb::dict stages;
      stages["instantiate"] = Capsule(reinterpret_cast<void*>(JaxEpTransportInstantiate));
      stages["execute"] = Capsule(execute);
      targets[name] = stages;
    }
    return targets;
  });
  m.def("type_registrations", []() {
    nb::dict types;
    nb::dict state;
    state["type_id"] = Capsule(reinterpret_cast<void*>(JaxEpTransportStateTypeId()));
    state["type_info"] = Capsule(const_cast<void*>(static_cast<const void*>(JaxEpTransportStateTypeInfo())));
    types["jax_ep_transport_state"] = state;
    return types;
  });
  // jax_ep.initialize, step by step (jax_ep/_cuda.py swaps IPC handles between processes in between).
  m.def("begin", []() { jax_ep::BeginResources(); });
  m.def(
      "allocate",
      [](int ordinal, int rank, int num_ranks, size_t capacity_bytes, int num_sms) {
        ThrowIfError(Pending()->Allocate(ordinal, rank, num_ranks, capacity_bytes, num_sms));
      },
      nb::arg("ordinal"), nb::arg("rank"), nb::arg("num_ranks"), nb::arg("capacity_bytes"), nb::arg("num_sms"));
  m.def(
      "export_handles",
      [](int ordinal) {
        std::string handles;
        ThrowIfError(Pending()->ExportHandles(ordinal, &handles));
        return nb::bytes(handles.data(), handles.size());
      },
      nb::arg("ordinal"));
  m.def(
      "connect",
      [](int ordinal, const std::vector<int>& ordinals, const std::vector<nb::bytes>& handles,
         const std::vector<bool>& by_nccl) {
        std::vector<jax_ep::RankAddress> ranks(ordinals.size());
        for (size_t r = 0; r < ranks.size(); ++r) {
          ranks[r].ordinal = ordinals[r];
          if (r < handles.size()) ranks[r].ipc_handles.assign(handles[r].c_str(), handles[r].size());
          ranks[r].nccl = r < by_nccl.size() && by_nccl[r];
        }
        ThrowIfError(Pending()->Connect(ordinal, ranks));
      },
      nb::arg("ordinal"), nb::arg("ordinals"), nb::arg("handles"), nb::arg("by_nccl"));
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
      [](const std::vector<int>& ordinals, const std::vector<nb::bytes>& unique_ids, int64_t timeout_ms) {
        std::vector<std::string> ids;
        for (const nb::bytes& id : unique_ids) ids.emplace_back(id.c_str(), id.size());
        nb::gil_scoped_release release;  // ncclCommInitRank waits for the other processes
        ThrowIfError(Pending()->ConnectNccl(ordinals, ids, timeout_ms));
      },
      nb::arg("ordinals"), nb::arg("unique_ids"), nb::arg("timeout_ms"));
  m.def(
      "can_access_peer",
      [](int ordinal, int peer) {
        int can_access = 0;
        if (cudaDeviceCanAccessPeer(&can_access, ordinal, peer) != cudaSuccess) cudaGetLastError();
        return can_access != 0;
      },
      nb::arg("ordinal"), nb::arg("peer"));
  m.def("commit", []() {
    const int sms = Pending()->MinSms();
    jax_ep::CommitResources();
    return sms;
  });
  m.def("close_peer_mappings", &jax_ep::CloseCurrentPeerMappings);
  m.def("finalize", &jax_ep::ReleaseResources);
  m.def("peer_copy_seconds", &PeerCopySeconds, nb::arg("src"), nb::arg("dst"), nb::arg("bytes"), nb::arg("iters"));
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
