// Device-side layout of the exchange's signals and the launcher of the exchange kernels.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace jax_ep {

constexpr int kMaxRanks = 64;

// Lives in each GPU's memory. Peers write arrive/data/counts_in; the owner reads them.
struct Signals {
  uint64_t arrive[kMaxRanks];    // epoch at which rank r entered the current exchange
  uint64_t data[kMaxRanks];      // epoch at which rank r finished writing its rows here
  int32_t counts_in[2][kMaxRanks];  // rows rank r sends here, double-buffered by epoch parity
  uint64_t epoch;                // exchanges completed by this GPU
  uint32_t blocks_done[2];       // last-block detection of the send and receive kernels
  int32_t timed_out;             // set when a wait gave up; the exchange's output is then invalid
};

struct PeerTable {
  char* recv_buffer[kMaxRanks];
  Signals* signals[kMaxRanks];
};

// All-to-all of rows: send [R, rows, row_bytes] and send_counts [R] (rows to send to each rank) on
// every rank of the group; recv [R, rows, row_bytes] gets rank r's rows in recv[r], and
// recv_counts [R] their number. Rows past recv_counts[r] are left unwritten.
cudaError_t LaunchExchange(const char* send, const int32_t* send_counts, char* recv, int32_t* recv_counts,
                           int64_t rows, int64_t row_bytes, int rank, int num_ranks, const char* own_buffer,
                           Signals* signals, const PeerTable* peers, int64_t timeout_cycles, cudaStream_t stream);

}  // namespace jax_ep
