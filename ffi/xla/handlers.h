// XLA FFI handlers and the state type of jax_ep, exported as C symbols for the nanobind module, and the table of
// the FFI targets they serve.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
// One instantiate handler (state: the group the call was traced for, and the call's origin) for every execute
// handler. Each execute handler twice: command-buffer compatible, and (Uncaptured, for groups that reach a rank
// through NCCL, whose swaps XLA must not capture) not.
XLA_FFI_Error* JaxEpInstantiate(XLA_FFI_CallFrame* call_frame);
#define JAX_EP_DECLARE_TARGET(name)                       \
  XLA_FFI_Error* name(XLA_FFI_CallFrame* call_frame); \
  XLA_FFI_Error* name##Uncaptured(XLA_FFI_CallFrame* call_frame)
JAX_EP_DECLARE_TARGET(JaxEpDispatch);
JAX_EP_DECLARE_TARGET(JaxEpDispatchStart);
JAX_EP_DECLARE_TARGET(JaxEpDispatchFinish);
JAX_EP_DECLARE_TARGET(JaxEpCombineBackward);
JAX_EP_DECLARE_TARGET(JaxEpCombineBackwardStart);
JAX_EP_DECLARE_TARGET(JaxEpCombineBackwardFinish);
JAX_EP_DECLARE_TARGET(JaxEpCombine);
JAX_EP_DECLARE_TARGET(JaxEpCombineStart);
JAX_EP_DECLARE_TARGET(JaxEpCombineFinish);
#undef JAX_EP_DECLARE_TARGET
XLA_FFI_TypeId* JaxEpGroupStateTypeId();
const XLA_FFI_TypeInfo* JaxEpGroupStateTypeInfo();
}

namespace jax_ep {

// An FFI target: the name jax.ffi.ffi_call calls (jax_ep/ep/cuda.py specifies its operands and results),
// and its execute handlers: the second is registered as the name + kUncaptured.
struct Target {
  const char* name;
  XLA_FFI_Handler* execute;
  XLA_FFI_Handler* execute_uncaptured;
};
inline constexpr const char* kUncaptured = "_uncaptured";

inline constexpr Target kTargets[] = {
    {"jax_ep_dispatch", JaxEpDispatch, JaxEpDispatchUncaptured},
    {"jax_ep_dispatch_start", JaxEpDispatchStart, JaxEpDispatchStartUncaptured},
    {"jax_ep_dispatch_finish", JaxEpDispatchFinish, JaxEpDispatchFinishUncaptured},
    {"jax_ep_combine_backward", JaxEpCombineBackward, JaxEpCombineBackwardUncaptured},
    {"jax_ep_combine_backward_start", JaxEpCombineBackwardStart, JaxEpCombineBackwardStartUncaptured},
    {"jax_ep_combine_backward_finish", JaxEpCombineBackwardFinish, JaxEpCombineBackwardFinishUncaptured},
    {"jax_ep_combine", JaxEpCombine, JaxEpCombineUncaptured},
    {"jax_ep_combine_start", JaxEpCombineStart, JaxEpCombineStartUncaptured},
    {"jax_ep_combine_finish", JaxEpCombineFinish, JaxEpCombineFinishUncaptured},
};

}  // namespace jax_ep
