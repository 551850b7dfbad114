// The XLA FFI handlers: check buffers and attributes, find this GPU's part of the group, launch. They never
// throw; the library's Status becomes ffi::Error here, and only here. Handlers keep no per-call state on the
// host, so XLA may capture them in command buffers (CUDA graphs).
#include "handlers.h"

#include <cstddef>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>

#include "../runtime/group.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Aliases keep commas out of the handler-definition macros.
using I32Scalar = ffi::Buffer<ffi::S32, 0>;
using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;
using I32Cube = ffi::Buffer<ffi::S32, 3>;
using F32Vector = ffi::Buffer<ffi::F32, 1>;
using F32Matrix = ffi::Buffer<ffi::F32, 2>;

namespace jax_ep {

// Per-executable state: the group it was compiled for.
struct GroupState {
  static ffi::TypeId id;
  std::shared_ptr<Group> group;
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

ffi::ErrorOr<std::unique_ptr<GroupState>> Instantiate(ffi::Dictionary attrs) {
  ffi::ErrorOr<int64_t> id = attrs.get<int64_t>("group");
  if (id.has_error()) return ffi::Unexpected(id.error());
  const int64_t group_id = *id;
  std::shared_ptr<Group> group = FindGroup(group_id);
  if (!group || !group->usable()) {
    return ffi::Unexpected(ffi::Error(ffi::ErrorCode::kFailedPrecondition,
                                      "jax_ep: backend='cuda' needs the jax_ep.Group this computation was traced "
                                      "for (id " + Str(group_id) + "), which was finalized or never committed; call "
                                      "jax_ep.initialize again and trace the computation again"));
  }
  return std::make_unique<GroupState>(GroupState{std::move(group)});
}

// This GPU's part of the group, after checking that the group is live and has recorded no failure.
ffi::ErrorOr<std::shared_ptr<const DeviceResources>> FindDevice(const char* op, int32_t ordinal,
                                                                const GroupState* state) {
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
  return device;
}

// The swap with the ranks the GPU reaches through NCCL, for a launcher.
NcclSwap SwapFor(const std::shared_ptr<const DeviceResources>& device, cudaStream_t stream) {
  return [device, stream](int64_t region_bytes) -> Status {
    if (!device->nccl) return Status::Internal("GPU " + Str(device->ordinal) + " has no NCCL link");
    return device->nccl->Swap(region_bytes, stream);
  };
}

ffi::Error Expect(const char* op, const char* what, bool ok, const std::string& expected, const std::string& got) {
  if (ok) return ffi::Error::Success();
  return ffi::Error::InvalidArgument(std::string(op) + ": " + what + " must be " + expected + ", got " + got);
}

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + Str(dims[i]);
  return text + "]";
}

ffi::ErrorOr<FloatType> TypeOf(const char* op, ffi::DataType type) {
  switch (type) {
    case ffi::F32: return FloatType::kF32;
    case ffi::BF16: return FloatType::kBF16;
    case ffi::F16: return FloatType::kF16;
    default: break;
  }
  return ffi::Unexpected(ffi::Error::InvalidArgument(std::string(op) + ": rows must be float32, bfloat16 or float16"));
}

// A combine-side call's GPU (FindDevice) and the float type of its rows, whose dtype is `rows`.
struct RowsDevice {
  std::shared_ptr<const DeviceResources> device;
  FloatType type;
};

ffi::ErrorOr<RowsDevice> FindRowsDevice(const char* op, int32_t ordinal, const GroupState* state, ffi::DataType rows) {
  auto device = FindDevice(op, ordinal, state);
  if (device.has_error()) return ffi::Unexpected(device.error());
  auto type = TypeOf(op, rows);
  if (type.has_error()) return ffi::Unexpected(type.error());
  return RowsDevice{*device, *type};
}

#define JAX_EP_RETURN_IF_ERROR(expr)   \
  do {                                 \
    ffi::Error error_ = (expr);        \
    if (error_.failure()) return error_; \
  } while (0)

// Where `name` is in the results `target` lists, else -1.
constexpr int ResultIndex(const Target& target, std::string_view name) {
  for (int index = 0; index < kMaxResults && target.results[index] != nullptr; ++index) {
    if (name == target.results[index]) return index;
  }
  return -1;
}

constexpr size_t NumResults(const Target& target) {
  size_t count = 0;
  while (count < kMaxResults && target.results[count] != nullptr) ++count;
  return count;
}

// The entry of kTargets whose execute handler is `execute`, found while compiling: a handler the table does not
// list does not build.
constexpr const Target& TargetOf(XLA_FFI_Handler* execute) {
  size_t index = 0;
  while (kTargets[index].execute != execute) ++index;
  return kTargets[index];
}

template <XLA_FFI_Handler* execute>
constexpr const Target& kTarget = TargetOf(execute);

// A call's results, each taken by its name in its target's entry of kTargets.
class Results {
 public:
  Results(const Target& target, ffi::RemainingRets rets) : target_(target), rets_(rets) {}

