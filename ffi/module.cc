// The Python extension jax_ep._jax_ep_cuda: FFI handler capsules and NCCL facts.
#include <nanobind/nanobind.h>
#include <nccl.h>

#include "handlers.h"

namespace nb = nanobind;

NB_MODULE(_jax_ep_cuda, m) {
  m.def("registrations", []() {
    nb::dict targets;
    targets["jax_ep_routing_layout"] = nb::capsule(reinterpret_cast<void*>(JaxEpRoutingLayout));
    return targets;
  });
  m.def("nccl_version", []() {
    int version = 0;
    if (ncclGetVersion(&version) != ncclSuccess) throw std::runtime_error("jax_ep: ncclGetVersion failed");
    return version;
  });
}
