// The XLA FFI handlers: find this GPU's part of the group, take the call's buffers, launch. Each binds the operands,
// the attributes (one struct per op) and the results of its target, typed, in the order of the target's spec in
// jax_ep/ep/cuda.py, which builds the call. They never throw; the library's Status becomes ffi::Error
// here, and only here. Handlers keep no per-call state on the host, so XLA may capture them in command buffers
// (CUDA graphs), except for groups that reach a rank through NCCL, which call the targets' *_uncaptured twins.
#include "handlers.h"

#include <atomic>
#include <cstddef>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <tuple>
#include <utility>

#include "../runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jax_ep {

// The attributes of a call: the group it was traced for, its call site, and the op's own, as cuda.py's _attrs
// names them.
struct DispatchAttrs {
  int64_t group, site;
  int64_t num_experts;  // E
  int64_t capacity;     // C
  int64_t alignment;    // expert_alignment
  bool expert_layout;   // layout "expert" (else "ragged")
  bool balanced;        // drop_policy "balanced" (else "expert")
};
struct CombineAttrs {
  int64_t group, site;
  bool partial_f32;  // partial sums travel as float32, else in y's type
  bool stage_own;    // a split combine whose start stages this rank's own partial sums too (its finish has no y)
};
struct CallAttrs {  // the backward pass of combine
  int64_t group, site;
};

}  // namespace jax_ep

XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::DispatchAttrs, ::xla::ffi::StructMember<int64_t>("group"),
                                      ::xla::ffi::StructMember<int64_t>("site"),
                                      ::xla::ffi::StructMember<int64_t>("num_experts"),
                                      ::xla::ffi::StructMember<int64_t>("capacity"),
                                      ::xla::ffi::StructMember<int64_t>("alignment"),
                                      ::xla::ffi::StructMember<bool>("expert_layout"),
                                      ::xla::ffi::StructMember<bool>("balanced"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::CombineAttrs, ::xla::ffi::StructMember<int64_t>("group"),
                                      ::xla::ffi::StructMember<int64_t>("site"),
                                      ::xla::ffi::StructMember<bool>("partial_f32"),
                                      ::xla::ffi::StructMember<bool>("stage_own"));
XLA_FFI_REGISTER_STRUCT_ATTR_DECODING(jax_ep::CallAttrs, ::xla::ffi::StructMember<int64_t>("group"),
                                      ::xla::ffi::StructMember<int64_t>("site"));

namespace jax_ep {

// The buffers, by what they hold: rows of any type (float rows, or FP8 rows as bytes), int32 and float32 arrays.
using Rows = ffi::AnyBuffer;
using I32 = ffi::Buffer<ffi::S32>;
using F32 = ffi::Buffer<ffi::F32>;

// Per-instance state (one instance per jax_ep call of each compiled executable): the group it was traced for,
// and the call's origin (its call site, and this instance's number, whose first call waits the first-call timeout).
struct GroupState {
  static ffi::TypeId id;
  std::shared_ptr<Group> group;
  CallOrigin origin;
};
ffi::TypeId GroupState::id = {};

namespace {

std::string Str(int64_t value) { return std::to_string(value); }

// A launcher's Status as the handler's error: the message prefixed with the op's name.
ffi::Error ToFfi(const char* op, const Status& status) {
  const std::string message = std::string(op) + ": " + status.message;
  switch (status.code) {
    case StatusCode::kOk: return ffi::Error::Success();
    case StatusCode::kInvalidArgument: return ffi::Error(ffi::ErrorCode::kInvalidArgument, message);
    case StatusCode::kFailedPrecondition: return ffi::Error(ffi::ErrorCode::kFailedPrecondition, message);
    case StatusCode::kResourceExhausted: return ffi::Error(ffi::ErrorCode::kResourceExhausted, message);
    case StatusCode::kDeadlineExceeded: return ffi::Error(ffi::ErrorCode::kDeadlineExceeded, message);
    case StatusCode::kInternal: return ffi::Error(ffi::ErrorCode::kInternal, message);
  }
  return ffi::Error(ffi::ErrorCode::kInternal, message);
}

std::atomic<uint32_t> next_instance{0};

ffi::ErrorOr<std::unique_ptr<GroupState>> Instantiate(ffi::Dictionary attrs) {
  ffi::ErrorOr<int64_t> id = attrs.get<int64_t>("group");
  if (id.has_error()) return ffi::Unexpected(id.error());
  ffi::ErrorOr<int64_t> site = attrs.get<int64_t>("site");
  if (site.has_error()) return ffi::Unexpected(site.error());
  std::shared_ptr<Group> group = FindGroup(*id);
  if (!group || !group->usable()) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_ep: backend='cuda' needs the jax_ep.Group this computation was traced "
                                      "for (id " + Str(*id) + "), which was finalized or never committed; call "
                                      "jax_ep.initialize again and trace the computation again"));
  }
  const CallOrigin origin{static_cast<uint32_t>(*site), next_instance.fetch_add(1) % kMaxInstances};
  return std::make_unique<GroupState>(GroupState{std::move(group), origin});
}