  ffi::Error CheckCount() const {
    return Expect(target_.name, "the number of results", rets_.size() == NumResults(target_),
                  Str(NumResults(target_)) + " (its list in kTargets)", Str(rets_.size()));
  }

  // Sets *result to the result `name`; leaves it absent when the target does not list `name`.
  template <typename Buffer>
  ffi::Error Take(const char* name, std::optional<Buffer>* result) {
    const int index = ResultIndex(target_, name);
    if (index < 0) return ffi::Error::Success();
    ffi::ErrorOr<ffi::Result<Buffer>> taken = rets_.get<Buffer>(index);
    if (taken.has_error()) {
      return ffi::Error::InvalidArgument(std::string(target_.name) + ": result " + name + ": " +
                                         taken.error().message());
    }
    result->emplace(**taken);
    ++taken_;
    return ffi::Error::Success();
  }

  // The handler took every result the target lists.
  ffi::Error CheckAllTaken() const {
    if (taken_ == NumResults(target_)) return ffi::Error::Success();
    return ffi::Error::Internal(std::string(target_.name) + ": the handler takes " + Str(taken_) + " of the " +
                                Str(NumResults(target_)) + " results its entry of kTargets lists");
  }

 private:
  const Target& target_;
  ffi::RemainingRets rets_;
  size_t taken_ = 0;
};

// The outputs of a call of `target`, taken from `rets` by their names (Outputs::TakeFrom).
template <typename Outputs>
ffi::ErrorOr<Outputs> OutputsOf(const Target& target, ffi::RemainingRets rets) {
  Results results(target, rets);
  Outputs outputs;
  ffi::Error error = results.CheckCount();
  if (error.success()) error = outputs.TakeFrom(results);
  if (error.success()) error = results.CheckAllTaken();
  if (error.failure()) return ffi::Unexpected(error);
  return outputs;
}

// A dispatch's outputs; absent where the phase does not write them (a start writes token_dest_pos, slot_dest and
// sent, a finish the others).
struct DispatchOutputs {
  std::optional<ffi::AnyBuffer> x;
  std::optional<F32Vector> weights, sent;
  std::optional<I32Vector> group_sizes, send_counts, recv_counts, row_slot;
  std::optional<I32Scalar> num_dropped, num_invalid;
  std::optional<I32Matrix> token_dest_pos, slot_dest;
  std::optional<I32Cube> recv_rows;

  ffi::Error TakeFrom(Results& results) {
    JAX_EP_RETURN_IF_ERROR(results.Take("x", &x));
    JAX_EP_RETURN_IF_ERROR(results.Take("weights", &weights));
    JAX_EP_RETURN_IF_ERROR(results.Take("group_sizes", &group_sizes));
    JAX_EP_RETURN_IF_ERROR(results.Take("num_dropped", &num_dropped));
    JAX_EP_RETURN_IF_ERROR(results.Take("num_invalid", &num_invalid));
    JAX_EP_RETURN_IF_ERROR(results.Take("token_dest_pos", &token_dest_pos));
    JAX_EP_RETURN_IF_ERROR(results.Take("send_counts", &send_counts));
    JAX_EP_RETURN_IF_ERROR(results.Take("slot_dest", &slot_dest));
    JAX_EP_RETURN_IF_ERROR(results.Take("recv_rows", &recv_rows));
    JAX_EP_RETURN_IF_ERROR(results.Take("recv_counts", &recv_counts));
    JAX_EP_RETURN_IF_ERROR(results.Take("row_slot", &row_slot));
    return results.Take("sent", &sent);
  }
};

// The backward pass of combine's outputs; a start writes only sent.
struct CombineBackwardOutputs {
  std::optional<ffi::AnyBuffer> dy;
  std::optional<F32Vector> dweights, sent;

