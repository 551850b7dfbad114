// FFI handler of the routing-layout step: checks buffers and attributes, then launches the kernel.
#include <string>

#include "handlers.h"
#include "kernels.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

// Aliases keep commas out of the handler-definition macro.
using I32Scalar = ffi::Buffer<ffi::S32, 0>;
using I32Vector = ffi::Buffer<ffi::S32, 1>;
using I32Matrix = ffi::Buffer<ffi::S32, 2>;

namespace jax_ep {
namespace {

std::string Dims(ffi::Span<const int64_t> dims) {
  std::string text = "[";
  for (size_t i = 0; i < dims.size(); ++i) text += (i ? ", " : "") + std::to_string(dims[i]);
  return text + "]";
}

ffi::Error ShapeError(const char* name, const std::string& expected, ffi::Span<const int64_t> actual) {
  return ffi::Error::InvalidArgument(std::string("jax_ep_routing_layout: ") + name + " must have shape " + expected +
                                     ", got " + Dims(actual));
}

ffi::Error RoutingLayoutImpl(cudaStream_t stream, int64_t num_experts, int64_t num_ranks,
                             ffi::Buffer<ffi::S32, 2> topk_idx, ffi::ResultBuffer<ffi::S32, 2> token_dest_pos,
                             ffi::ResultBuffer<ffi::S32, 1> rank_token_count,
                             ffi::ResultBuffer<ffi::S32, 1> expert_count, ffi::ResultBuffer<ffi::S32, 2> slot_rank,
                             ffi::ResultBuffer<ffi::S32, 0> num_invalid) {
  if (num_ranks < 1 || num_experts < 1 || num_experts % num_ranks != 0) {
    return ffi::Error::InvalidArgument("jax_ep_routing_layout: num_experts must be a positive multiple of num_ranks, "
                                       "got num_experts=" + std::to_string(num_experts) +
                                       ", num_ranks=" + std::to_string(num_ranks));
  }
  const int64_t num_tokens = topk_idx.dimensions()[0];
  const int64_t topk = topk_idx.dimensions()[1];
  const std::string tr = "[" + std::to_string(num_tokens) + ", " + std::to_string(num_ranks) + "]";
  if (token_dest_pos->dimensions()[0] != num_tokens || token_dest_pos->dimensions()[1] != num_ranks) {
    return ShapeError("token_dest_pos", tr, token_dest_pos->dimensions());
  }
  if (rank_token_count->dimensions()[0] != num_ranks) {
    return ShapeError("rank_token_count", "[" + std::to_string(num_ranks) + "]", rank_token_count->dimensions());
  }
  if (expert_count->dimensions()[0] != num_experts) {
    return ShapeError("expert_count", "[" + std::to_string(num_experts) + "]", expert_count->dimensions());
  }
  if (slot_rank->dimensions()[0] != num_tokens || slot_rank->dimensions()[1] != topk) {
    return ShapeError("slot_rank", Dims(topk_idx.dimensions()), slot_rank->dimensions());
  }
  const cudaError_t status = LaunchRoutingLayout(
      topk_idx.typed_data(), num_tokens, topk, num_experts, num_ranks, token_dest_pos->typed_data(),
      rank_token_count->typed_data(), expert_count->typed_data(), slot_rank->typed_data(),
      num_invalid->typed_data(), stream);
  if (status != cudaSuccess) {
    return ffi::Error::Internal(std::string("jax_ep_routing_layout: kernel launch failed: ") +
                                cudaGetErrorString(status));
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace jax_ep

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxEpRoutingLayout, jax_ep::RoutingLayoutImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::PlatformStream<cudaStream_t>>()
                                  .Attr<int64_t>("num_experts")      // E
                                  .Attr<int64_t>("num_ranks")        // R
                                  .Arg<I32Matrix>()   // topk_idx [T, K]
                                  .Ret<I32Matrix>()   // token_dest_pos [T, R]
                                  .Ret<I32Vector>()   // rank_token_count [R]
                                  .Ret<I32Vector>()   // expert_count [E]
                                  .Ret<I32Matrix>()   // slot_rank [T, K]
                                  .Ret<I32Scalar>(),  // num_invalid []
                              {ffi::Traits::kCmdBufferCompatible});
