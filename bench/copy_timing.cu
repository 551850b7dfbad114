// The benchmarks' yardsticks: the seconds of a peer copy and of a fill, timed with CUDA events. Only the CUDA
// runtime, and a C interface: bench/copy_timing.py compiles this file with nvcc into a shared library on first use
// and calls it through ctypes, so that none of it ships in jax_ep's wheel.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace {

void Check(cudaError_t status, const char* what) {
  if (status != cudaSuccess) throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(status));
}

// What a timing helper made (device memory, a stream, events) and the device it found current: released and
// restored on every path out, a thrown error included.
struct TimingScratch {
  int saved_device = 0;
  std::vector<std::pair<int, void*>> buffers;  // (device, pointer)
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  TimingScratch() { cudaGetDevice(&saved_device); }
  ~TimingScratch() {
    if (start) cudaEventDestroy(start);
    if (stop) cudaEventDestroy(stop);
    if (stream) cudaStreamDestroy(stream);
    for (const auto& [device, pointer] : buffers) {
      cudaSetDevice(device);
      cudaFree(pointer);
    }
    cudaSetDevice(saved_device);
  }
  void* Allocate(int device, size_t bytes) {
    void* pointer = nullptr;
    Check(cudaSetDevice(device), "cudaSetDevice");
    Check(cudaMalloc(&pointer, bytes), "cudaMalloc");
    buffers.emplace_back(device, pointer);
    return pointer;
  }
};

// Seconds per call of enqueue(stream) on the current device: 3 warm-up calls, then the mean of `iters` between
// two CUDA events.
template <typename Enqueue>
double SecondsPer(TimingScratch& scratch, int iters, Enqueue enqueue) {
  Check(cudaStreamCreate(&scratch.stream), "cudaStreamCreate");
  Check(cudaEventCreate(&scratch.start), "cudaEventCreate");
  Check(cudaEventCreate(&scratch.stop), "cudaEventCreate");
  for (int i = 0; i < 3; ++i) enqueue(scratch.stream);
  Check(cudaEventRecord(scratch.start, scratch.stream), "cudaEventRecord");
  for (int i = 0; i < iters; ++i) enqueue(scratch.stream);
  Check(cudaEventRecord(scratch.stop, scratch.stream), "cudaEventRecord");
  Check(cudaEventSynchronize(scratch.stop), "cudaEventSynchronize");
  float ms = 0;
  Check(cudaEventElapsedTime(&ms, scratch.start, scratch.stop), "cudaEventElapsedTime");
  return ms / 1e3 / iters;
}

// Fills device memory with pseudo-random bytes (a 64 MiB block, repeated), so that nothing in the memory system
// could make a copy of it cheaper than a copy of real data.
void FillRandom(void* device_pointer, size_t bytes) {
  std::vector<uint64_t> block(std::min<size_t>(bytes, size_t{64} << 20) / 8 + 1);
  std::mt19937_64 random(12345);
  for (uint64_t& word : block) word = random();
  char* to = static_cast<char*>(device_pointer);
  for (size_t at = 0; at < bytes; at += block.size() * 8) {
    Check(cudaMemcpy(to + at, block.data(), std::min(block.size() * 8, bytes - at), cudaMemcpyHostToDevice),
          "cudaMemcpy");
  }
}

// Runs `measure`, storing its seconds; on an error, its message goes to `error` (`error_size` bytes) and the
// result is 1.
template <typename Measure>
int Report(Measure measure, double* seconds, char* error, size_t error_size) {
  try {
    *seconds = measure();
    return 0;
  } catch (const std::exception& e) {
    std::snprintf(error, error_size, "%s", e.what());
    return 1;
  }
}

}  // namespace

extern "C" {

// Seconds per cudaMemcpyPeerAsync of `bytes` from GPU src to GPU dst: the yardstick the benchmarks compare the
// exchange with. With src == dst, a device-to-device copy on one GPU.
int jax_ep_bench_peer_copy_seconds(int src, int dst, size_t bytes, int iters, double* seconds, char* error,
                                   size_t error_size) {
  return Report(
      [&] {
        TimingScratch scratch;
        void* to = scratch.Allocate(dst, bytes);
        void* from = scratch.Allocate(src, bytes);
        FillRandom(from, bytes);
        cudaDeviceEnablePeerAccess(dst, 0);
        cudaGetLastError();  // already enabled, or the same GPU: not an error here
        return SecondsPer(scratch, iters, [&](cudaStream_t stream) {
          Check(cudaMemcpyPeerAsync(to, dst, from, src, bytes, stream), "cudaMemcpyPeerAsync");
        });
      },
      seconds, error, error_size);
}

// Seconds per cudaMemsetAsync of `bytes` on GPU `device`: writes only, the ceiling of an op that mostly writes.
int jax_ep_bench_fill_seconds(int device, size_t bytes, int iters, double* seconds, char* error, size_t error_size) {
  return Report(
      [&] {
        TimingScratch scratch;
        void* to = scratch.Allocate(device, bytes);
        int value = 0;
        return SecondsPer(scratch, iters, [&](cudaStream_t stream) {
          Check(cudaMemsetAsync(to, 0x40 + (value++ & 0x1f), bytes, stream), "cudaMemsetAsync");
        });
      },
      seconds, error, error_size);
}

}  // extern "C"