  ffi::Error TakeFrom(Results& results) {
    JAX_EP_RETURN_IF_ERROR(results.Take("dy", &dy));
    JAX_EP_RETURN_IF_ERROR(results.Take("dweights", &dweights));
    return results.Take("sent", &sent);
  }
};

// A combine's outputs; a start writes only sent.
struct CombineOutputs {
  std::optional<ffi::AnyBuffer> out, slot_values;
  std::optional<F32Vector> sent;

  ffi::Error TakeFrom(Results& results) {
    JAX_EP_RETURN_IF_ERROR(results.Take("out", &out));
    JAX_EP_RETURN_IF_ERROR(results.Take("slot_values", &slot_values));
    return results.Take("sent", &sent);
  }
};

// The data of an output the phase writes, else null.
template <typename Buffer>
auto DataOf(const std::optional<Buffer>& result) -> decltype(result->typed_data()) {
  return result ? result->typed_data() : nullptr;
}

// Whether an output the phase writes has `count` elements (true for one it does not write).
template <typename Buffer>
bool Holds(const std::optional<Buffer>& result, int64_t count) {
  return !result || result->element_count() == static_cast<size_t>(count);
}

template <typename Buffer>
std::string DimsOf(const std::optional<Buffer>& result) {
  return result ? Dims(result->dimensions()) : "none";
}

ffi::Error RunDispatch(const Target& target, cudaStream_t stream, int32_t ordinal, GroupState* state,
                       int64_t num_experts, bool expert_layout, int64_t capacity, int64_t alignment, ffi::AnyBuffer x,
                       I32Matrix topk_idx, F32Matrix topk_weights, I32Scalar axis_index, ffi::RemainingRets rets,
                       Phase phase) {
  const char* op = target.name;
  const auto outputs = OutputsOf<DispatchOutputs>(target, rets);
  if (outputs.has_error()) return outputs.error();
  const DispatchOutputs& out = *outputs;
  auto device = FindDevice(op, ordinal, state);
  if (device.has_error()) return device.error();
  const int64_t R = (*device)->num_ranks;
  const auto x_dims = x.dimensions();
  JAX_EP_RETURN_IF_ERROR(Expect(op, "x", x_dims.size() == 2, "[T, H]", Dims(x_dims)));
  const int64_t T = x_dims[0], K = topk_idx.dimensions()[1];
  const int64_t row_bytes = T == 0 ? 0 : static_cast<int64_t>(x.size_bytes()) / T;
  const int64_t L = num_experts / R;
  const int64_t N = expert_layout ? L * capacity : capacity;
  JAX_EP_RETURN_IF_ERROR(Expect(op, "topk_idx", topk_idx.dimensions()[0] == T, "[T=" + Str(T) + ", K]",
                                Dims(topk_idx.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "topk_weights", topk_weights.element_count() == static_cast<size_t>(T * K),
                                "[T, K]", Dims(topk_weights.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "num_experts", num_experts >= R && num_experts % R == 0,
                                "a positive multiple of R=" + Str(R), Str(num_experts)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "capacity", capacity >= 1 && alignment >= 1, "positive, as its alignment",
                                Str(capacity) + " and " + Str(alignment)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "out x", !out.x || out.x->size_bytes() == static_cast<size_t>(N * row_bytes),
                                Str(N) + " rows of " + Str(row_bytes) + " bytes", DimsOf(out.x)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "weights", Holds(out.weights, N),
                                "[N] with N = " + std::string(expert_layout ? "L * C" : "C") + " = " + Str(N),
                                DimsOf(out.weights)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "group_sizes", Holds(out.group_sizes, L), "[L=" + Str(L) + "]",
                                DimsOf(out.group_sizes)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "send_counts and recv_counts",
                                Holds(out.send_counts, R) && Holds(out.recv_counts, R), "[R=" + Str(R) + "]",
                                DimsOf(out.send_counts)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "slot_dest", Holds(out.slot_dest, T * K), "[T, K]", DimsOf(out.slot_dest)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "token_dest_pos", Holds(out.token_dest_pos, T * R),
                                "[T, R=" + Str(R) + "] (R: the group's size)", DimsOf(out.token_dest_pos)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "recv_rows", Holds(out.recv_rows, R * T * K), "[R, T, K]", DimsOf(out.recv_rows)));
  JAX_EP_RETURN_IF_ERROR(Expect(op, "row_slot", Holds(out.row_slot, N), "[N]", DimsOf(out.row_slot)));
  const DispatchCall call{
      .x = static_cast<const char*>(x.untyped_data()), .topk_idx = topk_idx.typed_data(),
      .topk_weights = topk_weights.typed_data(), .axis_index = axis_index.typed_data(),
      .num_tokens = T, .row_bytes = row_bytes, .topk = K, .num_experts = num_experts, .capacity = capacity,
      .alignment = alignment, .num_rows = N, .expert_layout = expert_layout,
      .out_x = out.x ? static_cast<char*>(out.x->untyped_data()) : nullptr, .out_weights = DataOf(out.weights),
      .group_sizes = DataOf(out.group_sizes), .num_dropped = DataOf(out.num_dropped),
      .num_invalid = DataOf(out.num_invalid), .token_dest_pos = DataOf(out.token_dest_pos),
      .send_counts = DataOf(out.send_counts), .slot_dest = DataOf(out.slot_dest), .recv_rows = DataOf(out.recv_rows),
      .recv_counts = DataOf(out.recv_counts), .row_slot = DataOf(out.row_slot), .sent = DataOf(out.sent)};
  return ToFfi(op, LaunchDispatch(call, (*device)->View(), SwapFor(*device, stream), stream, phase));
}

ffi::Error Dispatch(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, int64_t num_experts,
                    bool expert_layout, int64_t capacity, int64_t alignment, ffi::AnyBuffer x, I32Matrix topk_idx,
                    F32Matrix topk_weights, I32Scalar axis_index, ffi::RemainingRets rets) {
  return RunDispatch(kTarget<JaxEpDispatch>, stream, ordinal, state, num_experts, expert_layout, capacity, alignment, x,
                     topk_idx, topk_weights, axis_index, rets, Phase::kWhole);
}

ffi::Error DispatchStart(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, int64_t num_experts,
                         bool expert_layout, int64_t capacity, int64_t alignment, ffi::AnyBuffer x, I32Matrix topk_idx,
                         F32Matrix topk_weights, I32Scalar axis_index, ffi::RemainingRets rets) {
  return RunDispatch(kTarget<JaxEpDispatchStart>, stream, ordinal, state, num_experts, expert_layout, capacity,
                     alignment, x, topk_idx, topk_weights, axis_index, rets, Phase::kStart);
}

// token_dest_pos and slot_dest (the start's outputs) are only its place in XLA's graph: after the start.
ffi::Error DispatchFinish(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, int64_t num_experts,
                          bool expert_layout, int64_t capacity, int64_t alignment, ffi::AnyBuffer x, I32Matrix topk_idx,
                          F32Matrix topk_weights, I32Matrix, I32Matrix, I32Scalar axis_index, ffi::RemainingRets rets) {
  return RunDispatch(kTarget<JaxEpDispatchFinish>, stream, ordinal, state, num_experts, expert_layout, capacity,
                     alignment, x, topk_idx, topk_weights, axis_index, rets, Phase::kFinish);
}

ffi::Error RunCombineBackward(const Target& target, cudaStream_t stream, int32_t ordinal, GroupState* state,
                              ffi::AnyBuffer g, ffi::AnyBuffer y, F32Vector weights, I32Matrix token_dest_pos,
                              I32Cube recv_rows, I32Vector recv_counts, I32Vector row_slot, I32Scalar axis_index,
                              ffi::RemainingRets rets, Phase phase) {
  const char* kOp = target.name;
  const auto outputs = OutputsOf<CombineBackwardOutputs>(target, rets);
  if (outputs.has_error()) return outputs.error();
  const std::optional<ffi::AnyBuffer>& dy = outputs->dy;
  const std::optional<F32Vector>& dweights = outputs->dweights;
  const std::optional<F32Vector>& sent = outputs->sent;
  const auto found = FindRowsDevice(kOp, ordinal, state, y.element_type());
  if (found.has_error()) return found.error();
  const auto& [device, type] = *found;
  const int64_t R = device->num_ranks;
  const auto g_dims = g.dimensions(), y_dims = y.dimensions(), rows_dims = recv_rows.dimensions();
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "the cotangent", g_dims.size() == 2 && g.element_type() == y.element_type(),
                                "[T, H] of y's dtype", Dims(g_dims)));
  const int64_t T = g_dims[0], H = g_dims[1];
  const bool has_weights = weights.element_count() != 0;
  // Without weights y is not read: [N, 0] (the rows' transfer of transfer="separate") is enough.
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "y", y_dims.size() == 2 && (y_dims[1] == H || (!has_weights && y_dims[1] == 0)),
                                "[N, H=" + Str(H) + "], or [N, 0] without weights", Dims(y_dims)));
  const int64_t N = y_dims[0];
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "recv_rows", rows_dims[0] == R && rows_dims[1] == T,
                                "[R=" + Str(R) + ", T=" + Str(T) + ", K]", Dims(rows_dims)));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "token_dest_pos", token_dest_pos.element_count() == static_cast<size_t>(T * R),
                                "[T, R]", Dims(token_dest_pos.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "recv_counts", recv_counts.element_count() == static_cast<size_t>(R), "[R]",
                                Dims(recv_counts.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "row_slot", row_slot.element_count() == static_cast<size_t>(N), "[N]",
                                Dims(row_slot.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "weights", !has_weights || weights.element_count() == static_cast<size_t>(N),
                                "[N=" + Str(N) + "] or empty", Dims(weights.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(
      kOp, "dy", !dy || (dy->element_count() == static_cast<size_t>(N * H) && dy->element_type() == y.element_type()),
      "[N, H] of y's dtype", DimsOf(dy)));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "dweights", Holds(dweights, has_weights ? N : 0),
                                has_weights ? "[N]" : "[0] without weights", DimsOf(dweights)));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "the start's output", Holds(sent, 1), "[1]", DimsOf(sent)));
  const CombineBackwardCall call{
      .g = g.untyped_data(), .y = y.untyped_data(), .weights = has_weights ? weights.typed_data() : nullptr,
      .axis_index = axis_index.typed_data(), .token_dest_pos = token_dest_pos.typed_data(),
      .recv_rows = recv_rows.typed_data(), .recv_counts = recv_counts.typed_data(), .row_slot = row_slot.typed_data(),
      .num_tokens = T, .hidden = H, .topk = rows_dims[2], .num_rows = N, .type = type,
      .dy = dy ? dy->untyped_data() : nullptr, .dweights = has_weights ? DataOf(dweights) : nullptr,
      .sent = DataOf(sent)};
  return ToFfi(kOp, LaunchCombineBackward(call, device->View(), SwapFor(device, stream), stream, phase));
}

