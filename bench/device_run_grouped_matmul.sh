#!/usr/bin/env bash
# On a machine with one Hopper GPU: the grouped matmul's GPU tests and benchmark (and, with SWEEP=1, the tile sweep),
# then the MoE layer profile; results under $OUT, a short table last. One device call: each step has a time limit,
# and without the sweep they add up to 560 s (at 71d5c64 the benchmark took 130 s and the profile 45 s).
# With LAYER=1 the benchmark and profile give way to the layer beside its baselines (performance.md's layer tables;
# at 3f966bc 185 s on one H200) and its profile at E=256 and E=32 without a shared expert.
# With SKEW=1 (issue 50) only two steps run, both under skewed routing: the benchmark at 32 and 256 groups with its
# skewed group sizes beside tokamax's forward (<= 230 s), then the layer beside its baselines and its --ablate rows
# at busiest-expert loads of 1, 2, 4 and 10 times the mean, those that E/K allows (<= 300 s); WHEELS as for LAYER=1.
#   JAX_EP_COMMIT=<sha> [SWEEP=1] [LAYER=1] [SKEW=1] [TESTS=0] [TESTS_K=<pytest -k expression>] [TEST_SECONDS=200] \
#     bash bench/device_run_grouped_matmul.sh
# The CUDA extension builds in the background (for the MoE layer's backend "cuda") while the grouped-matmul steps
# run from the source tree (they need no extension). If the build fails the profile runs with backend "xla" and
# says so in its JSON. Files in $OUT: grouped_matmul_tests.json, grouped_matmul_sweep.json, grouped_matmul.json,
# moe_layer.json, build.log (on failure) and the logs of each step.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jax_ep_out}
repo=$(pwd)
mkdir -p "$OUT"
export JAX_EP_COMMIT=${JAX_EP_COMMIT:-unknown}
# WHEELS may also be a folder of .whl files (bench/README.md lists tokamax's): they are installed into a site first.
if [ -n "${WHEELS:-}" ] && compgen -G "$WHEELS/*.whl" > /dev/null; then
  python3 -m pip install -q --no-deps --no-index --target /tmp/wheels_site "$WHEELS"/*.whl || exit 1
  WHEELS=/tmp/wheels_site
fi

(JAX_EP_CUDA=ON python3 -m pip install --no-build-isolation --no-deps --target /tmp/jax_ep_site "$repo" \
  > "$OUT/build.log" 2>&1; echo $? > "$OUT/build.rc") &
build=$!

cd /tmp || exit 1  # not the repository root: its jax_ep/ has no built extension
step() {  # NAME SECONDS COMMAND...
  local name=$1 seconds=$2 rc
  shift 2
  echo "[${SECONDS} s] $name (at most ${seconds} s)"
  timeout -s INT -k 10 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  echo "[${SECONDS} s] $name: exit $rc"
}
export PYTHONPATH=$repo
if [ "${SKEW:-0}" = 1 ]; then
  export PYTHONPATH=$repo${WHEELS:+:$WHEELS}
  step grouped_matmul_skews 230 env JAX_EP_COMMAND="python -m bench.grouped_matmul OUT/grouped_matmul_skews.json \
--shapes 32768,7168,2048,32 32768,7168,2048,256 --no-ragged-dot --iters 10" python3 -m bench.grouped_matmul \
    "$OUT/grouped_matmul_skews.json" --shapes 32768,7168,2048,32 32768,7168,2048,256 --no-ragged-dot --iters 10
  wait $build
  if [ "$(cat "$OUT/build.rc")" = 0 ]; then
    export PYTHONPATH=/tmp/jax_ep_site:$repo${WHEELS:+:$WHEELS}
    LD_LIBRARY_PATH="$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')/lib:${LD_LIBRARY_PATH:-}"
    export LD_LIBRARY_PATH
  fi
  step moe_layer_skews 300 env JAX_EP_COMMAND="python -m bench.moe_layer_baselines OUT/moe_layer_skews.json \
--skews 1 2 4 10 --iters 5 --ablate" python3 -m bench.moe_layer_baselines "$OUT/moe_layer_skews.json" --skews 1 2 4 10 \
    --iters 5 --ablate
  sed -n '/^ratio to the einsum of the same op by group sizes/,$p' "$OUT/grouped_matmul_skews.log"
  sed -n '/^backend/,$p' "$OUT/moe_layer_skews.log"
  exit 0
fi
[ "${TESTS:-1}" = 0 ] || step grouped_matmul_tests "${TEST_SECONDS:-200}" env JAX_EP_COMMAND="python -m bench.gpu_tests \
OUT/grouped_matmul_tests.json tests/test_grouped_matmul.py tests/test_grouped_mlp.py tests/test_row_copies.py\
${TESTS_K:+ -k '$TESTS_K'}" python3 -m bench.gpu_tests "$OUT/grouped_matmul_tests.json" \
  "$repo/tests/test_grouped_matmul.py" "$repo/tests/test_grouped_mlp.py" "$repo/tests/test_row_copies.py" \
  ${TESTS_K:+-k "$TESTS_K"}
if [ "${SWEEP:-0}" = 1 ]; then
  step grouped_matmul_sweep 120 env JAX_EP_COMMAND="python -m bench.grouped_matmul OUT/grouped_matmul_sweep.json \
--sweep --budget-s 80 --iters 10" python3 -m bench.grouped_matmul "$OUT/grouped_matmul_sweep.json" \
    --sweep --budget-s 80 --iters 10
fi
[ "${LAYER:-0}" = 1 ] || step grouped_matmul 200 env JAX_EP_COMMAND="python -m bench.grouped_matmul OUT/grouped_matmul.json --no-ragged-dot \
--iters 10" python3 -m bench.grouped_matmul "$OUT/grouped_matmul.json" --no-ragged-dot --iters 10

wait $build
backend=xla
if [ "$(cat "$OUT/build.rc")" = 0 ]; then
  export PYTHONPATH=/tmp/jax_ep_site:$repo  # the build's jax_ep first; bench/ and tests/ from the checkout
  LD_LIBRARY_PATH="$(python3 -c 'import nvidia.nccl; print(list(nvidia.nccl.__path__)[0])')/lib:${LD_LIBRARY_PATH:-}"
  export LD_LIBRARY_PATH
  backend=cuda
  rm "$OUT/build.log"
else
  echo "the CUDA extension did not build (build.log): the MoE profile runs with backend xla"
fi
if [ "${LAYER:-0}" = 1 ]; then
  export PYTHONPATH=$PYTHONPATH${WHEELS:+:$WHEELS}  # WHEELS: where tokamax and its dependencies are installed
  step moe_layer_baselines 260 env JAX_EP_COMMAND="pip install '.[bench]'; python -m bench.moe_layer_baselines \
OUT/moe_layer_baselines.json --iters 5 --ablate" python3 -m bench.moe_layer_baselines \
    "$OUT/moe_layer_baselines.json" --iters 5 --ablate
  for e in 256 32; do
    step "moe_layer_e$e" 70 env JAX_EP_COMMAND="python -m bench.moe_layer_profile OUT/moe_layer_e$e.json --backend \
$backend --experts $e --shared 0 --steps 3" python3 -m bench.moe_layer_profile "$OUT/moe_layer_e$e.json" \
      --backend "$backend" --experts "$e" --shared 0 --steps 3
  done
else
  step moe_layer 160 env JAX_EP_COMMAND="python -m bench.moe_layer_profile OUT/moe_layer.json --backend $backend" \
    python3 -m bench.moe_layer_profile "$OUT/moe_layer.json" --backend "$backend"
fi

echo
if [ -f "$OUT/grouped_matmul_tests.log" ]; then
  grep -E "passed|failed" "$OUT/grouped_matmul_tests.log" | tail -2
  grep -E "^(FAILED|ERROR)" "$OUT/grouped_matmul_tests.log" | head -10
fi
[ -f "$OUT/grouped_matmul_sweep.log" ] && sed -n '/best tiles/,$p' "$OUT/grouped_matmul_sweep.log"
for name in grouped_matmul moe_layer; do
  [ -f "$OUT/$name.log" ] && sed -n '/^wrote/,$p' "$OUT/$name.log"
done
[ -f "$OUT/moe_layer_baselines.log" ] && sed -n '/^backend/,$p' "$OUT/moe_layer_baselines.log"
for e in 256 32; do
  [ -f "$OUT/moe_layer_e$e.log" ] && grep -E "^MoE step|GEMM" "$OUT/moe_layer_e$e.log"
done
true  # the table above is the result; each step's exit code is in its line
