// FFI handlers of the transfers between GPUs: instantiate captures the resources, execute checks
// buffers, finds this GPU's group by device ordinal and launches. They never throw: errors come back
// as ffi::Error naming the op, the argument, and the expected and actual values.
#include <memory>
#include <string>

#include "handlers.h"
#include "kernels.h"
#include "resources.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Aliases keep commas out of the handler-definition macro.
using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using I32Cube = ffi::Buffer<ffi::S32, 3>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using I32VectorResult = ffi::ResultBuffer<ffi::S32, 1>;

namespace jax_ep {

// Per-executable state: the resources that existed when the executable was instantiated.
struct TransportState {
  static ffi::TypeId id;
  std::shared_ptr<Resources> resources;
};
ffi::TypeId TransportState::id = {};

namespace {

std::string Str(int64_t value) { return std::to_string(value); }

ffi::ErrorOr<std::unique_ptr<TransportState>> TransportInstantiate() {
  std::shared_ptr<Resources> resources = CurrentResources();
  if (!resources) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_ep: backend='cuda' needs jax_ep.initialize(mesh, axis_name, ...) before "
                                      "the computation is compiled"));
  }
  return std::make_unique<TransportState>(TransportState{std::move(resources)});
}

// This GPU's group, after checking that `bytes` fit in its receive buffer.
ffi::ErrorOr<GroupView> FindGroup(const char* op, int32_t ordinal, const TransportState* state, size_t bytes,
                                  int64_t timeout_cycles) {
  const DeviceResources* device = state->resources->Find(ordinal);
  if (device == nullptr) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kFailedPrecondition,
        std::string(op) + ": GPU " + Str(ordinal) +
            " has no jax_ep resources (not in the mesh given to jax_ep.initialize, or jax_ep.finalize was called "
            "since this computation was compiled)"));
  }
  const int32_t missing = *reinterpret_cast<volatile const int32_t*>(device->missing_peer);
  if (missing < 0) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kDeadlineExceeded,
        std::string(op) + ": an earlier NCCL swap on GPU " + Str(ordinal) + " (rank " + Str(device->rank) +
            ") with the ranks it reaches through NCCL did not finish within the timeout_s given to "
            "jax_ep.initialize, so its communicator was aborted, that call's outputs are invalid and the group is "
            "out of step. Find why a rank stopped (a crashed process, a hung GPU, a computation that runs on only "
            "part of the mesh), then call jax_ep.initialize again"));
  }
  if (missing != 0) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kDeadlineExceeded,
        std::string(op) + ": an earlier transfer on GPU " + Str(ordinal) + " (rank " + Str(device->rank) +
            ") gave up waiting for rank " + Str(missing - 1) + " of its EP group after the timeout_s given to "
            "jax_ep.initialize, so that call's outputs are invalid and the group is out of step. Find why rank " +
            Str(missing - 1) + " stopped (a crashed process, a hung GPU, a computation that runs on only part of "
            "the mesh), then call jax_ep.initialize again"));
  }
  if (bytes > device->capacity_bytes) {
    return ffi::Unexpected(ffi::Error(
        ffi::ErrorCode::kResourceExhausted,
        std::string(op) + ": this call needs " + Str(bytes) + " bytes of receive buffer per GPU but jax_ep.initialize "
                                                              "reserved " +
            Str(device->capacity_bytes) + "; initialize with larger sizes (see jax_ep.buffer_size_hint)"));
  }
  return GroupView{device->rank,
                   device->num_ranks,
                   device->recv_buffer,
                   device->signals,
                   device->peers,
                   timeout_cycles,
                   device->num_sms,
                   device->missing_peer_on_device,
                   device->nccl_ranks,
                   device->nccl ? device->nccl->outbox() : nullptr};
}

// The swap with the ranks the GPU reaches through NCCL, for a transfer's launcher.
NcclSwap SwapFor(const TransportState* state, int32_t ordinal, const GroupView& group, cudaStream_t stream) {
  return [=](const char* send, int64_t region_bytes, const int32_t* send_counts) -> std::string {
    const DeviceResources* device = state->resources->Find(ordinal);
    if (device == nullptr || !device->nccl) return "GPU " + Str(ordinal) + " has no NCCL link";
    return device->nccl->Swap(group, send, region_bytes, send_counts, stream);
  };
}

ffi::Error LaunchError(const char* op, const std::string& error) {
  if (error.empty()) return ffi::Error::Success();
  return ffi::Error::Internal(std::string(op) + ": " + error);
}

ffi::Error CheckRanks(const char* op, const char* name, int64_t actual, int64_t num_ranks) {
  if (actual == num_ranks) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + name + " must have R=" + Str(num_ranks) +
                                     " (the EP group size) along its rank dimension, got " + Str(actual));
}