ffi::Error CombineBackward(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, ffi::AnyBuffer g,
                           ffi::AnyBuffer y, F32Vector weights, I32Matrix token_dest_pos, I32Cube recv_rows,
                           I32Vector recv_counts, I32Vector row_slot, I32Scalar axis_index, ffi::RemainingRets rets) {
  return RunCombineBackward(kTarget<JaxEpCombineBackward>, stream, ordinal, state, g, y, weights, token_dest_pos,
                            recv_rows, recv_counts, row_slot, axis_index, rets, Phase::kWhole);
}

ffi::Error CombineBackwardStart(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, ffi::AnyBuffer g,
                                ffi::AnyBuffer y, F32Vector weights, I32Matrix token_dest_pos, I32Cube recv_rows,
                                I32Vector recv_counts, I32Vector row_slot, I32Scalar axis_index,
                                ffi::RemainingRets rets) {
  return RunCombineBackward(kTarget<JaxEpCombineBackwardStart>, stream, ordinal, state, g, y, weights, token_dest_pos,
                            recv_rows, recv_counts, row_slot, axis_index, rets, Phase::kStart);
}

// `sent` (the start's output) is only its place in XLA's graph: after the start.
ffi::Error CombineBackwardFinish(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, ffi::AnyBuffer g,
                                 ffi::AnyBuffer y, F32Vector weights, I32Matrix token_dest_pos, I32Cube recv_rows,
                                 I32Vector recv_counts, I32Vector row_slot, F32Vector, I32Scalar axis_index,
                                 ffi::RemainingRets rets) {
  return RunCombineBackward(kTarget<JaxEpCombineBackwardFinish>, stream, ordinal, state, g, y, weights, token_dest_pos,
                            recv_rows, recv_counts, row_slot, axis_index, rets, Phase::kFinish);
}