// This GPU's part of the group, after checking that the group is live and has recorded no failure, and the lock
// that keeps it live (Group::LockLaunches) until the handler returns, its launches made. The lock comes first, so
// it is released last: Group::Release cannot make this handler drop the last reference to the device's memory.
struct LaunchTarget {
  std::shared_lock<std::shared_mutex> lock;
  std::shared_ptr<const DeviceResources> device;
  GroupView view;
  NcclSwap swap;
};

ffi::ErrorOr<LaunchTarget> FindDevice(const char* op, cudaStream_t stream, int32_t ordinal, const GroupState* state) {
  std::shared_lock<std::shared_mutex> lock = state->group->LockLaunches();
  if (!state->group->usable()) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      std::string(op) + ": the jax_ep.Group of this computation was finalized; "
                                      "computations compiled before jax_ep.finalize must not run again"));
  }
  std::shared_ptr<const DeviceResources> device = state->group->Find(ordinal);
  if (!device) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      std::string(op) + ": GPU " + Str(ordinal) +
                                          " is in no EP group of the mesh given to jax_ep.initialize"));
  }
  const std::string failure = device->Failure();
  if (!failure.empty()) return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kDeadlineExceeded, failure));
  state->group->CountLaunch();
  // The swap with the ranks the GPU reaches through NCCL, for a launcher.
  NcclSwap swap = [device, stream](int64_t region_bytes) -> Status {
    if (!device->nccl) return Status::Internal("GPU " + Str(device->ordinal) + " has no NCCL link");
    return device->nccl->Swap(region_bytes, stream);
  };
  GroupView view = device->View();
  return LaunchTarget{std::move(lock), std::move(device), view, std::move(swap)};
}

// The float type of rows of XLA type `type`.
ffi::ErrorOr<FloatType> TypeOf(const char* op, ffi::DataType type) {
  switch (type) {
    case ffi::F32: return FloatType::kF32;
    case ffi::BF16: return FloatType::kBF16;
    case ffi::F16: return FloatType::kF16;
    default: break;
  }
  return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(op) + ": rows must be float32, bfloat16 or float16"));
}

// A result's bytes and the bytes its launcher writes there.
struct Extent {
  const char* name;
  size_t bytes;
  int64_t written;
};
template <typename Buffer>
Extent ExtentOf(const char* name, ffi::Result<Buffer>& result, int64_t written) {
  return Extent{name, result->size_bytes(), written};
}

// A result the kernels do not take, as the handlers' error: a spec in jax_ep/ep/cuda.py that disagrees with ffi/
// must not make a kernel write past a buffer.
ffi::Error WrongResult(const char* op, const std::string& what) {
  return ffi::Error::Internal(std::string(op) + ": result " + what +
                              " (a bug in jax_ep: jax_ep/ep/cuda.py's spec of the call disagrees with ffi/)");
}

// Results whose size is not what the kernels write fail the call.
ffi::Error CheckExtents(const char* op, std::initializer_list<Extent> extents) {
  for (const Extent& extent : extents) {
    if (static_cast<int64_t>(extent.bytes) != extent.written) {
      return WrongResult(op, std::string(extent.name) + " has " + Str(static_cast<int64_t>(extent.bytes)) +
                                 " bytes where the kernels write " + Str(extent.written));
    }
  }
  return ffi::Error::Success();
}

// A result's data, converted to the pointer type of the launcher's field it fills.
struct Data {
  void* data;
  template <typename T>
  operator T*() const {  // NOLINT: implicit, so that results fill the launchers' output structs in order
    return static_cast<T*>(data);
  }
};
template <typename Buffer>
Data DataOf(ffi::Result<Buffer>& result) {
  return Data{result->untyped_data()};
}

