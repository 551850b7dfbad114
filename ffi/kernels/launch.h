// The kernels' side of jax_ep: the group memory they share, the staging layout, and the launchers.
// Raw pointers and a stream only: no XLA or nanobind headers here.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <functional>
#include <string>

#include "../status.h"

#ifdef __CUDACC__
#define JAX_EP_HOST_DEVICE __host__ __device__
#else
#define JAX_EP_HOST_DEVICE
#endif

namespace jax_ep {

constexpr int kMaxRanks = 64;
constexpr int kMaxTopk = 64;         // a token's rows are sorted and held in shared memory
constexpr int64_t kMaxExperts = 8192;  // the receivers' row tables live in shared memory

// The kernels' limits on a call's sizes, checked once by each launcher (the Python side reads kMaxTopk and
// kMaxExperts through the extension's limits()); num_experts 0: a call that does not route.
inline Status CheckLimits(int64_t topk, int64_t num_experts) {
  if (topk <= kMaxTopk && num_experts <= kMaxExperts) return Status::Ok();
  return Status::InvalidArgument("topk must be at most " + std::to_string(kMaxTopk) + " and num_experts at most " +
                                 std::to_string(kMaxExperts) + ", got topk=" + std::to_string(topk) +
                                 ", num_experts=" + std::to_string(num_experts));
}

// row_slot of a layout row that holds no slot: inside the data (alignment padding, the expert layout's unused
// rows), whose x and dy are zeros, or past the data (the ragged tail), whose x and dy no kernel writes.
constexpr int32_t kNoSlot = -1;
constexpr int32_t kPastData = -2;

// What a call is: flags carry its tag, (call number << 24 | call site << 8 | op), so a wait can tell another
// call's data from its own, also another call at the same position (ranks that took different branches).
enum Op : uint32_t { kOpDispatch = 1, kOpCombineBackward = 2, kOpCombine = 3 };
constexpr int kTagSiteShift = 8;
constexpr int kTagNumberShift = 24;
JAX_EP_HOST_DEVICE inline uint64_t TagOf(uint64_t number, uint32_t site, uint32_t op) {
  return (number << kTagNumberShift) | (static_cast<uint64_t>(site & 0xffff) << kTagSiteShift) | (op & 0xff);
}

// FFI instances (one per jax_ep call of each compiled executable) whose first call this GPU remembers having made.
constexpr uint32_t kMaxInstances = uint32_t{1} << 16;

// Where a call comes from: its call site (16 bits the Python side derives from the calling code, the same on every
// rank, in the tag) and its FFI instance (numbered by this process, modulo kMaxInstances): the first call of an
// instance waits the group's first-call timeout, since processes may finish compiling it minutes apart.
struct CallOrigin {
  uint32_t site = 0;
  uint32_t instance = 0;
  bool split_start = false;  // a split op's start (set by its launcher): its instance's call ends when it opens it
};

// Why a call failed, in HostStatus::code and in the abort word.
enum FailCode : int32_t {
  kOk = 0,
  kMissingPeer = 1,  // a wait for `peer` passed the group's timeout
  kOutOfOrder = 2,   // `peer` ran another jax_ep call of the group at this position (another op, or call site)
  kWrongRank = 3,    // lax.axis_index differed from the rank the group gave this GPU
  kNcclTimeout = 5,  // an NCCL swap did not finish within the timeout (the watchdog aborted the communicator)
  kSplitOpen = 6,    // a call met a split op's start without its finish (or a finish without its start)
  kStaleRegion = 7,  // the region `peer` sent through NCCL lacked this call's tag: that rank gave up on the call
  kNcclFailed = 8,   // an NCCL call of a swap returned an error (the call that met it names it); communicator aborted
};

// What one launch of a transfer does: the whole call, or one half of a split op. A start sends and leaves the
// call open (Signals::open) until its finish receives; the group may run no other call in between.
enum class Phase { kWhole, kStart, kFinish };

// SMs that the transfer kernels of a group of several GPUs leave free unless jax_ep.initialize's num_sms says
// otherwise (at most half the GPU's).
constexpr int kSmsLeft = 32;

// The SM budget of a group of `num_ranks` GPUs on a GPU of `device_sms` SMs when num_sms is not given: kSmsLeft
// left to the kernels that run beside its own (XLA's collectives need SMs on every GPU to finish, and compute may
// overlap the exchange); a group of one GPU waits for nobody and takes every SM.
inline int DefaultNumSms(int device_sms, int num_ranks) {
  return num_ranks > 1 ? std::max(device_sms - kSmsLeft, (device_sms + 1) / 2) : device_sms;
}

// Lives in each GPU's memory; peers write flag[][me] and abort.
struct Signals {
  uint64_t flag[2][kMaxRanks];  // [call parity][source]: tag of the call whose data `source` finished storing here
  uint64_t abort;               // 0, or AbortWord(code, reporter, peer): the group is out of step
  uint64_t told[kMaxRanks];     // [source]: the tag of source's own call when it set abort here (Fail)
  uint64_t calls;               // calls of the group completed on this GPU
  uint64_t open;                // tag of the call whose start ran and whose finish has not, else 0
  uint32_t send_next;           // the next share of a send phase to claim (SendShares)
  uint32_t send_done;           // shares of a send phase finished (last-share detection)
  uint32_t kernel_done;         // blocks of a call's last launch that have checked the call (ArriveCall)
  uint32_t routing_done;        // ... of the routing kernel
  uint32_t reported;            // 1 once a thread claimed the host status (Report)
  uint32_t first_done[kMaxInstances / 32];  // bit i: a call of FFI instance i finished on this GPU
};

// Pinned host memory, mapped for the kernels: the first failure on this GPU, for the handlers and Group.check.
struct HostStatus {
  int32_t code;          // FailCode
  int32_t peer;          // the rank the failure is about
  int32_t reporter;      // the rank that saw it
  int32_t op;            // Op of the failed call
  int32_t relayed;       // 1: `reporter` is another rank, which saw the failure first and told this one
  uint64_t call;         // its call number
  uint64_t tag;          // its tag
  uint64_t seen;         // the flag value a wait saw last; relayed: the reporter's own call tag (Signals::told)
  uint64_t nccl_started;  // call number of the latest NCCL swap enqueued (written by the send kernel)
  uint64_t nccl_done;     // ... of the latest one finished (written by the receive kernel)
  int32_t nccl_first;     // 1: the latest swap enqueued is the first call of its FFI instance (first-call timeout)
};

struct PeerTable {
  char* staging[kMaxRanks];
  Signals* signals[kMaxRanks];
};

// Where a kernel finds this GPU's group; the same on every call, so captured graphs stay valid.
struct GroupView {
  int rank;
  int num_ranks;
  int max_blocks;          // SM budget of jax_ep.initialize: one block of kThreads per SM at most
  char* staging;           // this GPU's two staging halves of half_bytes
  int64_t half_bytes;
  Signals* signals;        // this GPU's signals
  const PeerTable* peers;  // device copy of every rank's staging and signals
  HostStatus* status;      // device address of the host-mapped status
  uint64_t timeout_ns;     // give up waiting for a peer after this long
  uint64_t first_timeout_ns;  // ... in the first call of an FFI instance: processes may finish compiling minutes apart
  uint64_t nccl_ranks;     // bit r: rank r is reached through NCCL, not by peer stores
  char* outbox;            // rows for NCCL ranks: region d goes to rank d (null without NCCL ranks)
  char* inbox;             // rows from NCCL ranks: region s came from rank s (the swap is stream-ordered)
  int32_t* scratch;        // routing scratch (RoutingScratch)
  int64_t scratch_ints;
};

// A divisor fixed at launch: n / value for 0 <= n < 2^31 as a multiply-high and a shift. The small calls are
// latency-bound, and a division by a runtime value is a dependent chain of about 20 instructions.
struct Divisor {
  int32_t value = 1;
  uint32_t multiplier = 0;  // 0: value 1
  uint32_t shift = 0;
  Divisor() = default;
  explicit Divisor(int64_t divisor) : value(static_cast<int32_t>(divisor)) {
    if (divisor <= 1) return;
    uint32_t log2 = 0;  // ceil(log2(divisor))
    while ((int64_t{1} << log2) < divisor) ++log2;
    const uint32_t p = 31 + log2;
    multiplier = static_cast<uint32_t>(((uint64_t{1} << p) + static_cast<uint64_t>(divisor) - 1) / divisor);
    shift = p - 32;
  }
  JAX_EP_HOST_DEVICE int32_t Divide(int32_t n) const {
    if (multiplier == 0) return n;
#ifdef __CUDA_ARCH__
    return static_cast<int32_t>(__umulhi(static_cast<uint32_t>(n), multiplier) >> shift);
#else
    return static_cast<int32_t>(((static_cast<uint64_t>(n) * multiplier) >> 32) >> shift);
#endif
  }
};

JAX_EP_HOST_DEVICE inline bool ByNccl(uint64_t nccl_ranks, int rank) { return (nccl_ranks >> rank) & 1; }

// Every region starts with 16 bytes whose first 8 hold the call's tag when it travels through NCCL.
constexpr int64_t kRegionHeader = 16;

// Bytes of one source's region of a staging half for a dispatch of T tokens of `row_bytes` (K slots, L local
// experts): the header, its L + 1 counts, K (expert, rank, weight) triples per token, then the token rows.
struct DispatchRegion {
  int64_t counts = 0, meta = 0, rows = 0, stride = 0, bytes = 0;
  DispatchRegion() = default;
  DispatchRegion(int64_t num_tokens, int64_t topk, int64_t local_experts, int64_t row_bytes) {
    counts = kRegionHeader;
    meta = counts + (local_experts + 1 + 3) / 4 * 16;
    rows = meta + (num_tokens * topk * 12 + 15) / 16 * 16;
    stride = (row_bytes + 15) / 16 * 16;
    bytes = rows + num_tokens * stride;
  }
};

// ... for a combine: the header, K slot values per token (the backward pass of dispatch), then the partial sums.
struct CombineRegion {
  int64_t values = 0, rows = 0, stride = 0, bytes = 0;
  CombineRegion() = default;
  CombineRegion(int64_t num_tokens, int64_t topk, int64_t partial_row_bytes) {
    values = kRegionHeader;
    rows = values + (num_tokens * topk * 4 + 15) / 16 * 16;
    stride = (partial_row_bytes + 15) / 16 * 16;
    bytes = rows + num_tokens * stride;
  }
};

// Staging bytes per GPU for calls of up to these sizes (jax_ep.buffer_size_hint): two halves (a call never
// overwrites what a peer may still read of the call before), each a region per source rank. The dispatch's region
// is the largest: a combine's, for the same row bytes, has 4 bytes per slot where it has 12, and no counts.
inline int64_t StagingBytes(int64_t num_ranks, int64_t num_tokens, int64_t row_bytes, int64_t topk,
                            int64_t local_experts) {
  return 2 * num_ranks * DispatchRegion(num_tokens, topk, local_experts, row_bytes).bytes;
}

// The routing kernel's scratch (int32 offsets) for T tokens, K slots, E experts and R ranks.
struct RoutingScratch {
  int64_t tokens_per_chunk = 1, chunks = 0, warps = 0;
  int chunk_shift = 0;  // tokens_per_chunk = 1 << chunk_shift
  int64_t slot_local = 0, token_local = 0, chunk_expert = 0, chunk_rank = 0, chunk_invalid = 0, expert_count = 0,
          rank_count = 0, num_invalid = 0;
  int64_t ints = 0;
  RoutingScratch() = default;
  RoutingScratch(int64_t num_tokens, int64_t topk, int64_t num_experts, int64_t num_ranks);
};

// Bytes of GPU memory jax_ep.initialize allocates on each GPU of a group for calls of up to these sizes
// (jax_ep.buffer_size_hint): the staging, as much again for the outbox and inbox with ranks reached through NCCL,
// the routing scratch, the signals and the peer table.
inline int64_t DeviceBytes(int64_t num_ranks, int64_t num_tokens, int64_t row_bytes, int64_t topk, int64_t num_experts,
                           bool nccl) {
  const int64_t local_experts = num_experts / num_ranks > 1 ? num_experts / num_ranks : 1;
  const int64_t staging = StagingBytes(num_ranks, num_tokens, row_bytes, topk, local_experts);
  const int64_t scratch = RoutingScratch(num_tokens, topk, num_experts, num_ranks).ints * 4;
  return staging * (nccl ? 2 : 1) + scratch + static_cast<int64_t>(sizeof(Signals) + sizeof(PeerTable));
}

// What a transfer enqueues between its send and receive kernels when some ranks are reached through NCCL:
// region d of the outbox goes to rank d, and rank d's region lands in region d of the inbox.
using NcclSwap = std::function<Status(int64_t region_bytes)>;

enum class FloatType { kF32, kBF16, kF16 };

// A call's outputs, one struct per op and phase, their fields in the order of the results of the op's spec in
// jax_ep/ep/cuda.py (the handlers fill them in that order).
// What a dispatch's receive phase writes (RECEIVED): the layout's rows and their weights, the sizes, and the
// receive side of the handle.
struct DispatchReceived {
  char* x;               // [N, row_bytes]
  float* weights;        // [N]
  int32_t* group_sizes;  // [L]
  int32_t* num_dropped;  // []
  int32_t* num_invalid;  // []
  int32_t* expert_load;  // [L]: slots routed to each local expert, before capacity
  int32_t* send_counts;  // [R]
  int32_t* recv_rows;    // [R, T, K]
  int32_t* recv_counts;  // [R]
  int32_t* row_slot;     // [N]
};
constexpr size_t kDispatchReceived = 10;
// What its routing writes (ROUTED): a whole call's, or a start's.
struct DispatchRouted {
  int32_t* token_dest_pos;  // [T, R]
  int32_t* slot_dest;       // [T, K]
};
constexpr size_t kDispatchRouted = 2;
// Combine (COMBINED).
struct CombineOutputs {
  void* out;           // [T, H] in y's type
  float* slot_values;  // [T, K], with row values, else null
};
// The backward pass of combine (BACKWARD).
struct CombineBackwardOutputs {
  void* dy;         // [N, H] in y's type
  float* dweights;  // [N], with weights, else null
};
static_assert(sizeof(DispatchReceived) == kDispatchReceived * sizeof(void*) &&
              sizeof(DispatchRouted) == kDispatchRouted * sizeof(void*));

// Dispatch: routing of topk_idx and the tokens' trip into the layout. x is [T, row_bytes]; the layout has num_rows
// rows of row_bytes. A start writes the routed outputs (the received are null), a finish the received (the routed
// are null); balanced: capacity's drop policy "balanced" (ragged layout), else "expert".
struct DispatchCall {
  CallOrigin origin;
  const char* x;
  const int32_t* topk_idx;
  const float* topk_weights;
  const int32_t* axis_index;
  int64_t num_tokens, row_bytes, topk, num_experts, capacity, alignment, num_rows;
  bool expert_layout;
  bool balanced = false;
  DispatchReceived received{};
  DispatchRouted routed{};
  float* sent = nullptr;  // [1], a start's output (written 0), else null
};
Status LaunchDispatch(const DispatchCall& call, const GroupView& group, const NcclSwap& swap, cudaStream_t stream,
                      Phase phase);

// The backward pass of combine: each token's cotangent g [T, H] goes along the handle's routing to the rows
// it reached, where dy = w * g (y's type) and dweights = <g, y[row]> (float32) are computed; rows that hold no
// slot get 0. Without weights: dy = g and no dweights.
struct CombineBackwardCall {
  CallOrigin origin;
  const void* g;            // [T, H], y's type
  const void* y;            // [N, H]
  const float* weights;     // [N] or null
  const int32_t* axis_index;
  const int32_t *token_dest_pos, *recv_rows, *recv_counts, *row_slot;
  int64_t num_tokens, hidden, topk, num_rows;
  FloatType type;
  CombineBackwardOutputs outputs{};  // null in a start
  float* sent = nullptr;             // [1], a start's output (written 0): what its finish waits on in XLA's graph
};
Status LaunchCombineBackward(const CombineBackwardCall& call, const GroupView& group, const NcclSwap& swap,
                             cudaStream_t stream, Phase phase);

// Combine: partial sums in row order to their source ranks, summed there in rank order. With row_values,
// also every slot's row value (the backward pass of dispatch). A start writes only `sent`. With stage_own (a
// split combine whose finish has no y: the backward pass of dispatch_start), the start stages this rank's own
// partial sums too, and the finish reads only token_dest_pos and slot_dest (the other inputs may be null).
struct CombineCall {
  CallOrigin origin;
  const void* y;
  const float* weights;     // [N] or null (weight 1)
  const float* row_values;  // [N] or null
  const int32_t* axis_index;
  const int32_t *recv_rows, *recv_counts, *token_dest_pos, *slot_dest;
  int64_t num_tokens, hidden, topk;
  FloatType type;
  bool partial_f32;  // partial sums travel as float32 (else in y's type)
  bool stage_own;
  CombineOutputs outputs{};  // null in a start
  float* sent = nullptr;     // [1], a start's output
};
Status LaunchCombine(const CombineCall& call, const GroupView& group, const NcclSwap& swap, cudaStream_t stream,
                     Phase phase);

// Sets the kernels' shared-memory limits and loads every kernel; once per process, before any launch.
Status PrepareKernels();
Status PrepareCombineKernels();
Status PrepareCombineBackwardKernels();

// A split dispatch's start with nothing to send (a group of one GPU, a routing of one chunk) is the routing
// kernel alone: it checks the call, writes link (0) and leaves the call open, as the send kernel would.
struct RoutingStart {
  const int32_t* axis_index = nullptr;  // null: a plain routing
  float* link = nullptr;
  CallOrigin origin;
};

// The routing scratch `s` fits the group's (routing.cu).
Status CheckRouting(const RoutingScratch& s, const GroupView& group);

// The dispatch's first kernel (routing.cu), unless the dispatch kernel routes: slot_dest, the routing scratch and,
// when the routing is one chunk, token_dest_pos.
Status LaunchRouting(const int32_t* topk_idx, int64_t num_tokens, int64_t topk, int64_t num_experts,
                     const GroupView& group, int32_t* slot_dest, int32_t* token_dest_pos, RoutingStart start,
                     cudaStream_t stream);
Status PrepareRoutingKernel();

}  // namespace jax_ep
