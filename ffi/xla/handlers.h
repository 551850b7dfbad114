// XLA FFI handlers and the state type of jax_ep, exported as C symbols for the nanobind module, and the table of
// the FFI targets they serve.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
// One instantiate handler (state: the group the executable was compiled for) for every execute handler.
XLA_FFI_Error* JaxEpInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpDispatch(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpDispatchStart(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpDispatchFinish(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineBackward(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineBackwardStart(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineBackwardFinish(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombine(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineStart(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpCombineFinish(XLA_FFI_CallFrame* call_frame);
XLA_FFI_TypeId* JaxEpGroupStateTypeId();
const XLA_FFI_TypeInfo* JaxEpGroupStateTypeInfo();
}

namespace jax_ep {

constexpr int kMaxResults = 11;

// An FFI target: the name jax.ffi.ffi_call calls (and the op its errors name), its execute handler, and its
// results' names in XLA's order (the rest null). The handlers find their results by these names, and
// jax_ep/ep/backends/cuda.py orders the result types it builds by name from them (the module's results()).
struct Target {
  const char* name;
  XLA_FFI_Handler* execute;
  const char* results[kMaxResults];
};

// Results: x [N, H] (the layout's rows), weights [N], group_sizes [L], num_dropped and num_invalid (scalars),
// token_dest_pos [T, R], send_counts [R], slot_dest [T, K], recv_rows [R, T, K], recv_counts [R], row_slot [N];
// sent [1] (a start's output, written 0, which orders its finish after it); dy [N, H], dweights [N] ([0] without
// weights); out [T, H], slot_values [T, K] ([0] without row_values).
inline constexpr Target kTargets[] = {
    {"jax_ep_dispatch",
     JaxEpDispatch,
     {"x", "weights", "group_sizes", "num_dropped", "num_invalid", "token_dest_pos", "send_counts", "slot_dest",
      "recv_rows", "recv_counts", "row_slot"}},
    {"jax_ep_dispatch_start", JaxEpDispatchStart, {"token_dest_pos", "slot_dest", "sent"}},
    {"jax_ep_dispatch_finish",
     JaxEpDispatchFinish,
     {"x", "weights", "group_sizes", "num_dropped", "num_invalid", "send_counts", "recv_rows", "recv_counts",
      "row_slot"}},
    {"jax_ep_combine_backward", JaxEpCombineBackward, {"dy", "dweights"}},
    {"jax_ep_combine_backward_start", JaxEpCombineBackwardStart, {"sent"}},
    {"jax_ep_combine_backward_finish", JaxEpCombineBackwardFinish, {"dy", "dweights"}},
    {"jax_ep_combine", JaxEpCombine, {"out", "slot_values"}},
    {"jax_ep_combine_start", JaxEpCombineStart, {"sent"}},
    {"jax_ep_combine_finish", JaxEpCombineFinish, {"out", "slot_values"}},
};

}  // namespace jax_ep