ffi::Error RunCombine(const Target& target, cudaStream_t stream, int32_t ordinal, GroupState* state, bool partial_f32,
                      ffi::AnyBuffer y, F32Vector weights, F32Vector row_values, I32Cube recv_rows,
                      I32Vector recv_counts, I32Matrix token_dest_pos, I32Matrix slot_dest, I32Scalar axis_index,
                      ffi::RemainingRets rets, Phase phase, bool stage_own) {
  const char* kOp = target.name;
  const auto outputs = OutputsOf<CombineOutputs>(target, rets);
  if (outputs.has_error()) return outputs.error();
  const std::optional<ffi::AnyBuffer>& out = outputs->out;
  const std::optional<ffi::AnyBuffer>& slot_values = outputs->slot_values;
  const std::optional<F32Vector>& sent = outputs->sent;
  const auto found = FindRowsDevice(kOp, ordinal, state, y.element_type());
  if (found.has_error()) return found.error();
  const auto& [device, type] = *found;
  const int64_t R = device->num_ranks;
  const auto y_dims = y.dimensions();
  const auto rows_dims = recv_rows.dimensions();
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "y", y_dims.size() == 2, "[N, H]", Dims(y_dims)));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "recv_rows", rows_dims[0] == R, "[R=" + Str(R) + ", T, K]", Dims(rows_dims)));
  const int64_t N = y_dims[0], H = y_dims[1], T = rows_dims[1], K = rows_dims[2];
  const bool has_weights = weights.element_count() != 0, has_values = row_values.element_count() != 0;
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "weights", !has_weights || weights.element_count() == static_cast<size_t>(N),
                                "[N=" + Str(N) + "] or empty", Dims(weights.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "row_values",
                                !has_values || row_values.element_count() == static_cast<size_t>(N),
                                "[N=" + Str(N) + "] or empty", Dims(row_values.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "token_dest_pos", token_dest_pos.element_count() == static_cast<size_t>(T * R),
                                "[T, R]", Dims(token_dest_pos.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "slot_dest", slot_dest.element_count() == static_cast<size_t>(T * K), "[T, K]",
                                Dims(slot_dest.dimensions())));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "recv_counts", recv_counts.element_count() == static_cast<size_t>(R), "[R]",
                                Dims(recv_counts.dimensions())));
  JAX_EP_RETURN_IF_ERROR(
      Expect(kOp, "out",
             !out || (out->element_count() == static_cast<size_t>(T * H) && out->element_type() == y.element_type()),
             "[T, H] of y's dtype", DimsOf(out)));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "slot_values", !has_values || Holds(slot_values, T * K),
                                "[T, K] with row_values", DimsOf(slot_values)));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "the start's output", Holds(sent, 1), "[1]", DimsOf(sent)));
  const bool write_values = has_values && slot_values;
  const CombineCall call{
      .y = y.untyped_data(), .weights = has_weights ? weights.typed_data() : nullptr,
      .row_values = has_values ? row_values.typed_data() : nullptr, .axis_index = axis_index.typed_data(),
      .recv_rows = recv_rows.typed_data(), .recv_counts = recv_counts.typed_data(),
      .token_dest_pos = token_dest_pos.typed_data(), .slot_dest = slot_dest.typed_data(),
      .num_tokens = T, .hidden = H, .topk = K, .type = type, .partial_f32 = partial_f32, .stage_own = stage_own,
      .out = out ? out->untyped_data() : nullptr,
      .slot_values = write_values ? static_cast<float*>(slot_values->untyped_data()) : nullptr, .sent = DataOf(sent)};
  return ToFfi(kOp, LaunchCombine(call, device->View(), SwapFor(device, stream), stream, phase));
}

