#!/usr/bin/env bash
# On the GPU machine: build the extension, run the GPU tests and the benchmarks, write results under $OUT
# (8 files at most: what the device tool brings back).
#   JAX_EP_COMMIT=<sha> bash bench/device_run.sh [python -m jax_ep.bench arguments; default --suite training]
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export JAX_EP_COMMAND="bash bench/device_run.sh $*"
OUT=${OUT:-/tmp/jax_ep_out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/nvidia-smi.txt"
nvidia-smi topo -m >> "$OUT/nvidia-smi.txt" 2>&1
if ! python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
grep "jax_ep:" "$OUT/build.log"
timeout 400 python3 bench/gpu_tests.py "$OUT/gpu_tests.json" tests/test_cuda_layout.py tests/test_cuda_backend.py \
  tests/test_cuda_multiprocess.py tests/test_cuda_trace.py 2>&1 | tee "$OUT/tests.log" | grep -E "PASSED|FAILED|ERROR|passed|failed"
bench_args=("$@")
[ ${#bench_args[@]} -eq 0 ] && bench_args=(--suite training)
quiet() { grep -v -E "cuda_executor|Source Location|external/xla|^\s*@ 0x|^$|^===" | tee -a "$OUT/bench.log"; }
timeout 400 python3 -m jax_ep.bench "$OUT/bench.json" "${bench_args[@]}" 2>&1 | quiet
timeout 120 python3 -m jax_ep.bench.multiprocess "$OUT/multiprocess.json" --timeout 110 2>&1 | quiet
