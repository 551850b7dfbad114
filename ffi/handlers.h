// XLA FFI handlers and state types of jax_ep, exported as C symbols for the nanobind module.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxEpRoutingLayout(XLA_FFI_CallFrame* call_frame);
// Transfers between GPUs: one instantiate handler (state: the resources) shared by three execute handlers.
XLA_FFI_Error* JaxEpTransportInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpExchangeExecute(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpTokensToRowsExecute(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpRowsToTokensExecute(XLA_FFI_CallFrame* call_frame);
XLA_FFI_TypeId* JaxEpTransportStateTypeId();
const XLA_FFI_TypeInfo* JaxEpTransportStateTypeInfo();
}