ffi::Error Combine(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, bool partial_f32, ffi::AnyBuffer y,
                   F32Vector weights, F32Vector row_values, I32Cube recv_rows, I32Vector recv_counts,
                   I32Matrix token_dest_pos, I32Matrix slot_dest, I32Scalar axis_index, ffi::RemainingRets rets) {
  return RunCombine(kTarget<JaxEpCombine>, stream, ordinal, state, partial_f32, y, weights, row_values, recv_rows,
                    recv_counts, token_dest_pos, slot_dest, axis_index, rets, Phase::kWhole, false);
}

ffi::Error CombineStart(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, bool partial_f32,
                        bool stage_own, ffi::AnyBuffer y, F32Vector weights, F32Vector row_values, I32Cube recv_rows,
                        I32Vector recv_counts, I32Matrix token_dest_pos, I32Matrix slot_dest, I32Scalar axis_index,
                        ffi::RemainingRets rets) {
  return RunCombine(kTarget<JaxEpCombineStart>, stream, ordinal, state, partial_f32, y, weights, row_values, recv_rows,
                    recv_counts, token_dest_pos, slot_dest, axis_index, rets, Phase::kStart, stage_own);
}

// The stage_own finish below reads both results.
static_assert(ResultIndex(kTarget<JaxEpCombineFinish>, "out") >= 0 &&
              ResultIndex(kTarget<JaxEpCombineFinish>, "slot_values") >= 0);

