#!/usr/bin/env bash
# On the GPU machine: build the extension, then run the GPU tests or the benchmarks (each fits one 10-minute
# device call), writing results under $OUT (8 files at most: what the device tool brings back).
#   JAX_EP_COMMIT=<sha> bash bench/device_run.sh tests
#   JAX_EP_COMMIT=<sha> bash bench/device_run.sh bench [python -m jax_ep.bench arguments; default --suite training --no-ragged]
# Benchmarks: the given one (peer stores over NVLink), the training shape through NCCL (--transport nccl) and with
# P2P off (--p2p-off), and one process per GPU with P2P and with P2P off.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export JAX_EP_COMMAND="bash bench/device_run.sh $*"
OUT=${OUT:-/tmp/jax_ep_out}
mkdir -p "$OUT"
quiet() { grep -v -E "cuda_executor|Source Location|external/xla|^\s*@ 0x|^$|^===" | tee -a "$OUT/bench.log"; }
nvidia-smi topo -m 2>&1 | quiet
if ! python3 -m pip install --no-build-isolation --no-deps -v -e . > "$OUT/build.log" 2>&1; then
  tail -60 "$OUT/build.log"
  exit 1
fi
grep "jax_ep:" "$OUT/build.log" | quiet
rm "$OUT/build.log"
stage=${1:-tests}
[ $# -gt 0 ] && shift
if [ "$stage" = tests ]; then
  # A short check of the NCCL path first: a hang there would otherwise eat the whole call.
  if ! timeout 150 python3 -m pytest -x -q tests/test_cuda_backend.py -k "nccl and (transport_asked or uniform-512)" \
      2>&1 | quiet; then
    echo "NCCL smoke test failed"
    exit 1
  fi
  files=()  # those of this tree: later versions dropped some
  for name in test_cuda_layout.py test_cuda_backend.py test_cuda_multiprocess.py test_cuda_trace.py; do
    [ -f "tests/$name" ] && files+=("tests/$name")
  done
  timeout 400 python3 bench/gpu_tests.py "$OUT/gpu_tests.json" "${files[@]}" 2>&1 | grep -v "^\s*@ 0x" \
    > "$OUT/tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests.log"
  exit 0
fi
bench_args=("$@")
[ ${#bench_args[@]} -eq 0 ] && bench_args=(--suite training --no-ragged)
# Each result names this script and the exact benchmark command it ran.
bench() {
  local limit=$1 module=$2 out=$3
  shift 3
  JAX_EP_COMMAND="bash bench/device_run.sh bench: python -m $module OUT/$out $*" \
    timeout "$limit" python3 -m "$module" "$OUT/$out" "$@" 2>&1 | quiet
}
bench 300 jax_ep.bench bench.json "${bench_args[@]}"
bench 120 jax_ep.bench bench_transport_nccl.json --suite training --no-ragged --transport nccl
bench 120 jax_ep.bench bench_p2p_off.json --suite training --no-ragged --p2p-off
bench 120 jax_ep.bench.multiprocess multiprocess.json --timeout 110
bench 120 jax_ep.bench.multiprocess multiprocess_p2p_off.json --timeout 110 --p2p-off
