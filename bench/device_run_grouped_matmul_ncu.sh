#!/usr/bin/env bash
# On a machine with one Hopper GPU: Nsight Compute metrics of jax_ep.grouped_matmul's kernels beside the dense
# einsum's (bench/grouped_matmul_ncu.py), at each shape of SHAPES; results under $OUT, a short table last.
#   JAX_EP_COMMIT=<sha> [SHAPES="M,K,N,G ..."] [SECONDS_PER_SHAPE=240] bash bench/device_run_grouped_matmul_ncu.sh
# Files in $OUT: ncu_query.txt, and per shape G (its group count) grouped_matmul_ncu_<G>.json, ncu_<G>.csv and the
# logs of its compile run and profiled run. Runs from the source tree: the kernels need no extension. At a8dcd51
# on one H100 each shape took 31-36 s, compile run and profiled run together.
set -uo pipefail
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/jax_ep_out}
export JAX_EP_COMMIT=${JAX_EP_COMMIT:-unknown}
export PYTHONPATH=$(pwd)${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
ncu --query-metrics > "$OUT/ncu_query.txt" 2>&1
metrics=$(python3 -m bench.grouped_matmul_ncu metrics "$OUT/ncu_query.txt")
cache=$(mktemp -d)
for shape in ${SHAPES:-32768,7168,2048,32 32768,7168,2048,256}; do
  g=${shape##*,}
  start=$SECONDS
  # The first run compiles and autotunes into the cache; the profiled run loads what it compiled.
  timeout -k 10 "${SECONDS_PER_SHAPE:-240}" python3 -m bench.grouped_matmul_ncu run --shape "$shape" \
    --cache-dir "$cache" > "$OUT/ncu_compile_$g.log" 2>&1
  left=$(( ${SECONDS_PER_SHAPE:-240} - (SECONDS - start) ))
  timeout -k 10 "$(( left > 30 ? left : 30 ))" ncu --clock-control none --cache-control all --section LaunchStats \
    --metrics "$metrics" --csv --print-units base --log-file "$OUT/ncu_$g.csv" \
    python3 -m bench.grouped_matmul_ncu run --shape "$shape" --cache-dir "$cache" > "$OUT/ncu_profile_$g.log" 2>&1
  echo "[$SECONDS s] shape $shape: profiled in $(( SECONDS - start )) s"
  JAX_EP_COMMAND="python -m bench.grouped_matmul_ncu summarize K.csv OUT.json --shape $shape (after the run under ncu \
that bench/device_run_grouped_matmul_ncu.sh gives)" python3 -m bench.grouped_matmul_ncu summarize "$OUT/ncu_$g.csv" \
    "$OUT/grouped_matmul_ncu_$g.json" --shape "$shape" | tee "$OUT/ncu_table_$g.txt"
done
rm -rf "$cache"
