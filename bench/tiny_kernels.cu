// The floor of a kernel under Nsight Compute on this GPU: empty and tiny kernels, three launches of each.
//   nvcc -O3 -arch=sm_90 -o /tmp/tiny bench/tiny_kernels.cu
//   ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base /tmp/tiny
// Results: docs/maintainers/performance_notes.md, "How to measure" (the file is in git history:
// bench/results/routing_one_block_stamps_9c1583c_h200x1.json at 9d8ef05).
#include <cstdio>
__global__ void Empty() {}
__global__ void LoadStore(const int* in, int* out) {
  out[threadIdx.x + blockIdx.x * blockDim.x] = in[threadIdx.x + blockIdx.x * blockDim.x] + 1;
}
__global__ void Syncs(const int* in, int* out) {
  __shared__ int s[1024];
  int v = in[threadIdx.x];
  s[threadIdx.x] = v; __syncthreads();
  v += s[(threadIdx.x + 1) % blockDim.x]; __syncthreads();
  s[threadIdx.x] = v; __syncthreads();
  v += s[(threadIdx.x + 7) % blockDim.x]; __syncthreads();
  out[threadIdx.x] = v;
}
__global__ void Atomic(unsigned* c, int* out) {  // LastBlock's pattern
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned o = atomicAdd(c, 1u);
    if (o == gridDim.x - 1) {
      *c = 0;
      out[0] = 1;
    }
  }
}
int main() {
  int *in, *out; unsigned* c;
  cudaMalloc(&in, 1 << 24); cudaMalloc(&out, 1 << 24); cudaMalloc(&c, 4);
  cudaMemset(in, 1, 1 << 24); cudaMemset(c, 0, 4);
  for (int r = 0; r < 3; ++r) {
    Empty<<<1, 32>>>();
    Empty<<<1, 1024>>>();
    Empty<<<113, 1024>>>();
    LoadStore<<<1, 1024>>>(in, out);
    LoadStore<<<113, 1024>>>(in, out);
    Syncs<<<1, 1024>>>(in, out);
    Atomic<<<113, 1024>>>(c, out);
  }
  cudaDeviceSynchronize();
  printf("done %d\n", (int)cudaGetLastError());
}