// The output struct Outputs of the launchers, filled in order from results [kFirst, kFirst + fields) of a call.
template <typename Outputs, size_t kFirst, size_t... Is, typename Tuple>
Outputs Fill(Tuple& results, std::index_sequence<Is...>) {
  return Outputs{DataOf(std::get<kFirst + Is>(results))...};
}
template <typename Outputs, size_t kFields, size_t kFirst = 0, typename Tuple>
Outputs Fill(Tuple& results) {
  return Fill<Outputs, kFirst>(results, std::make_index_sequence<kFields>());
}

// A dispatch: x [T, W] (rows of W bytes), topk_idx and topk_weights [T, K]; the results in the order of its phase
// (TARGETS in cuda.py: RECEIVED then ROUTED; ROUTED then SENT; RECEIVED).
template <Phase kPhase, typename... Results>
ffi::Error RunDispatch(const char* op, cudaStream_t stream, int32_t ordinal, GroupState* state,
                       const DispatchAttrs& attrs, Rows x, I32 topk_idx, F32 topk_weights, I32 axis_index,
                       Results... results) {
  auto found = FindDevice(op, stream, ordinal, state);
  if (found.has_error()) return found.error();
  const auto x_dims = x.dimensions(), idx_dims = topk_idx.dimensions();
  if (x_dims.size() != 2 || idx_dims.size() != 2 || idx_dims[0] != x_dims[0] ||
      topk_weights.element_count() != topk_idx.element_count()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": x must be [T, W], topk_idx and topk_weights [T, K]");
  }
  const int64_t T = x_dims[0], L = attrs.num_experts / found->view.num_ranks;
  DispatchCall call{.origin = state->origin,
                    .x = static_cast<const char*>(x.untyped_data()),
                    .topk_idx = topk_idx.typed_data(),
                    .topk_weights = topk_weights.typed_data(),
                    .axis_index = axis_index.typed_data(),
                    .num_tokens = T,
                    .row_bytes = T == 0 ? 0 : static_cast<int64_t>(x.size_bytes()) / T,
                    .topk = idx_dims[1],
                    .num_experts = attrs.num_experts,
                    .capacity = attrs.capacity,
                    .alignment = attrs.alignment,
                    .num_rows = attrs.expert_layout ? L * attrs.capacity : attrs.capacity,
                    .expert_layout = attrs.expert_layout,
                    .balanced = attrs.balanced};
  auto rets = std::tie(results...);
  constexpr size_t kReceived = kDispatchReceived, kRouted = kDispatchRouted;
  const int64_t R = found->view.num_ranks, K = call.topk, N = call.num_rows, I = sizeof(int32_t);
  // The received results (RECEIVED in jax_ep/ep/types.py, in order), and the routed.
  const auto received_extents = [&](auto& r) {
    const int64_t x_bytes = T == 0 ? static_cast<int64_t>(std::get<0>(r)->size_bytes()) : N * call.row_bytes;
    return CheckExtents(op, {ExtentOf("x", std::get<0>(r), x_bytes),  // rows of x's width (T = 0: any)
                             ExtentOf("weights", std::get<1>(r), N * 4),
                             ExtentOf("group_sizes", std::get<2>(r), L * I),
                             ExtentOf("num_dropped", std::get<3>(r), I),
                             ExtentOf("num_invalid", std::get<4>(r), I),
                             ExtentOf("expert_load", std::get<5>(r), L * I),
                             ExtentOf("send_counts", std::get<6>(r), R * I),
                             ExtentOf("recv_rows", std::get<7>(r), R * T * K * I),
                             ExtentOf("recv_counts", std::get<8>(r), R * I),
                             ExtentOf("row_slot", std::get<9>(r), N * I)});
  };
  const auto routed_extents = [&](auto& token_dest_pos, auto& slot_dest) {
    return CheckExtents(op, {ExtentOf("token_dest_pos", token_dest_pos, T * R * I),
                             ExtentOf("slot_dest", slot_dest, T * K * I)});
  };
  if constexpr (kPhase == Phase::kWhole) {
    static_assert(sizeof...(Results) == kReceived + kRouted);
    if (auto error = received_extents(rets); error.failure()) return error;
    if (auto error = routed_extents(std::get<kReceived>(rets), std::get<kReceived + 1>(rets)); error.failure()) {
      return error;
    }
    call.received = Fill<DispatchReceived, kReceived>(rets);
    call.routed = Fill<DispatchRouted, kRouted, kReceived>(rets);
  } else if constexpr (kPhase == Phase::kStart) {
    static_assert(sizeof...(Results) == kRouted + 1);
    if (auto error = routed_extents(std::get<0>(rets), std::get<1>(rets)); error.failure()) return error;
    if (auto error = CheckExtents(op, {ExtentOf("sent", std::get<kRouted>(rets), 4)}); error.failure()) return error;
    call.routed = Fill<DispatchRouted, kRouted>(rets);
    call.sent = DataOf(std::get<kRouted>(rets));
  } else {
    static_assert(sizeof...(Results) == kReceived);
    if (auto error = received_extents(rets); error.failure()) return error;
    call.received = Fill<DispatchReceived, kReceived>(rets);
  }
  return ToFfi(op, LaunchDispatch(call, found->view, found->swap, stream, kPhase));
}