ffi::Error ExchangeExecute(cudaStream_t stream, int32_t ordinal, TransportState* state, int64_t timeout_cycles,
                           ffi::AnyBuffer send, I32Vector send_counts, ffi::Result<ffi::AnyBuffer> recv,
                           I32VectorResult recv_counts) {
  constexpr const char* kOp = "jax_ep_exchange";
  auto group = FindGroup(kOp, ordinal, state, send.size_bytes(), timeout_cycles);
  if (group.has_error()) return group.error();
  const auto dims = send.dimensions();
  if (dims.size() < 2) return ffi::Error::InvalidArgument("jax_ep_exchange: send must be [R, rows, ...]");
  if (auto e = CheckRanks(kOp, "send", dims[0], group->num_ranks); e.failure()) return e;
  if (auto e = CheckRanks(kOp, "send_counts", send_counts.element_count(), group->num_ranks); e.failure()) return e;
  if (recv->size_bytes() != send.size_bytes()) {
    return ffi::Error::InvalidArgument("jax_ep_exchange: recv must have the size of send");
  }
  const int64_t rows = dims[1];
  const int64_t row_bytes = rows == 0 ? 0 : static_cast<int64_t>(send.size_bytes()) / (group->num_ranks * rows);
  return LaunchError(kOp, LaunchExchange(static_cast<const char*>(send.untyped_data()), send_counts.typed_data(),
                                         static_cast<char*>(recv->untyped_data()), recv_counts->typed_data(), rows,
                                         row_bytes, *group, SwapFor(state, ordinal, *group, stream), stream));
}

ffi::Error TokensToRowsExecute(cudaStream_t stream, int32_t ordinal, TransportState* state, int64_t timeout_cycles,
                               ffi::AnyBuffer x, I32Matrix token_dest_pos, I32Vector self_token, I32Cube recv_rows,
                               I32Vector recv_counts, I32Vector row_slot, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = "jax_ep_tokens_to_rows";
  const auto x_dims = x.dimensions();
  if (x_dims.size() != 2) return ffi::Error::InvalidArgument("jax_ep_tokens_to_rows: x must be [T, H]");
  const int64_t num_tokens = x_dims[0];
  const int64_t row_bytes = num_tokens == 0 ? 0 : static_cast<int64_t>(x.size_bytes()) / num_tokens;
  const int64_t num_ranks = token_dest_pos.dimensions()[1];
  auto group = FindGroup(kOp, ordinal, state, num_ranks * num_tokens * row_bytes, timeout_cycles);
  if (group.has_error()) return group.error();
  if (auto e = CheckRanks(kOp, "token_dest_pos", num_ranks, group->num_ranks); e.failure()) return e;
  const auto rows_dims = recv_rows.dimensions();
  const int64_t num_rows = row_slot.element_count(), topk = rows_dims[2];
  if (token_dest_pos.dimensions()[0] != num_tokens || self_token.element_count() != static_cast<size_t>(num_tokens) ||
      rows_dims[0] != num_ranks || rows_dims[1] != num_tokens ||
      recv_counts.element_count() != static_cast<size_t>(num_ranks) ||
      out->size_bytes() != static_cast<size_t>(num_rows * row_bytes)) {
    return ffi::Error::InvalidArgument(
        "jax_ep_tokens_to_rows: expected token_dest_pos [T=" + Str(num_tokens) + ", R=" + Str(num_ranks) +
        "], self_token [T], recv_rows [R, T, K], recv_counts [R] and out [N=" + Str(num_rows) + " rows of " +
        Str(row_bytes) + " bytes]; got token_dest_pos rows " + Str(token_dest_pos.dimensions()[0]) +
        ", self_token " + Str(self_token.element_count()) + ", recv_rows [" + Str(rows_dims[0]) + ", " +
        Str(rows_dims[1]) + ", " + Str(topk) + "], recv_counts " + Str(recv_counts.element_count()) + ", out bytes " +
        Str(out->size_bytes()));
  }
  return LaunchError(kOp, LaunchTokensToRows(static_cast<const char*>(x.untyped_data()), token_dest_pos.typed_data(),
                                             self_token.typed_data(), recv_rows.typed_data(),
                                             recv_counts.typed_data(), row_slot.typed_data(),
                                             static_cast<char*>(out->untyped_data()), num_tokens, row_bytes,
                                             num_rows, topk, *group, SwapFor(state, ordinal, *group, stream),
                                             stream));
}

