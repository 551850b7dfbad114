#!/usr/bin/env bash
# On a GPU machine with one GPU: build this tree and other source trees side by side, then run the GPU tests
# that fit one GPU, or time the builds against each other (bench/compare_builds.py); results go under $OUT.
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh all       # tests, ncu profile, targets: one call, <= 9.5 min
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh tests
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh bench [SOURCE ...] [-- compare_builds.py arguments]
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh profile [SOURCE ...]  # kernels of one dispatch + combine
#                                                                    # (ncu), of this build and each SOURCE
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh details [SOURCE ...]  # Nsight Compute's sections of the
#                                                                    # T=128 dispatch and combine kernels of this build
#                                                                    # and each SOURCE, side by side
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh split     # kernels of one whole and one split step (ncu)
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh training  # kernels of one training step, cuda and xla (ncu)
#   JAX_EP_COMMIT=<sha> bash bench/device_run_one_gpu.sh sanitize  # memcheck, racecheck, synccheck, initcheck
# "all" builds this tree only, then runs, each step under a time limit that keeps the whole within 570 s of the
# start: the GPU tests (bench/gpu_tests.py, <= 240 s), ncu's kernel times of one dispatch + combine at T=128 and
# T=4096 (bench/profile_kernels.py, <= 60 s each) and bench/one_gpu_targets.py (<= 150 s), then prints one table.
# Its files in $OUT: gpu_tests.json, kernels_128.json, kernels_4096.json, targets.json and all.log.
# Each SOURCE is a jax_ep source tree named by its folder, e.g. made by
#   git archive <commit> jax_ep ffi CMakeLists.txt pyproject.toml README.md | tar -x -C .builds/<commit>
# The GPU tests run in SHARDS pytest processes at once (default 4; bench/gpu_tests.py --shards).
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
if [ "$stage" = all ] && [ ${#sources[@]} -gt 0 ]; then
  echo "stage all builds this tree only; ignoring ${sources[*]}"
  sources=()
fi

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

cd /tmp || exit 1  # not the repository root, whose jax_ep/ has no extension: PYTHONPATH puts a build
# first and the checkout after it, for bench/, tests/ and tools/
gpu_test_files=()  # those of this tree (test_cuda_layout.py is gone in later versions)
for name in test_cuda_layout.py test_cuda_backend.py test_cuda_multiprocess.py test_division.py; do
  [ -f "$repo/tests/$name" ] && gpu_test_files+=("$repo/tests/$name")
done
if [ "$stage" = tests ]; then
  PYTHONPATH="$builds/current:$repo" timeout -s INT -k 10 450 python3 -m bench.gpu_tests "$OUT/gpu_tests.json" \
    --shards "${SHARDS:-4}" "${gpu_test_files[@]}" 2>&1 | grep -v "^\s*@ 0x" > "$OUT/tests.log"
  grep -E "PASSED|FAILED|ERROR|SKIPPED|passed|failed" "$OUT/tests.log"
  exit 0
fi
# The build that ncu_run and ncu_summary profile: BUILD (default current); another build's files end in _<its name>.
ncu_name() {  # tokens [step]
  local build=${BUILD:-current}
  echo "kernels_$1${2:+_$2}$([ "$build" = current ] || echo "_${build#.}")"
}
ncu_run() {  # tokens seconds [step]: every kernel of 3 calls of one step (default: dispatch + combine) under
  # Nsight Compute, into /tmp/kernels_<tokens>[_<step>][_<build>].csv
  local name
  name=$(ncu_name "$1" "${3:-}")
  rm -f "/tmp/$name.csv"
  PYTHONPATH="$builds/${BUILD:-current}:$repo" timeout -k 10 "$2" ncu --clock-control none --metrics gpu__time_duration.sum --csv \
    --print-units base --log-file "/tmp/$name.csv" python3 -m bench.profile_kernels run --tokens "$1" \
    --step "${3:-exchange}"
}
ncu_summary() {  # tokens [step]: the last call's kernels by op, into $OUT/kernels_<tokens>[_<step>][_<build>].json
  local name
  name=$(ncu_name "$1" "${2:-}")
  PYTHONPATH="$builds/${BUILD:-current}:$repo" timeout 60 python3 -m bench.profile_kernels summarize \
    "/tmp/$name.csv" "$OUT/$name.json" --tokens "$1" --step "${2:-exchange}"
}
if [ "$stage" = sanitize ]; then  # the four compute-sanitizer tools over bench/sanitize.py's probe, one by one
  # initcheck with XLA's command buffers off: with them on it did not finish in 110 s at 0719102 (9 s off).
  for tool in memcheck racecheck synccheck initcheck; do
    flags=$([ "$tool" = initcheck ] && echo "--xla_gpu_enable_command_buffer=")
    JAX_EP_COMMAND="XLA_FLAGS=$flags XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 python -m bench.sanitize \
OUT/sanitize_$tool.json --tools $tool --timeout 130" XLA_FLAGS=$flags XLA_PYTHON_CLIENT_MEM_FRACTION=0.25 \
      PYTHONPATH="$builds/current:$repo" timeout -k 10 145 \
      python3 -m bench.sanitize "$OUT/sanitize_$tool.json" --tools "$tool" --timeout 130 2>&1 | tail -8
  done
  exit 0
fi
if [ "$stage" = profile ]; then  # every kernel of one dispatch + combine, from Nsight Compute, of each build
  for name in "${names[@]}"; do
    for tokens in 128 4096; do
      BUILD=$name ncu_run "$tokens" 200 > "/tmp/profile_$tokens.log" 2>&1 || tail -20 "/tmp/profile_$tokens.log"
      BUILD=$name ncu_summary "$tokens"
    done
  done
  exit 0
fi
if [ "$stage" = details ]; then  # the last call's DispatchKernel and CombineKernel, five sections, per build
  csvs=()
  for name in "${names[@]}"; do
    csv=$OUT/details_128_${name#.}.csv
    PYTHONPATH="$builds/$name:$repo" timeout -k 10 150 ncu --clock-control none --launch-skip 4 --launch-count 2 \
      --kernel-name regex:"DispatchKernel|CombineKernel" --section SpeedOfLight --section LaunchStats \
      --section Occupancy --section WarpStateStats --section InstructionStats --csv --page details \
      --print-units base --log-file "$csv" python3 -m bench.profile_kernels run --tokens 128 \
      > "/tmp/details_$name.log" 2>&1 || tail -20 "/tmp/details_$name.log"
    csvs+=("$csv")
  done
  [ ${#csvs[@]} -gt 1 ] && PYTHONPATH="$repo" python3 -m bench.profile_kernels compare "${csvs[@]}" | tee "$OUT/details.txt"
  exit 0
fi
if [ "$stage" = split ]; then  # every kernel of one step at T=128, whole and split ops next to a matmul (ncu)
  for step in dispatch dispatch_split combine combine_split; do
    ncu_run 128 100 "$step" > "/tmp/profile_$step.log" 2>&1 || tail -20 "/tmp/profile_$step.log"
    ncu_summary 128 "$step"
  done
  exit 0
fi
if [ "$stage" = training ]; then  # every kernel of one training step (loss and gradients), cuda and xla (ncu)
  for tokens in 128 4096; do
    for step in training training_xla; do
      ncu_run "$tokens" 120 "$step" > "/tmp/profile_${step}_$tokens.log" 2>&1 || tail -20 "/tmp/profile_${step}_$tokens.log"
      ncu_summary "$tokens" "$step"
    done
  done
  exit 0
fi
if [ "$stage" = all ]; then
  log=$OUT/all.log
  deadline=570  # seconds since this script started ($SECONDS): 9.5 minutes in all
  noise="cuda_executor|Source Location|external/xla|^\s*@ 0x|^$|^==PROF==|^==WARNING=="
  # limit NOMINAL RESERVE: a step's seconds: NOMINAL, or fewer so that RESERVE seconds remain for the later steps
  limit() {
    local left=$((deadline - SECONDS - $2))
    echo $((left < $1 ? left : $1))
  }
  step() {  # NAME SECONDS COMMAND...: runs COMMAND under `timeout` (SIGINT, then SIGKILL 10 s later) into the log
    local name=$1 seconds=$2 rc
    shift 2
    if [ "$seconds" -lt 20 ]; then
      echo "[${SECONDS} s] $name: skipped, no time left (its limit would be ${seconds} s)" | tee -a "$log"
      return 0
    fi
    echo "[${SECONDS} s] $name (at most ${seconds} s)" | tee -a "$log"
    timeout -s INT -k 10 "$seconds" "$@" 2>&1 | grep -v -E "$noise" >> "$log"
    rc=${PIPESTATUS[0]}
    case $rc in
      124 | 137) echo "[${SECONDS} s] $name: exit $rc, stopped at its time limit" | tee -a "$log" ;;
      *) echo "[${SECONDS} s] $name: exit $rc" | tee -a "$log" ;;
    esac
  }
  export PYTHONPATH=$builds/current:$repo
  echo "[${SECONDS} s] built; commit ${JAX_EP_COMMIT:-unknown}; $(nvidia-smi --query-gpu=name --format=csv,noheader \
    2>/dev/null | head -1)" | tee "$log"
  test_names=()  # the layout tests belong to older versions
  for file in "${gpu_test_files[@]}"; do
    [ "$(basename "$file")" = test_cuda_layout.py ] || test_names+=("tests/$(basename "$file")")
  done
  # Each limit leaves the later steps their time: ncu 60 + 25 s each (SIGKILL grace, summary), targets 150 + 10 s,
  # the table 15 s; a step's own SIGKILL grace is 10 s.
  if [ ${#test_names[@]} -eq 0 ]; then
    echo "[${SECONDS} s] GPU tests: skipped, no test file" | tee -a "$log"
  else
    step "GPU tests" "$(limit 240 $((10 + 2 * 85 + 160 + 15)))" env JAX_EP_COMMAND="bash bench/device_run_one_gpu.sh \
all: python -m bench.gpu_tests OUT/gpu_tests.json --shards ${SHARDS:-4} ${test_names[*]}" \
      python3 -m bench.gpu_tests "$OUT/gpu_tests.json" --shards "${SHARDS:-4}" "${test_names[@]/#/$repo/}"
  fi
  for tokens in 128 4096; do
    seconds=$(limit 60 $((25 + (tokens == 128 ? 85 : 0) + 160 + 15)))
    if [ "$seconds" -lt 20 ]; then
      echo "[${SECONDS} s] ncu T=$tokens: skipped, no time left (its limit would be ${seconds} s)" | tee -a "$log"
      continue
    fi
    echo "[${SECONDS} s] ncu T=$tokens (at most ${seconds} s)" | tee -a "$log"
    ncu_run "$tokens" "$seconds" 2>&1 | grep -v -E "$noise" >> "$log"
    rc=${PIPESTATUS[0]}
    echo "[${SECONDS} s] ncu T=$tokens: exit $rc$([ "$rc" = 124 ] && echo ", stopped at its time limit")" \
      | tee -a "$log"
    JAX_EP_COMMAND="bash bench/device_run_one_gpu.sh all: ncu --clock-control none --metrics \
gpu__time_duration.sum --csv --print-units base python -m bench.profile_kernels run --tokens $tokens" \
      ncu_summary "$tokens" 2>&1 | grep -v -E "$noise" >> "$log"
  done
  step "targets" "$(limit 150 $((10 + 15)))" env \
    JAX_EP_COMMAND="bash bench/device_run_one_gpu.sh all: python -m bench.one_gpu_targets OUT/targets.json \
--tokens 128,4096" \
    python3 -m bench.one_gpu_targets "$OUT/targets.json" --tokens 128,4096
  echo "[${SECONDS} s] done" | tee -a "$log"
  python3 -m bench.one_gpu_targets summarize "$OUT" 2>&1 | tee -a "$log"
  exit 0
fi
pairs=()
for name in "${names[@]}"; do pairs+=("$name=$builds/$name"); done
PYTHONPATH="$builds/current:$repo" timeout 560 python3 -m bench.compare_builds "$OUT/builds.json" "${pairs[@]}" "$@" 2>&1 | tee "$OUT/bench.log" \
  | grep -v -E "cuda_executor|Source Location|external/xla|^\s*@ 0x|^$"
