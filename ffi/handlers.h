// XLA FFI handlers and state types of jax_ep, exported as C symbols for the nanobind module.
#pragma once

#include "xla/ffi/api/c_api.h"

extern "C" {
XLA_FFI_Error* JaxEpRoutingLayout(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpExchangeInstantiate(XLA_FFI_CallFrame* call_frame);
XLA_FFI_Error* JaxEpExchangeExecute(XLA_FFI_CallFrame* call_frame);
XLA_FFI_TypeId* JaxEpExchangeStateTypeId();
const XLA_FFI_TypeInfo* JaxEpExchangeStateTypeInfo();
}
