// FFI handlers of the exchange: instantiate captures the resources, execute checks buffers and launches.
#include <memory>
#include <string>

#include "handlers.h"
#include "resources.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Aliases keep commas out of the handler-definition macro.
using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32VectorResult = ffi::ResultBuffer<ffi::S32, 1>;

namespace jax_ep {

// Per-executable state: the resources that existed when the executable was instantiated.
struct ExchangeState {
  static ffi::TypeId id;
  std::shared_ptr<Resources> resources;
};
ffi::TypeId ExchangeState::id = {};

namespace {

ffi::ErrorOr<std::unique_ptr<ExchangeState>> ExchangeInstantiate() {
  std::shared_ptr<Resources> resources = CurrentResources();
  if (!resources) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_ep_exchange: backend='cuda' needs jax_ep.initialize(mesh, axis_name, "
                                      "...) before the computation is compiled"));
  }
  return std::make_unique<ExchangeState>(ExchangeState{std::move(resources)});
}

ffi::Error ExchangeExecute(cudaStream_t stream, int32_t ordinal, ExchangeState* state, int64_t timeout_cycles,
                           ffi::AnyBuffer send, I32Vector send_counts, ffi::Result<ffi::AnyBuffer> recv,
                           I32VectorResult recv_counts) {
  const DeviceResources* device = state->resources->Find(ordinal);
  if (device == nullptr) {
    return ffi::Error(ffi::ErrorCode::kFailedPrecondition, "jax_ep_exchange: GPU " + std::to_string(ordinal) +
                                          " has no jax_ep resources (not in the mesh given to jax_ep.initialize, "
                                          "or jax_ep.finalize was called since this computation was compiled)");
  }
  const auto dims = send.dimensions();
  if (dims.size() < 2 || dims[0] != device->num_ranks) {
    return ffi::Error::InvalidArgument("jax_ep_exchange: send must have shape [R=" +
                                       std::to_string(device->num_ranks) + ", rows, ...], got rank " +
                                       std::to_string(dims.size()) + " with leading dimension " +
                                       std::to_string(dims.size() == 0 ? 0 : dims[0]));
  }
  if (send_counts.element_count() != static_cast<size_t>(device->num_ranks) ||
      recv_counts->element_count() != static_cast<size_t>(device->num_ranks)) {
    return ffi::Error::InvalidArgument("jax_ep_exchange: send_counts and recv_counts must have " +
                                       std::to_string(device->num_ranks) + " elements");
  }
  if (recv->size_bytes() != send.size_bytes()) {
    return ffi::Error::InvalidArgument("jax_ep_exchange: recv must have the size of send");
  }
  const int64_t rows = dims[1];
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(send.size_bytes()) / (device->num_ranks * rows);
  if (send.size_bytes() > device->capacity_bytes) {
    return ffi::Error(ffi::ErrorCode::kResourceExhausted, 
        "jax_ep_exchange: this call exchanges " + std::to_string(send.size_bytes()) +
        " bytes per GPU but jax_ep.initialize reserved " + std::to_string(device->capacity_bytes) +
        "; initialize with larger sizes (see jax_ep.buffer_size_hint)");
  }
  const cudaError_t status = LaunchExchange(
      static_cast<const char*>(send.untyped_data()), send_counts.typed_data(),
      static_cast<char*>(recv->untyped_data()), recv_counts->typed_data(), rows, row_bytes, device->rank,
      device->num_ranks, device->recv_buffer, device->signals, device->peers, timeout_cycles, stream);
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_ep_exchange: kernel launch failed: ") + cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpExchangeInstantiate, jax_ep::ExchangeInstantiate,
                              ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpExchangeExecute, jax_ep::ExchangeExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<jax_ep::ExchangeState>>()
                                  .Attr<int64_t>("timeout_cycles")  // give up waiting for peers after this
                                  .Arg<ffi::AnyBuffer>()            // send [R, rows, ...]
                                  .Arg<I32Vector>()                 // send_counts [R]
                                  .Ret<ffi::AnyBuffer>()            // recv [R, rows, ...]
                                  .Ret<I32Vector>());               // recv_counts [R]

extern "C" XLA_FFI_TypeId* JaxEpExchangeStateTypeId() { return &jax_ep::ExchangeState::id; }

extern "C" const XLA_FFI_TypeInfo* JaxEpExchangeStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<jax_ep::ExchangeState>();
  return &info;
}