ffi::Error RowsToTokensExecute(cudaStream_t stream, int32_t ordinal, TransportState* state, int64_t timeout_cycles,
                               ffi::AnyBuffer y, F32Vector weights, I32Cube recv_rows, I32Vector recv_counts,
                               I32Matrix token_dest_pos, ffi::Result<ffi::AnyBuffer> out) {
  constexpr const char* kOp = "jax_ep_rows_to_tokens";
  FloatType type;
  switch (y.element_type()) {
    case ffi::F32: type = FloatType::kF32; break;
    case ffi::BF16: type = FloatType::kBF16; break;
    case ffi::F16: type = FloatType::kF16; break;
    default:
      return ffi::Error::InvalidArgument("jax_ep_rows_to_tokens: y must be float32, bfloat16 or float16");
  }
  if (out->element_type() != y.element_type()) {
    return ffi::Error::InvalidArgument("jax_ep_rows_to_tokens: out must have the dtype of y");
  }
  const auto rows_dims = recv_rows.dimensions();
  const int64_t num_ranks = rows_dims[0], num_tokens = rows_dims[1], topk = rows_dims[2];
  const auto y_dims = y.dimensions();
  const int64_t hidden = y_dims.size() == 2 ? y_dims[1] : -1;
  auto group = FindGroup(kOp, ordinal, state, num_ranks * num_tokens * hidden * sizeof(float), timeout_cycles);
  if (group.has_error()) return group.error();
  if (auto e = CheckRanks(kOp, "recv_rows", num_ranks, group->num_ranks); e.failure()) return e;
  if (topk > kMaxFusedTopk) {
    return ffi::Error::InvalidArgument("jax_ep_rows_to_tokens: recv_rows must have at most " + Str(kMaxFusedTopk) +
                                       " slots per token, got K=" + Str(topk));
  }
  if (hidden < 0 || weights.element_count() != static_cast<size_t>(y_dims[0]) ||
      recv_counts.element_count() != static_cast<size_t>(num_ranks) || token_dest_pos.dimensions()[0] != num_tokens ||
      token_dest_pos.dimensions()[1] != num_ranks || out->element_count() != static_cast<size_t>(num_tokens * hidden)) {
    return ffi::Error::InvalidArgument("jax_ep_rows_to_tokens: expected y [N, H], weights [N], recv_rows [R=" +
                                       Str(num_ranks) + ", T=" + Str(num_tokens) + ", K], recv_counts [R], "
                                       "token_dest_pos [T, R] and out [T, H]; got y of rank " +
                                       Str(y_dims.size()) + ", weights " + Str(weights.element_count()) +
                                       ", out " + Str(out->element_count()) + " elements");
  }
  return LaunchError(kOp, LaunchRowsToTokens(y.untyped_data(), weights.typed_data(), recv_rows.typed_data(),
                                             recv_counts.typed_data(), token_dest_pos.typed_data(),
                                             out->untyped_data(), type, num_tokens, hidden, topk, *group,
                                             SwapFor(state, ordinal, *group, stream), stream));
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpTransportInstantiate, jax_ep::TransportInstantiate, ffi::Ffi::BindInstantiate());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpExchangeExecute, jax_ep::ExchangeExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<jax_ep::TransportState>>()
                                  .Attr<int64_t>("timeout_cycles")  // give up waiting for peers after this
                                  .Arg<ffi::AnyBuffer>()            // send [R, rows, ...]
                                  .Arg<I32Vector>()                 // send_counts [R]
                                  .Ret<ffi::AnyBuffer>()            // recv [R, rows, ...]
                                  .Ret<I32Vector>());               // recv_counts [R]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpTokensToRowsExecute, jax_ep::TokensToRowsExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<jax_ep::TransportState>>()
                                  .Attr<int64_t>("timeout_cycles")  // give up waiting for peers after this
                                  .Arg<ffi::AnyBuffer>()            // x [T, H]
                                  .Arg<I32Matrix>()                 // token_dest_pos [T, R]
                                  .Arg<I32Vector>()                 // self_token [T]
                                  .Arg<I32Cube>()                   // recv_rows [R, T, K]
                                  .Arg<I32Vector>()                 // recv_counts [R]
                                  .Arg<I32Vector>()                 // row_slot [N]
                                  .Ret<ffi::AnyBuffer>());          // out [N, H]

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpRowsToTokensExecute, jax_ep::RowsToTokensExecute,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Ctx<ffi::DeviceOrdinal>()
                                  .Ctx<ffi::State<jax_ep::TransportState>>()
                                  .Attr<int64_t>("timeout_cycles")  // give up waiting for peers after this
                                  .Arg<ffi::AnyBuffer>()            // y [N, H]
                                  .Arg<F32Vector>()                 // weights [N]
                                  .Arg<I32Cube>()                   // recv_rows [R, T, K]
                                  .Arg<I32Vector>()                 // recv_counts [R]
                                  .Arg<I32Matrix>()                 // token_dest_pos [T, R]
                                  .Ret<ffi::AnyBuffer>());          // out [T, H]

extern "C" XLA_FFI_TypeId* JaxEpTransportStateTypeId() { return &jax_ep::TransportState::id; }

extern "C" const XLA_FFI_TypeInfo* JaxEpTransportStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<jax_ep::TransportState>();
  return &info;
}