// The backward pass of combine: g [T, H], y [N, H] (or [N, 0] without weights: y is then not read), weights [N] or
// [0], the handle's token_dest_pos, recv_rows, recv_counts and row_slot; results dy and dweights, or a start's sent.
template <Phase kPhase, typename... Results>
ffi::Error RunCombineBackward(const char* op, cudaStream_t stream, int32_t ordinal, GroupState* state, Rows g,
                              Rows y, F32 weights, I32 token_dest_pos, I32 recv_rows, I32 recv_counts, I32 row_slot,
                              I32 axis_index, Results... results) {
  const auto type = TypeOf(op, y.element_type());
  if (type.has_error()) return type.error();
  auto found = FindDevice(op, stream, ordinal, state);
  if (found.has_error()) return found.error();
  const auto g_dims = g.dimensions(), y_dims = y.dimensions(), rows_dims = recv_rows.dimensions();
  if (g_dims.size() != 2 || y_dims.size() != 2 || rows_dims.size() != 3 || g.element_type() != y.element_type()) {
    return ffi::Error::InvalidArgument(std::string(op) + ": g must be [T, H] and y [N, H] of one dtype");
  }
  const int64_t y_rows = y_dims[0];
  if (static_cast<int64_t>(row_slot.element_count()) != y_rows ||
      (weights.element_count() != 0 && static_cast<int64_t>(weights.element_count()) != y_rows)) {
    return ffi::Error::InvalidArgument(std::string(op) + ": row_slot, and weights where given, must have y's N rows");
  }
  CombineBackwardCall call{.origin = state->origin,
                           .g = g.untyped_data(),
                           .y = y.untyped_data(),
                           .weights = weights.element_count() != 0 ? weights.typed_data() : nullptr,
                           .axis_index = axis_index.typed_data(),
                           .token_dest_pos = token_dest_pos.typed_data(),
                           .recv_rows = recv_rows.typed_data(),
                           .recv_counts = recv_counts.typed_data(),
                           .row_slot = row_slot.typed_data(),
                           .num_tokens = g_dims[0],
                           .hidden = g_dims[1],
                           .topk = rows_dims[2],
                           .num_rows = y_dims[0],
                           .type = *type};
  auto rets = std::tie(results...);
  if constexpr (kPhase == Phase::kStart) {
    if (auto error = CheckExtents(op, {ExtentOf("sent", std::get<0>(rets), 4)}); error.failure()) return error;
    call.sent = DataOf(std::get<0>(rets));
  } else {
    const int64_t weighted = call.weights != nullptr ? call.num_rows * 4 : 0;
    const int64_t dy_bytes = call.num_rows * call.hidden * static_cast<int64_t>(ffi::ByteWidth(g.element_type()));
    if (auto error = CheckExtents(op, {ExtentOf("dy", std::get<0>(rets), dy_bytes),
                                       ExtentOf("dweights", std::get<1>(rets), weighted)});
        error.failure()) {
      return error;
    }
    call.outputs = Fill<CombineBackwardOutputs, 2>(rets);
  }
  return ToFfi(op, LaunchCombineBackward(call, found->view, found->swap, stream, kPhase));
}

