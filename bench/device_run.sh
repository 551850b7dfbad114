#!/usr/bin/env bash
# The multi-GPU suite of backend "cuda": ONE device call on a machine of 2, 4 or 8 GPUs (two on one GPU: SUITE_PART),
# within 9 minutes each.
#   JAX_EP_COMMIT=<sha> bash bench/device_run.sh                # the suite (same as: bash bench/device_run.sh suite)
#   JAX_EP_COMMIT=<sha> SUITE_PART=2 bash bench/device_run.sh   # one GPU: the suite's second call (SUITE_PART below)
#   SUITE_GPUS=8 bash bench/device_run.sh plan                   # the plan for 8 GPUs, each step's limit; runs nothing
#   JAX_EP_COMMIT=<sha> bash bench/device_run.sh tests           # every GPU test file in full, nothing else
#   JAX_EP_COMMIT=<sha> bash bench/device_run.sh bench [ARGS]    # python -m bench.exchange ARGS (default: --suite
#                                                                # training --no-ragged), NCCL, P2P off, and
#                                                                # bench/multiprocess.py (1 process/GPU)
# The suite builds the extension (pip install -e .), then runs these steps in order, each under `timeout` (SIGINT,
# SIGKILL 10 s later), its output in $OUT/logs/<step>.log, and prints PASS, FAIL or SKIP (with the reason) after each:
#   topo              nvidia-smi topo -m, topo -p2p r/w/n/a, nvlink --status
#   p2p               bench/p2p_matrix.py: can_access_peer of every pair of GPUs, from the built extension
#   tests             1 GPU: every tests/test_cuda_*.py but the backend file (multiprocess: two processes sharing
#                     GPU 0; reliability; trace; concurrency, whose meshes all skip); 2+ GPUs: the tests of
#                     test_cuda_multiprocess.py that need 2 GPUs (one process per GPU, by peer stores and by NCCL;
#                     a peer that never arrives). The one-GPU tests are the one-GPU suite's (SUITE_TESTS=all: all).
#   tests_backend     tests/test_cuda_backend.py with a -k by GPU count (SUITE_BACKEND_K replaces it): 1 GPU: all of
#                     it (the one_gpu group); 2-3 GPUs: the 2-GPU groups, peer stores ("auto") in full, NCCL ("nccl")
#                     without its shape sweeps (matches_xla, fp8, combine_backward, small_sm, split_ops); 4+ GPUs: a
#                     smoke of "auto" (the file uses 2 GPUs, which the 2-GPU suite covers).
#   tests_gpu         1 GPU: the tests marked gpu in the other tests/test_*.py files (grouped matmul and MLP, row
#                     copies, checkpointing, ...); 2+ GPUs: a SKIP, none needs 2 GPUs
#   fuzz_r1           tools/fuzz.py, R=1 (cases until its time is up: --budget-s)
#   fuzz_shared       1 GPU: R=2 as two processes sharing GPU 0 (--processes 2)
#   fuzz_shared4/8    1 GPU: R=4 and R=8 as processes sharing GPU 0 (peer stores through CUDA IPC)
#   fuzz_r2/r4/r8     R GPUs of one process (--ranks R), R <= GPUs. fuzz.py has no process-per-GPU mode: its
#                     --processes puts every process on GPU 0; one process per GPU is covered by the tests step.
#   concurrency       tests/test_cuda_concurrency.py on the meshes of all GPUs (ep2; ep4 + dp2xep2; ep8 + dp2xep4)
#   bench             python -m bench.exchange --suite training --no-ragged: cuda and xla against the peer copy; one
#                     GPU: cuda alone, no peer copy
#   sm_budget         bench/sm_budget.py: the training-size dispatch and combine at R=1 on GPU 0 with the default SM
#                     budget of a group of several GPUs against every SM
#   ragged_one_shot   XLA's ragged_all_to_all round trip at the training shape with its one-shot kernel (2+ GPUs;
#                     its NCCL send/recv fallback: `bash bench/device_run.sh bench` without --no-ragged)
#   incast            4+ GPUs: from the bench step's result, combine takes at most 1.3x dispatch's time at the
#                     training shape (its senders walk the ranks from their own: no incast on one GPU at a time)
# A step that needs more GPUs than the machine has, or that the time left cannot hold, is a SKIP saying so.
# Limits: each step has a nominal limit and a reserve; it runs for at most its nominal limit, and for less when the
# deadline (SUITE_DEADLINE_S, default 540 s after the script starts, the build included) minus the reserves of the
# steps after it leaves less. `plan` prints them. Other knobs: SUITE_BUILD=0 (use the jax_ep already installed),
# SUITE_BUILD_S and SUITE_BUILD_MIN_S (the build's limit at most and at least: 240 and 90 s by default),
# SUITE_FUZZ_SEED (default: from the clock; each report names it), SUITE_KEEP_LOGS=1,
# SUITE_PART=1|2 (one GPU, whose steps need two calls: 1, the default, runs topo, p2p, tests, tests_backend, fuzz_r1
# and fuzz_shared8; 2 tests_gpu, fuzz_shared, fuzz_shared4, bench and sm_budget), SUITE_ONLY="step ..."
# (run only these steps, and the build; the others are a SKIP saying so; it replaces SUITE_PART), SUITE_SHARDS
# (pytest processes of the tests, tests_backend and tests_gpu steps; default 4 on one GPU, else 1).
# Results: $OUT/suite.json (bench/suite_report.py: each step's name, status, seconds, limit, reason, log and result
# file; GPU count, devices, commit, sources hash, command), $OUT/suite.log (this output) and $OUT/logs.tar.gz (the
# logs/ folder: each step's log and result JSON; packed, and the folder removed, because the device tool brings
# back 8 files at most). The table is printed last; the exit status is 1 when a step failed.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jax_ep_out}
mode=${1:-suite}
[ $# -gt 0 ] && shift
export JAX_EP_COMMAND="bash bench/device_run.sh $mode${*:+ $*}"
mkdir -p "$OUT"

build_quietly() {  # the editable build; its log to $1
  python3 -m pip install --no-build-isolation --no-deps -v -e . > "$1" 2>&1
}

# ---------------------------------------------------------------------------------------------------------------------
# The older stages: the GPU test files in full, or the benchmarks (each one device call).
if [ "$mode" = tests ] || [ "$mode" = bench ]; then
  quiet() { grep -v -E "cuda_executor|Source Location|external/xla|^\s*@ 0x|^$|^===" | tee -a "$OUT/bench.log"; }
  nvidia-smi topo -m 2>&1 | quiet
  if ! build_quietly "$OUT/build.log"; then
    tail -60 "$OUT/build.log"
    exit 1
  fi
  grep "jax_ep:" "$OUT/build.log" | quiet
  rm "$OUT/build.log"
fi
if [ "$mode" = tests ]; then
  # A short check of the NCCL path first: a hang there would otherwise eat the whole call.
  if ! timeout 150 python3 -m pytest -x -q tests/test_cuda_backend.py -k "nccl and (transport_asked or uniform-512)" \
      2>&1 | quiet; then
    echo "NCCL smoke test failed"
    exit 1
  fi
  timeout -s INT -k 10 420 python3 -m bench.gpu_tests "$OUT/gpu_tests.json" tests/test_cuda_*.py 2>&1 \
    | grep -v "^\s*@ 0x" > "$OUT/tests.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/tests.log"
  exit 0
fi
if [ "$mode" = bench ]; then
  bench_args=("$@")
  [ ${#bench_args[@]} -eq 0 ] && bench_args=(--suite training --no-ragged)
  bench() {  # LIMIT PROGRAM OUT ARGS...: PROGRAM is "-m bench.<module>"; each result names this script
    # and the exact benchmark command it ran
    local limit=$1 program=$2 out=$3
    shift 3
    # shellcheck disable=SC2086  # PROGRAM is two words
    JAX_EP_COMMAND="bash bench/device_run.sh bench: python $program OUT/$out $*" \
      timeout "$limit" python3 $program "$OUT/$out" "$@" 2>&1 | quiet
  }
  bench 300 "-m bench.exchange" bench.json "${bench_args[@]}"
  bench 120 "-m bench.exchange" bench_transport_nccl.json --suite training --no-ragged --transport nccl
  bench 120 "-m bench.exchange" bench_p2p_off.json --suite training --no-ragged --p2p-off
  bench 120 "-m bench.multiprocess" multiprocess.json --timeout 110
  bench 120 "-m bench.multiprocess" multiprocess_p2p_off.json --timeout 110 --p2p-off
  exit 0
fi
if [ "$mode" != suite ] && [ "$mode" != plan ]; then
  echo "usage: bash bench/device_run.sh [suite | plan | tests | bench [ARGS]]" >&2
  exit 2
fi

# ---------------------------------------------------------------------------------------------------------------------
# The suite.
DEADLINE=${SUITE_DEADLINE_S:-540}
MIN_STEP_S=20      # a step whose limit would be shorter is skipped: no time left
REPORT_S=10        # kept for the report and packing the logs
LOGS=$OUT/logs
STEPS_FILE=$LOGS/steps.jsonl
SUITE_LOG=$OUT/suite.log

gpu_count() {  # SUITE_GPUS, else the GPUs CUDA_VISIBLE_DEVICES names, else nvidia-smi's
  if [ -n "${SUITE_GPUS:-}" ]; then
    echo "$SUITE_GPUS"
  elif [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
    tr ',' '\n' <<< "$CUDA_VISIBLE_DEVICES" | grep -c .
  else
    local n
    n=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
    echo "${n:-0}"
  fi
}
GPUS=$(gpu_count)

PLAN_NAME=() PLAN_NOMINAL=() PLAN_RESERVE=() PLAN_EXPECT=() PLAN_SKIP=()
plan() {  # NAME NOMINAL RESERVE EXPECTED [SKIP REASON]: a step of the suite, in order (seconds)
  PLAN_NAME+=("$1") PLAN_NOMINAL+=("$2") PLAN_RESERVE+=("$3") PLAN_EXPECT+=("$4") PLAN_SKIP+=("${5:-}")
}
nogpu=$([ "$GPUS" -lt 1 ] && echo "no GPU visible (nvidia-smi lists none)")
need() {  # COUNT [WHAT]: empty when the machine has COUNT GPUs, else why not
  if [ -n "$nogpu" ]; then echo "$nogpu"; elif [ "$GPUS" -lt "$1" ]; then echo "needs $1 GPUs, have $GPUS${2:+; $2}"; fi
}
by_gpus() {  # ONE TWO MORE: the words for 1 GPU, for 2 or 3, for 4 or more (each "nominal reserve expected")
  if [ "$GPUS" -le 1 ]; then echo "$1"; elif [ "$GPUS" -le 3 ]; then echo "$2"; else echo "$3"; fi
}
# Nominal limit, reserve (kept free for the step by the steps before it) and expected seconds (for `plan`). The
# one-GPU figures are from the suite at 1d8a982 on one H100: build 19 s on a fresh machine, tests 160, tests_backend
# 65, fuzz_r1 52, fuzz_shared 45, fuzz_shared4 66 (1,039 cases in 60 s), sm_budget 12; bench's timings of backend
# cuda took 2 s (bf16) and 7 s (FP8), the rest of its 100 s went to backend xla, which one GPU now leaves out. The
# others are estimates; tests_gpu's 80 tests took 108-131 s in 4 shards at 10f10a4 (one H100), before its 4
# whole_gpu tests moved to a process of their own after the shards: at 1140109 the shards and three of those took
# the step's 167 s, and the fourth had not finished.
# The fuzz steps run cases until their time is up (--budget-s), so their nominal limit is their reserve.
plan topo 20 5 1
plan p2p 45 15 5 "$nogpu"
# shellcheck disable=SC2046  # by_gpus gives three words
plan tests $(by_gpus "240 120 160" "150 60 60" "150 60 60") "$nogpu"
plan tests_backend $(by_gpus "150 60 65" "300 60 160" "90 30 40") "$nogpu"
tests_gpu_skip=$([ "$GPUS" -ge 2 ] && echo "left to the one-GPU suite (SUITE_PART=2): none needs 2 GPUs" \
  || echo "$nogpu")
plan tests_gpu 300 120 260 "$tests_gpu_skip"
plan fuzz_r1 $(by_gpus "40 40 40" "30 30 30" "25 25 25") "$nogpu"
shared_skip=$([ "$GPUS" -ge 2 ] && echo "two processes on GPU 0: left to the one-GPU suite" || echo "$nogpu")
plan fuzz_shared 45 45 45 "$shared_skip"
plan fuzz_shared4 80 80 80 "$shared_skip"
plan fuzz_shared8 150 150 150 "$shared_skip"
plan fuzz_r2 $(by_gpus "60 60 60" "60 60 60" "35 35 35") "$(need 2)"
plan fuzz_r4 $([ "$GPUS" -ge 8 ] && echo "40 40 40" || echo "50 50 50") "$(need 4)"
plan fuzz_r8 60 60 60 "$(need 8)"
plan concurrency $(by_gpus "100 60 30" "100 60 30" "160 80 60") \
  "$(need 2 "the tests step ran tests/test_cuda_concurrency.py: each mesh skipped")"
plan bench $(by_gpus "40 30 25" "120 60 70" "120 60 70") "$nogpu"
plan sm_budget 40 20 15 "$nogpu"
plan ragged_one_shot 60 30 40 "$(need 2 "an exchange between GPUs")"
plan incast 20 10 2 "$(need 4 "an exchange that one GPU could receive from all at once")"
# On one GPU the steps take longer than one call's deadline, so they run in two parts, one call each (SUITE_PART,
# default 1): the CUDA backend's GPU tests and the fuzzer at R=1 and at R=8 in processes sharing the GPU, then the
# other GPU tests, the fuzzer at R=2 and 4 in shared processes and the benchmarks.
ONE_GPU_PARTS=("topo p2p tests tests_backend fuzz_r1 fuzz_shared8"
  "tests_gpu fuzz_shared fuzz_shared4 bench sm_budget")
only=${SUITE_ONLY:-} only_why="not in SUITE_ONLY (${SUITE_ONLY:-})"
if [ -z "$only" ] && [ "$GPUS" -eq 1 ]; then
  part=${SUITE_PART:-1}
  case $part in
    1 | 2) ;;
    *) echo "SUITE_PART must be 1 or 2, got $part" >&2; exit 2 ;;
  esac
  only=${ONE_GPU_PARTS[part - 1]} only_why="one GPU: in the other part (SUITE_PART=$((3 - part)))"
fi
if [ -n "$only" ]; then
  for i in "${!PLAN_NAME[@]}"; do
    [[ " $only " == *" ${PLAN_NAME[i]} "* ]] || PLAN_SKIP[i]=${PLAN_SKIP[i]:-$only_why}
  done
fi

time_left() {  # INDEX START: what the deadline leaves a step (INDEX; -1: the build) that starts START seconds into
  # the script, after the reserves of the steps after it that run
  local i=$1 start=$2 reserve=0 j
  for ((j = i + 1; j < ${#PLAN_NAME[@]}; j++)); do
    [ -z "${PLAN_SKIP[j]}" ] && reserve=$((reserve + PLAN_RESERVE[j]))
  done
  echo $((DEADLINE - start - reserve - REPORT_S - 10))  # 10: the SIGKILL grace of `timeout -k`
}

limit_of() {  # INDEX START: the step's limit if it starts START seconds into the script
  local i=$1 left
  left=$(time_left "$i" "$2")
  echo $((left < PLAN_NOMINAL[i] ? left : PLAN_NOMINAL[i]))
}

# The build's limit: what the deadline leaves after the reserves of the steps, at most SUITE_BUILD_S (default 240)
# and at least SUITE_BUILD_MIN_S (default 90): a build cut short fails every step, while the steps after a long build
# are trimmed to the deadline. Its argument: the second the build starts (the plan: 0).
build_limit() {
  local left cap=${SUITE_BUILD_S:-240}
  left=$(time_left -1 "$1")
  left=$((left > ${SUITE_BUILD_MIN_S:-90} ? left : ${SUITE_BUILD_MIN_S:-90}))
  echo $((left < cap ? left : cap))
}

if [ "$mode" = plan ]; then  # the limits when every step takes its expected time, and when it takes its whole limit
  build=${SUITE_PLAN_BUILD_S:-20}
  echo "plan for $GPUS GPU(s), deadline $DEADLINE s, the build taking $build s (SUITE_PLAN_BUILD_S)"
  echo "build: limit $(build_limit 0) s"
  printf "%-16s %7s %7s %8s | %21s | %21s\n" "" "" "" "" "steps take expected" "steps take the limit"
  printf "%-16s %7s %7s %8s | %6s %6s %7s | %6s %6s %7s\n" step nominal reserve expected start limit status \
    start limit status
  fast=$build slow=$build
  for i in "${!PLAN_NAME[@]}"; do
    if [ -n "${PLAN_SKIP[i]}" ]; then
      printf "%-16s %7s %7s %8s   SKIP: %s\n" "${PLAN_NAME[i]}" "${PLAN_NOMINAL[i]}" - - "${PLAN_SKIP[i]}"
      continue
    fi
    cells=()
    for walk in fast slow; do
      t=${!walk}
      limit=$(limit_of "$i" "$t")
      if [ "$limit" -lt "$MIN_STEP_S" ]; then
        cells+=("$t" "$limit" "no time")
      else
        took=$([ "$walk" = fast ] && [ "${PLAN_EXPECT[i]}" -lt "$limit" ] && echo "${PLAN_EXPECT[i]}" || echo "$limit")
        cells+=("$t" "$limit" "$([ "$took" -lt "${PLAN_EXPECT[i]}" ] && echo "cut" || echo "runs")")
        printf -v "$walk" %d $((t + took))
      fi
    done
    printf "%-16s %7s %7s %8s | %6s %6s %7s | %6s %6s %7s\n" "${PLAN_NAME[i]}" "${PLAN_NOMINAL[i]}" \
      "${PLAN_RESERVE[i]}" "${PLAN_EXPECT[i]}" "${cells[@]}"
  done
  echo "ends by $fast s (expected) or $slow s (every step at its limit), + $REPORT_S s for the report, of $DEADLINE"
  exit 0
fi

rm -rf "$LOGS" "$OUT/suite.json" "$OUT/logs.tar.gz"
mkdir -p "$LOGS"
: > "$SUITE_LOG"
say() { echo "$*" | tee -a "$SUITE_LOG"; }
pack() { tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs 2>/dev/null; }
record() {  # NAME RC SECONDS LIMIT RESULT [SKIP REASON]
  local skip=()
  [ $# -ge 6 ] && skip=(--skip "$6")
  python3 -m bench.suite_report step "$STEPS_FILE" "$1" "$2" "$3" "$4" "$LOGS/$1.log" ${5:+--json "$5"} \
    "${skip[@]}" 2>&1 | tee -a "$SUITE_LOG"
}
run_step() {  # NAME LIMIT RESULT COMMAND...: COMMAND under `timeout`, its output into logs/NAME.log
  local name=$1 limit=$2 result=$3 start rc
  shift 3
  [ -n "$result" ] && rm -f "$result"
  say "[${SECONDS} s] $name (limit $limit s): $(tr -s ' \n' ' ' <<< "$*" | cut -c1-240)"
  start=$SECONDS
  JAX_EP_COMMAND="bash bench/device_run.sh: $*" timeout -s INT -k 10 "$limit" "$@" > "$LOGS/$name.log" 2>&1 < /dev/null
  rc=$?
  record "$name" "$rc" $((SECONDS - start)) "$limit" "$result"
  pack
}

seed=${SUITE_FUZZ_SEED:-$(($(date +%s) % 100000))}
say "jax_ep multi-GPU suite: $GPUS GPU(s); deadline $DEADLINE s;" \
  "JAX_EP_COMMIT=${JAX_EP_COMMIT:-} (unset: suite.json names the git HEAD)"
nvidia-smi --query-gpu=index,name,pci.bus_id,driver_version --format=csv,noheader 2> /dev/null | tee -a "$SUITE_LOG"

build_failed=""
if [ "${SUITE_BUILD:-1}" = 0 ]; then
  say "build: skipped (SUITE_BUILD=0): using the jax_ep that python3 imports"
else
  run_step build "$(build_limit "$SECONDS")" "" python3 -m pip install --no-build-isolation --no-deps -v -e .
  if ! tail -1 "$STEPS_FILE" | grep -q '"status": "PASS"'; then
    build_failed="the build failed (logs/build.log)"
    grep -v -E "^\s*$" "$LOGS/build.log" | tail -40 | tee -a "$SUITE_LOG"
  else
    grep "jax_ep:" "$LOGS/build.log" | tee -a "$SUITE_LOG"
  fi
fi

largest=2  # the concurrency meshes over all GPUs: ep<p>, and dp2xep<p/2> from 4 GPUs
while [ $((largest * 2)) -le "$GPUS" ] && [ "$largest" -lt 8 ]; do largest=$((largest * 2)); done
concurrency_k="ep$largest$([ "$largest" -ge 4 ] && echo " or dp2xep$((largest / 2))")"
if [ "${SUITE_TESTS:-}" = all ]; then
  backend_k=""
elif [ "$GPUS" -le 1 ]; then
  backend_k=""
elif [ "$GPUS" -le 3 ]; then
  backend_k="not one_gpu and not (nccl and (matches_xla or fp8_dispatch or combine_backward or small_sm or split_ops))"
else
  backend_k="auto and (pairs_go or gradients or matches_xla and uniform and bf16 or many_calls)"
fi
backend_k=${SUITE_BACKEND_K-$backend_k}
# The tests, tests_backend and tests_gpu steps run their tests in this many pytest processes at once
# (bench/gpu_tests.py --shards: XLA's compiles on the host's cores; the multi-process and timed tests after them in
# as many processes; the whole-GPU measurements last, alone).
shards=${SUITE_SHARDS:-$([ "$GPUS" -le 1 ] && echo 4 || echo 1)}

for i in "${!PLAN_NAME[@]}"; do
  name=${PLAN_NAME[i]}
  why=${PLAN_SKIP[i]}
  [ -z "$why" ] && [ -n "$build_failed" ] && [ "$name" != topo ] && why=$build_failed
  if [ -z "$why" ]; then
    limit=$(limit_of "$i" "$SECONDS")
    [ "$limit" -lt "$MIN_STEP_S" ] && why="no time left before the deadline of $DEADLINE s (its limit: $limit s)"
  fi
  if [ -n "$why" ]; then
    record "$name" 0 0 0 "" "$why"
    continue
  fi
  result=$LOGS/$name.json
  case $name in
    topo)
      run_step topo "$limit" "" bash -c 'command -v nvidia-smi > /dev/null || { echo "SKIP: no nvidia-smi"; exit 77; }
        nvidia-smi topo -m || exit 1
        for m in r w n a; do echo; echo "nvidia-smi topo -p2p $m"; nvidia-smi topo -p2p $m || true; done
        echo; nvidia-smi nvlink --status || true
        echo; echo "nvidia-smi lists $(nvidia-smi -L | grep -c ^GPU) GPU(s)"' ;;
    p2p)
      run_step p2p "$limit" "$result" python3 -m bench.p2p_matrix "$result" ;;
    tests)
      if [ "$GPUS" -le 1 ] || [ "${SUITE_TESTS:-}" = all ]; then
        files=()
        for f in tests/test_cuda_*.py; do
          [ "$f" = tests/test_cuda_backend.py ] || files+=("$f")
        done
        run_step tests "$limit" "$result" python3 -m bench.gpu_tests "$result" --shards "$shards" "${files[@]}"
      else
        run_step tests "$limit" "$result" python3 -m bench.gpu_tests "$result" tests/test_cuda_multiprocess.py \
          -k "one_process_per_gpu or never_arrives"
      fi ;;
    tests_backend)
      run_step tests_backend "$limit" "$result" python3 -m bench.gpu_tests "$result" --shards "$shards" \
        tests/test_cuda_backend.py ${backend_k:+-k "$backend_k"} ;;
    tests_gpu)
      files=()
      for f in tests/test_*.py; do
        [[ $f == tests/test_cuda_* ]] || files+=("$f")
      done
      run_step tests_gpu "$limit" "$result" python3 -m bench.gpu_tests "$result" --shards "$shards" "${files[@]}" \
        -m gpu ;;
    fuzz_r*)
      ranks=${name#fuzz_r}
      overhead=$([ "$ranks" -ge 4 ] && echo 20 || echo 10)  # start, compiling the buckets, the report (2 s at R=1)
      budget=$((limit - overhead < 5 ? 5 : limit - overhead))
      run_step "$name" "$limit" "$result" python3 -m tools.fuzz --platform gpu --backend cuda --ranks "$ranks" \
        --seed "$seed" --cases 1000000 --budget-s "$budget" --progress 15 --out "$result" ;;
    fuzz_shared*)
      processes=${name#fuzz_shared}
      processes=${processes:-2}
      budget=$((limit - 10 - 5 * processes < 5 ? 5 : limit - 10 - 5 * processes))  # starting the processes
      run_step "$name" "$limit" "$result" python3 -m tools.fuzz --platform gpu --backend cuda \
        --processes "$processes" --seed "$seed" --cases 1000000 --budget-s "$budget" --progress 15 --out "$result" ;;
    concurrency)
      meshes=$([ "$largest" -ge 4 ] && echo 2 || echo 1)
      each=$(((limit - 20) / meshes))
      JAX_EP_CONCURRENCY_TIMEOUT_S=$((each < 90 ? 90 : each)) run_step concurrency "$limit" "$result" \
        python3 -m bench.gpu_tests "$result" tests/test_cuda_concurrency.py -k "$concurrency_k" ;;
    bench)
      # One GPU: backend cuda alone (backend xla at R=1 is a local gather, and compiling it took 60 s at 1d8a982).
      run_step bench "$limit" "$result" python3 -m bench.exchange "$result" --suite training --no-ragged --iters 20 \
        $([ "$GPUS" -le 1 ] && echo "--backends cuda") ;;
    sm_budget)
      run_step sm_budget "$limit" "$result" python3 -m bench.sm_budget "$result" ;;
    incast)
      run_step incast "$limit" "" python3 -c 'import json, sys
shape = json.load(open(sys.argv[1]))["training"]["cuda"]
ratio = shape["combine_us"] / shape["dispatch_us"]
print(f"combine {shape[\"combine_us\"]:.1f} us / dispatch {shape[\"dispatch_us\"]:.1f} us = {ratio:.2f}")
sys.exit(0 if ratio <= 1.3 else 1)' "$LOGS/bench.json" ;;
    ragged_one_shot)
      run_step ragged_one_shot "$limit" "$result" python3 -m bench.exchange "$result" --ragged-flag true \
        --ragged-tokens 4096 --hidden 7168 ;;
    *)
      record "$name" 0 0 0 "" "no command for this step (bench/device_run.sh)" ;;
  esac
done

python3 -m bench.suite_report finish "$STEPS_FILE" "$OUT/suite.json" --gpus "$GPUS" --command "$JAX_EP_COMMAND" \
  --wall "$SECONDS" --deadline "$DEADLINE" 2>&1 | tee -a "$SUITE_LOG"
status=${PIPESTATUS[0]}
pack
[ "${SUITE_KEEP_LOGS:-0}" = 1 ] || rm -rf "$LOGS"
exit "$status"
