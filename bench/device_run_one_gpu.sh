#!/usr/bin/env bash
# On a GPU machine with one GPU: build this tree and other source trees side by side, then run the GPU tests
# that fit one GPU, or time the builds against each other (bench/compare_builds.py); results go under $OUT.
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh tests
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh bench [SOURCE ...] [-- compare_builds.py arguments]
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh profile   # kernels of one dispatch + combine (ncu)
# Each SOURCE is a jax_ep source tree named by its folder, e.g. made by
#   git archive <commit> jax_ep ffi CMakeLists.txt pyproject.toml README.md | tar -x -C .builds/<commit>
# Builds go to /tmp/jax_ep_builds/<name> with pip install --target; a later call on the same machine reuses
# those whose sources did not change.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
export JAX_EP_COMMAND="bash bench/device_run_one_gpu.sh $*"
OUT=${OUT:-/tmp/jax_ep_out}
repo=$(pwd)
builds=/tmp/jax_ep_builds
mkdir -p "$OUT" "$builds"
# Builds installed with --target find libnccl.so.2 here, not by their rpath.
LD_LIBRARY_PATH="$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export LD_LIBRARY_PATH
stage=${1:-tests}
[ $# -gt 0 ] && shift
sources=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do
  sources+=("$1")
  shift
done
[ $# -gt 0 ] && shift

build() {  # name source
  local name=$1 source=$2 hash
  hash=$(cd "$source" && find jax_ep ffi CMakeLists.txt pyproject.toml -type f -not -path "*/__pycache__/*" \
    -print0 | sort -z | xargs -0 sha256sum | sha256sum)
  [ -f "$builds/$name/.source_hash" ] && [ "$(cat "$builds/$name/.source_hash")" = "$hash" ] && return 0
  rm -rf "$builds/$name"
  if ! JAX_EP_CUDA=ON python3 -m pip install --no-build-isolation --no-deps --target "$builds/$name" "$source" \
      > "$OUT/build_$name.log" 2>&1; then
    tail -40 "$OUT/build_$name.log"
    return 1
  fi
  echo "$hash" > "$builds/$name/.source_hash"
  rm "$OUT/build_$name.log"
}

names=(current)
build current "$repo" &
pids=($!)
for source in "${sources[@]}"; do
  names+=("$(basename "$source")")
  build "$(basename "$source")" "$source" &
  pids+=($!)
done
for pid in "${pids[@]}"; do
  wait "$pid" || { echo "a build failed"; exit 1; }
done
echo "built: ${names[*]}"

cd /tmp || exit 1  # not the repository root, whose jax_ep/ has no extension
if [ "$stage" = tests ]; then
  PYTHONPATH="$builds/current" timeout 450 python3 "$repo/bench/gpu_tests.py" "$OUT/gpu_tests.json" \
    "$repo/tests/test_cuda_layout.py" "$repo/tests/test_cuda_backend.py" "$repo/tests/test_cuda_multiprocess.py" \
    2>&1 | grep -v "^\s*@ 0x" > "$OUT/tests.log"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/tests.log"
  exit 0
fi
if [ "$stage" = profile ]; then  # every kernel of one dispatch + combine, from Nsight Compute
  for tokens in 128 4096; do
    PYTHONPATH="$builds/current" timeout 200 ncu --clock-control none --metrics gpu__time_duration.sum --csv \
      --print-units base --log-file "/tmp/kernels_$tokens.csv" python3 "$repo/bench/profile_kernels.py" run \
      --tokens "$tokens" > "/tmp/profile_$tokens.log" 2>&1 || tail -20 "/tmp/profile_$tokens.log"
    PYTHONPATH="$builds/current" python3 "$repo/bench/profile_kernels.py" summarize "/tmp/kernels_$tokens.csv" \
      "$OUT/kernels_$tokens.json"
  done
  exit 0
fi
pairs=()
for name in "${names[@]}"; do pairs+=("$name=$builds/$name"); done
timeout 560 python3 "$repo/bench/compare_builds.py" "$OUT/builds.json" "${pairs[@]}" "$@" 2>&1 | tee "$OUT/bench.log" \
  | grep -v -E "cuda_executor|Source Location|external/xla|^\s*@ 0x|^$"