// Combine: y [N, H], weights [N] or [0], row_values [N] or [0], the handle's recv_rows, recv_counts,
// token_dest_pos and slot_dest; results out [T, H] and slot_values [T, K] or [0], or a start's sent. A finish with
// stage_own reads only the staged partial sums, token_dest_pos and slot_dest: its sizes come from its results.
template <Phase kPhase, typename... Results>
ffi::Error RunCombine(const char* op, cudaStream_t stream, int32_t ordinal, GroupState* state,
                      const CombineAttrs& attrs, Rows y, F32 weights, F32 row_values, I32 recv_rows, I32 recv_counts,
                      I32 token_dest_pos, I32 slot_dest, I32 axis_index, Results... results) {
  auto rets = std::tie(results...);
  const ffi::DataType rows_type = kPhase == Phase::kStart ? y.element_type() : std::get<0>(rets)->element_type();
  const auto type = TypeOf(op, rows_type);
  if (type.has_error()) return type.error();
  auto found = FindDevice(op, stream, ordinal, state);
  if (found.has_error()) return found.error();
  const auto pos_dims = token_dest_pos.dimensions(), slot_dims = slot_dest.dimensions();
  if (pos_dims.size() != 2 || slot_dims.size() != 2 || y.dimensions().size() != 2) {
    return ffi::Error::InvalidArgument(std::string(op) + ": y, token_dest_pos and slot_dest must be matrices");
  }
  // A finish with stage_own reads no y, weights or row values: its start staged the partial sums and values.
  const bool reads_y = !(attrs.stage_own && kPhase == Phase::kFinish);
  const int64_t y_rows = y.dimensions()[0];
  const auto has_y_rows = [y_rows](size_t count) { return count == 0 || static_cast<int64_t>(count) == y_rows; };
  if (reads_y && !(has_y_rows(weights.element_count()) && has_y_rows(row_values.element_count()))) {
    return ffi::Error::InvalidArgument(std::string(op) + ": weights and row_values must have y's N rows, or none");
  }
  CombineCall call{.origin = state->origin,
                   .y = reads_y ? y.untyped_data() : nullptr,
                   .weights = weights.element_count() != 0 ? weights.typed_data() : nullptr,
                   .row_values = row_values.element_count() != 0 ? row_values.typed_data() : nullptr,
                   .axis_index = axis_index.typed_data(),
                   .recv_rows = recv_rows.element_count() != 0 ? recv_rows.typed_data() : nullptr,
                   .recv_counts = recv_counts.element_count() != 0 ? recv_counts.typed_data() : nullptr,
                   .token_dest_pos = token_dest_pos.typed_data(),
                   .slot_dest = slot_dest.typed_data(),
                   .num_tokens = pos_dims[0],
                   .hidden = y.dimensions()[1],
                   .topk = slot_dims[1],
                   .type = *type,
                   .partial_f32 = attrs.partial_f32,
                   .stage_own = attrs.stage_own};
  if constexpr (kPhase == Phase::kStart) {
    if (auto error = CheckExtents(op, {ExtentOf("sent", std::get<0>(rets), 4)}); error.failure()) return error;
    call.sent = DataOf(std::get<0>(rets));
  } else {
    const auto out_dims = std::get<0>(rets)->dimensions();
    if (out_dims.size() != 2 || out_dims[0] != call.num_tokens ||
        (reads_y && (out_dims[1] != y.dimensions()[1] || rows_type != y.element_type()))) {
      return WrongResult(op, "out must be [T, H] of y's dtype");
    }
    // slot_values: [T, K] when the call has row values (a finish with stage_own: when its start staged them).
    const bool valued = reads_y ? row_values.element_count() != 0 : std::get<1>(rets)->element_count() != 0;
    const int64_t values_bytes = valued ? call.num_tokens * call.topk * 4 : 0;
    if (auto error = CheckExtents(op, {ExtentOf("slot_values", std::get<1>(rets), values_bytes)}); error.failure()) {
      return error;
    }
    call.hidden = out_dims[1];  // out [T, H]: a finish with stage_own has no y rows
    call.outputs = Fill<CombineOutputs, 2>(rets);
    if (std::get<1>(rets)->element_count() == 0) call.outputs.slot_values = nullptr;
  }
  return ToFfi(op, LaunchCombine(call, found->view, found->swap, stream, kPhase));
}

}  // namespace
}  // namespace jax_ep

