// The Python extension jax_ep.ep._jax_ep_cuda: the FFI targets (handler capsules, from kTargets, and their traits),
// the state type, the kernels' limits and memory sizes, the groups' set-up steps, and facts about CUDA and NCCL.
// Library errors (Status) become Python exceptions here.
#include <cuda_runtime.h>
#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>
#include <nccl.h>

#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "../runtime/group.h"
#include "handlers.h"

namespace nb = nanobind;

namespace {

nb::capsule Capsule(void* pointer) { return nb::capsule(pointer); }

// The traits a handler declares, asked as XLA asks: a call frame that carries only the metadata extension.
XLA_FFI_Handler_Traits TraitsOf(XLA_FFI_Handler* handler) {
  XLA_FFI_Metadata metadata{};
  metadata.struct_size = XLA_FFI_Metadata_STRUCT_SIZE;
  XLA_FFI_Metadata_Extension extension{};
  extension.extension_base.struct_size = XLA_FFI_Metadata_Extension_STRUCT_SIZE;
  extension.extension_base.type = XLA_FFI_Extension_Metadata;
  extension.metadata = &metadata;
  XLA_FFI_CallFrame frame{};
  frame.struct_size = XLA_FFI_CallFrame_STRUCT_SIZE;
  frame.extension_start = &extension.extension_base;
  if (handler(&frame) != nullptr) throw std::runtime_error("jax_ep: a handler refused the metadata query");
  return metadata.traits;
}

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

}  // namespace

NB_MODULE(_jax_ep_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    for (const jax_ep::Target& target : jax_ep::kTargets) {
      for (const bool uncaptured : {false, true}) {
        nb::dict stages;
        stages["instantiate"] = Capsule(reinterpret_cast<void*>(JaxEpInstantiate));
        stages["execute"] = Capsule(reinterpret_cast<void*>(uncaptured ? target.execute_uncaptured : target.execute));
        targets[(std::string(target.name) + (uncaptured ? jax_ep::kUncaptured : "")).c_str()] = stages;
      }
    }
    return targets;
  });
  // Each registered target name: whether its handler lets XLA capture it in command buffers (its metadata).
  m.def("command_buffer_compatible", []() {
    nb::dict compatible;
    for (const jax_ep::Target& target : jax_ep::kTargets) {
      for (const bool uncaptured : {false, true}) {
        const XLA_FFI_Handler_Traits traits = TraitsOf(uncaptured ? target.execute_uncaptured : target.execute);
        compatible[(std::string(target.name) + (uncaptured ? jax_ep::kUncaptured : "")).c_str()] =
            (traits & XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE) != 0;
      }
    }
    return compatible;
  });
  m.def("type_registrations", []() {
    nb::dict types;
    nb::dict state;
    state["type_id"] = Capsule(reinterpret_cast<void*>(JaxEpGroupStateTypeId()));
    state["type_info"] = Capsule(const_cast<void*>(static_cast<const void*>(JaxEpGroupStateTypeInfo())));
    types["jax_ep_group_state"] = state;
    return types;
  });
  m.def("limits", []() {
    nb::dict limits;
    limits["max_topk"] = jax_ep::kMaxTopk;
    limits["max_experts"] = jax_ep::kMaxExperts;
    return limits;
  });
  m.def("device_bytes", &jax_ep::DeviceBytes, nb::arg("num_ranks"), nb::arg("num_tokens"), nb::arg("row_bytes"),
        nb::arg("topk"), nb::arg("num_experts"), nb::arg("nccl"));
  m.def("staging_bytes", &jax_ep::StagingBytes, nb::arg("num_ranks"), nb::arg("num_tokens"), nb::arg("row_bytes"),
        nb::arg("topk"), nb::arg("local_experts"));
  m.def(
      "routing_scratch_ints",
      [](int64_t num_ranks, int64_t num_tokens, int64_t topk, int64_t num_experts) {
        return jax_ep::RoutingScratch(num_tokens, topk, num_experts, num_ranks).ints;
      },
      nb::arg("num_ranks"), nb::arg("num_tokens"), nb::arg("topk"), nb::arg("num_experts"));
  // jax_ep.initialize, step by step (jax_ep/ep/group.py swaps IPC handles between processes in between).
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
        std::shared_ptr<jax_ep::Group> group = jax_ep::FindGroup(id);
        nb::gil_scoped_release release;  // waits for launches under way and the GPUs' queued kernels
        if (group) group->ClosePeerMappings();
      },
      nb::arg("group"));
  m.def(
      "release",
      [](int64_t id) {
        nb::gil_scoped_release release;  // as close_peer_mappings
        jax_ep::DropGroup(id);
      },
      nb::arg("group"));
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