// A split combine's finish. Without stage_own it takes the start's inputs; with it, it reads only the staged
// partial sums and token_dest_pos and slot_dest (y may have no rows then): its shapes come from its outputs (out
// [T, H] in y's dtype; slot values [T, K] when the start had row values, else [0]). `sent` (the start's output)
// is only its place in XLA's graph.
ffi::Error CombineFinish(cudaStream_t stream, int32_t ordinal, GroupState* state, int64_t, bool partial_f32,
                         bool stage_own, ffi::AnyBuffer y, F32Vector weights, F32Vector row_values, I32Cube recv_rows,
                         I32Vector recv_counts, I32Matrix token_dest_pos, I32Matrix slot_dest, F32Vector,
                         I32Scalar axis_index, ffi::RemainingRets rets) {
  const Target& target = kTarget<JaxEpCombineFinish>;
  if (!stage_own) {
    return RunCombine(target, stream, ordinal, state, partial_f32, y, weights, row_values, recv_rows, recv_counts,
                      token_dest_pos, slot_dest, axis_index, rets, Phase::kFinish, false);
  }
  const char* kOp = target.name;
  const auto outputs = OutputsOf<CombineOutputs>(target, rets);
  if (outputs.has_error()) return outputs.error();
  const ffi::AnyBuffer &out = *outputs->out, &slot_values = *outputs->slot_values;
  const auto found = FindRowsDevice(kOp, ordinal, state, out.element_type());
  if (found.has_error()) return found.error();
  const auto& [device, type] = *found;
  const int64_t R = device->num_ranks;
  const auto out_dims = out.dimensions(), pos_dims = token_dest_pos.dimensions();
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "out", out_dims.size() == 2, "[T, H]", Dims(out_dims)));
  const int64_t T = out_dims[0], H = out_dims[1], K = slot_dest.dimensions()[1];
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "token_dest_pos", pos_dims[0] == T && pos_dims[1] == R,
                                "[T=" + Str(T) + ", R=" + Str(R) + "]", Dims(pos_dims)));
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "slot_dest", slot_dest.dimensions()[0] == T, "[T, K]",
                                Dims(slot_dest.dimensions())));
  const bool has_values = slot_values.element_count() != 0;
  JAX_EP_RETURN_IF_ERROR(Expect(kOp, "slot_values", !has_values || Holds(outputs->slot_values, T * K), "[T, K] or [0]",
                                DimsOf(outputs->slot_values)));
  const CombineCall call{
      .y = nullptr, .weights = nullptr, .row_values = nullptr, .axis_index = axis_index.typed_data(),
      .recv_rows = nullptr, .recv_counts = nullptr, .token_dest_pos = token_dest_pos.typed_data(),
      .slot_dest = slot_dest.typed_data(), .num_tokens = T, .hidden = H, .topk = K, .type = type,
      .partial_f32 = partial_f32, .stage_own = true, .out = out.untyped_data(),
      .slot_values = has_values ? static_cast<float*>(slot_values.untyped_data()) : nullptr, .sent = nullptr};
  return ToFfi(kOp, LaunchCombine(call, device->View(), SwapFor(device, stream), stream, Phase::kFinish));
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpInstantiate, jax_ep::Instantiate,
                              ffi::Ffi::BindInstantiate().Attrs());  // "group": the jax_ep.Group's id

constexpr auto kCommandBuffers = ffi::Traits::kCmdBufferCompatible;

// What every execute handler binds first: XLA's stream, the GPU, the group of the executable and its id.
auto BindGroupCall() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::PlatformStream<cudaStream_t>>()
      .Ctx<ffi::DeviceOrdinal>()
      .Ctx<ffi::State<jax_ep::GroupState>>()
      .Attr<int64_t>("group");  // the jax_ep.Group's id (read by the instantiate stage)
}