using jax_ep::CallAttrs;
using jax_ep::CombineAttrs;
using jax_ep::DispatchAttrs;
using jax_ep::F32;
using jax_ep::GroupState;
using jax_ep::I32;
using jax_ep::Phase;
using jax_ep::Rows;

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpInstantiate, jax_ep::Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs());  // "group" (the jax_ep.Group's id) and "site"

// Every execute handler twice: command-buffer compatible, and not (name##Uncaptured).
#define JAX_EP_DEFINE_TARGET(name, fn, binding)                                             \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name, fn, binding, {ffi::Traits::kCmdBufferCompatible}); \
  XLA_FFI_DEFINE_HANDLER_SYMBOL(name##Uncaptured, fn, binding)

namespace {

// What every execute handler binds first: XLA's stream, the GPU, the state of the call's instance.
auto BindCall() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::State<GroupState>>();
}

template <typename... Ts>
struct Types {};
template <typename... As, typename... Bs>
Types<As..., Bs...> operator+(Types<As...>, Types<Bs...>) {
  return {};
}

// `binding` with results of the types T, Ts..., in order (each step a prvalue: bindings are not copied or moved).
template <typename T, typename... Ts, typename Binding>
auto WithResults(Binding&& binding) {
  if constexpr (sizeof...(Ts) == 0) {
    return std::move(binding).template Ret<T>();
  } else {
    return WithResults<Ts...>(std::move(binding).template Ret<T>());
  }
}

// `binding`, then the axis index (an operand), then the results.
template <typename Binding, typename... Ts>
auto AxisAndResults(Binding&& binding, Types<Ts...>) {
  return WithResults<Ts...>(std::move(binding).template Arg<I32>());
}

// The results of the targets, typed, in the order of cuda.py's TARGETS (RECEIVED and ROUTED from types.py).
using Received = Types<Rows, F32, I32, I32, I32, I32, I32, I32, I32, I32>;
using Routed = Types<I32, I32>;
using Sent = Types<F32>;
using Backward = Types<Rows, F32>;
using Combined = Types<Rows, F32>;

// Operands: x, topk_idx, topk_weights; a finish also its start's token_dest_pos and slot_dest.
auto BindDispatch() { return BindCall().Attrs<DispatchAttrs>().Arg<Rows>().Arg<I32>().Arg<F32>(); }
// Operands: g, y, weights, token_dest_pos, recv_rows, recv_counts, row_slot; a finish also its start's sent.
auto BindCombineBackward() {
  return BindCall().Attrs<CallAttrs>().Arg<Rows>().Arg<Rows>().Arg<F32>().Arg<I32>().Arg<I32>().Arg<I32>().Arg<I32>();
}
// Operands: y, weights, row_values, recv_rows, recv_counts, token_dest_pos, slot_dest; a finish also its start's sent.
auto BindCombine() {
  return BindCall().Attrs<CombineAttrs>().Arg<Rows>().Arg<F32>().Arg<F32>().Arg<I32>().Arg<I32>().Arg<I32>().Arg<I32>();
}

// The handlers take the binding's values in order; a finish's inputs from its start (unnamed) are only its place in
// XLA's graph: after the start.
using S = cudaStream_t;
using jax_ep::RunCombine;
using jax_ep::RunCombineBackward;
using jax_ep::RunDispatch;

constexpr auto kDispatch = [](S s, int32_t o, GroupState* st, DispatchAttrs a, Rows x, I32 i, F32 w, I32 axis,
                              auto... rets) {
  return RunDispatch<Phase::kWhole>("jax_ep_dispatch", s, o, st, a, x, i, w, axis, rets...);
};
constexpr auto kDispatchStart = [](S s, int32_t o, GroupState* st, DispatchAttrs a, Rows x, I32 i, F32 w, I32 axis,
                                   auto... rets) {
  return RunDispatch<Phase::kStart>("jax_ep_dispatch_start", s, o, st, a, x, i, w, axis, rets...);
};
constexpr auto kDispatchFinish = [](S s, int32_t o, GroupState* st, DispatchAttrs a, Rows x, I32 i, F32 w, I32, I32,
                                    I32 axis, auto... rets) {
  return RunDispatch<Phase::kFinish>("jax_ep_dispatch_finish", s, o, st, a, x, i, w, axis, rets...);
};
constexpr auto kCombineBackward = [](S s, int32_t o, GroupState* st, CallAttrs, Rows g, Rows y, F32 w, I32 pos,
                                     I32 rows, I32 counts, I32 slots, I32 axis, auto... rets) {
  return RunCombineBackward<Phase::kWhole>("jax_ep_combine_backward", s, o, st, g, y, w, pos, rows, counts, slots,
                                           axis, rets...);
};
constexpr auto kCombineBackwardStart = [](S s, int32_t o, GroupState* st, CallAttrs, Rows g, Rows y, F32 w, I32 pos,
                                          I32 rows, I32 counts, I32 slots, I32 axis, auto... rets) {
  return RunCombineBackward<Phase::kStart>("jax_ep_combine_backward_start", s, o, st, g, y, w, pos, rows, counts,
                                           slots, axis, rets...);
};
constexpr auto kCombineBackwardFinish = [](S s, int32_t o, GroupState* st, CallAttrs, Rows g, Rows y, F32 w, I32 pos,
                                           I32 rows, I32 counts, I32 slots, F32, I32 axis, auto... rets) {
  return RunCombineBackward<Phase::kFinish>("jax_ep_combine_backward_finish", s, o, st, g, y, w, pos, rows, counts,
                                            slots, axis, rets...);
};
constexpr auto kCombine = [](S s, int32_t o, GroupState* st, CombineAttrs a, Rows y, F32 w, F32 values, I32 rows,
                             I32 counts, I32 pos, I32 slots, I32 axis, auto... rets) {
  return RunCombine<Phase::kWhole>("jax_ep_combine", s, o, st, a, y, w, values, rows, counts, pos, slots, axis,
                                   rets...);
};
constexpr auto kCombineStart = [](S s, int32_t o, GroupState* st, CombineAttrs a, Rows y, F32 w, F32 values,
                                  I32 rows, I32 counts, I32 pos, I32 slots, I32 axis, auto... rets) {
  return RunCombine<Phase::kStart>("jax_ep_combine_start", s, o, st, a, y, w, values, rows, counts, pos, slots, axis,
                                   rets...);
};
constexpr auto kCombineFinish = [](S s, int32_t o, GroupState* st, CombineAttrs a, Rows y, F32 w, F32 values,
                                   I32 rows, I32 counts, I32 pos, I32 slots, F32, I32 axis, auto... rets) {
  return RunCombine<Phase::kFinish>("jax_ep_combine_finish", s, o, st, a, y, w, values, rows, counts, pos, slots,
                                    axis, rets...);
};

}  // namespace

