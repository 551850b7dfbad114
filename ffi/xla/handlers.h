// XLA FFI handlers and the state type of jax_ep, exported as C symbols for the nanobind module.
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