// Dispatch's attributes and inputs, shared by the whole op and its two halves.
auto BindDispatch() {
  return BindGroupCall()
      .Attr<int64_t>("num_experts")  // E
      .Attr<bool>("expert_layout")   // layout "expert" (else "ragged")
      .Attr<int64_t>("capacity")     // C
      .Attr<int64_t>("alignment")    // expert_alignment
      .Arg<ffi::AnyBuffer>()         // x [T, H]
      .Arg<I32Matrix>()              // topk_idx [T, K]
      .Arg<F32Matrix>();             // topk_weights [T, K]
}

// What ends every execute handler's binding: lax.axis_index of the EP axis, then the results as they come, each
// found by its name in kTargets. A finish binds its start's output(s) before it: only its place in XLA's graph.
template <typename Binding>
auto WithAxisIndex(Binding binding) {
  return std::move(binding).template Arg<I32Scalar>().RemainingRets();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatch, jax_ep::Dispatch, WithAxisIndex(BindDispatch()), {kCommandBuffers});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchStart, jax_ep::DispatchStart, WithAxisIndex(BindDispatch()),
                              {kCommandBuffers});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpDispatchFinish, jax_ep::DispatchFinish,
                              WithAxisIndex(BindDispatch()
                                                .Arg<I32Matrix>()    // the start's token_dest_pos
                                                .Arg<I32Matrix>()),  // the start's slot_dest
                              {kCommandBuffers});

// The backward pass of combine's inputs, shared by the whole op and its two halves.
auto BindCombineBackward() {
  return BindGroupCall()
      .Arg<ffi::AnyBuffer>()  // g [T, H]: the cotangent of combine's output
      .Arg<ffi::AnyBuffer>()  // y [N, H], or [N, 0] without weights (y is then not read)
      .Arg<F32Vector>()       // weights [N], or [0] for weight 1
      .Arg<I32Matrix>()       // token_dest_pos [T, R]
      .Arg<I32Cube>()         // recv_rows [R, T, K]
      .Arg<I32Vector>()       // recv_counts [R]
      .Arg<I32Vector>();      // row_slot [N]
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineBackward, jax_ep::CombineBackward, WithAxisIndex(BindCombineBackward()),
                              {kCommandBuffers});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineBackwardStart, jax_ep::CombineBackwardStart,
                              WithAxisIndex(BindCombineBackward()), {kCommandBuffers});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineBackwardFinish, jax_ep::CombineBackwardFinish,
                              WithAxisIndex(BindCombineBackward().Arg<F32Vector>()),  // the start's sent
                              {kCommandBuffers});

// Combine's inputs after its attributes, shared by the whole op and its two halves.
template <typename Binding>
auto WithCombineArgs(Binding binding) {
  return std::move(binding).template Arg<ffi::AnyBuffer>()  // y [N, H]
      .template Arg<F32Vector>()                 // weights [N], or [0] for weight 1
      .template Arg<F32Vector>()                 // row_values [N], or [0]
      .template Arg<I32Cube>()                   // recv_rows [R, T, K]
      .template Arg<I32Vector>()                 // recv_counts [R]
      .template Arg<I32Matrix>()                 // token_dest_pos [T, R]
      .template Arg<I32Matrix>();                // slot_dest [T, K]
}

// partial_f32: partial sums travel as float32, else in y's dtype. stage_own (the halves): the start stages this
// rank's own partial sums, and the finish needs no y.
auto BindSplitCombine() { return WithCombineArgs(BindGroupCall().Attr<bool>("partial_f32").Attr<bool>("stage_own")); }

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombine, jax_ep::Combine,
                              WithAxisIndex(WithCombineArgs(BindGroupCall().Attr<bool>("partial_f32"))),
                              {kCommandBuffers});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineStart, jax_ep::CombineStart, WithAxisIndex(BindSplitCombine()),
                              {kCommandBuffers});
XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpCombineFinish, jax_ep::CombineFinish,
                              WithAxisIndex(BindSplitCombine().Arg<F32Vector>()),  // the start's sent
                              {kCommandBuffers});

extern "C" XLA_FFI_TypeId* JaxEpGroupStateTypeId() { return &jax_ep::GroupState::id; }

extern "C" const XLA_FFI_TypeInfo* JaxEpGroupStateTypeInfo() {
  static const XLA_FFI_TypeInfo info = ffi::MakeTypeInfo<jax_ep::GroupState>();
  return &info;
}