JAX_EP_DEFINE_TARGET(JaxEpDispatch, kDispatch, AxisAndResults(BindDispatch(), Received{} + Routed{}));
JAX_EP_DEFINE_TARGET(JaxEpDispatchStart, kDispatchStart, AxisAndResults(BindDispatch(), Routed{} + Sent{}));
JAX_EP_DEFINE_TARGET(JaxEpDispatchFinish, kDispatchFinish,
                     AxisAndResults(BindDispatch().Arg<I32>().Arg<I32>(), Received{}));
JAX_EP_DEFINE_TARGET(JaxEpCombineBackward, kCombineBackward, AxisAndResults(BindCombineBackward(), Backward{}));
JAX_EP_DEFINE_TARGET(JaxEpCombineBackwardStart, kCombineBackwardStart, AxisAndResults(BindCombineBackward(), Sent{}));
JAX_EP_DEFINE_TARGET(JaxEpCombineBackwardFinish, kCombineBackwardFinish,
                     AxisAndResults(BindCombineBackward().Arg<F32>(), Backward{}));
JAX_EP_DEFINE_TARGET(JaxEpCombine, kCombine, AxisAndResults(BindCombine(), Combined{}));
JAX_EP_DEFINE_TARGET(JaxEpCombineStart, kCombineStart, AxisAndResults(BindCombine(), Sent{}));
JAX_EP_DEFINE_TARGET(JaxEpCombineFinish, kCombineFinish, AxisAndResults(BindCombine().Arg<F32>(), Combined{}));

extern "C" XLA_FFI_TypeId* JaxEpGroupStateTypeId() { return &jax_ep::GroupState::id; }

extern "C" const XLA_FFI_TypeInfo* JaxEpGroupStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<jax_ep::GroupState>();
  return &info;
}
