"""Nsight Compute metrics of jax_ep.grouped_matmul's kernels beside the dense einsum's (cuBLAS), on one GPU.

    python -m bench.grouped_matmul_ncu run [--shape M,K,N,G]   # compiles, and fills JAX's compilation cache
    ncu --query-metrics > QUERY.txt
    ncu --clock-control none --cache-control all --section LaunchStats \\
        --metrics $(python -m bench.grouped_matmul_ncu metrics QUERY.txt) --csv --print-units base \\
        --log-file K.csv python -m bench.grouped_matmul_ncu run [--shape M,K,N,G]
    python -m bench.grouped_matmul_ncu summarize K.csv OUT.json [--shape M,K,N,G]

``run`` calls, once each and in this order, bench/grouped_matmul.py's ``fwd``, ``dx`` and ``dw`` (the custom
VJP's ops with the path ``plan_for`` gives them, random group sizes) and the dense einsum of the same op, each
call after a marker kernel (a jitted ``jnp.cbrt``). JAX's persistent compilation cache (``--cache-dir``) lets the
second run, under ncu, load what the first compiled: no autotuning kernels run under the profiler, and both runs
take the same cuBLAS algorithms. ``summarize`` keeps the kernels after each marker and gives, per op and side,
the device time, TFLOP/s of the useful FLOPs (``2*M*K*N``), the tensor pipe's active cycles, the SM and DRAM
throughputs and bytes, the launch shape, and the six commonest reasons its warps stalled (% of active warps).
Caches are flushed before each kernel; clocks are left alone.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

from bench.profile_kernels import read_kernel_metrics

MARKER = "cbrt"
OPS = ("fwd", "dx", "dw")
SIDES = ("jax_ep", "einsum")
METRICS = {  # name in the JSON: ncu metric, or the metrics to try in turn (the first that the chip has)
    "us": "gpu__time_duration.sum",
    "tensor_active_pct": (
        "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
    ),
    "sm_throughput_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm_active_pct": "sm__cycles_active.avg.pct_of_peak_sustained_elapsed",
    "dram_throughput_pct": "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram_read_bytes": "dram__bytes_read.sum",
    "dram_write_bytes": "dram__bytes_write.sum",
    "l2_hit_pct": "lts__t_sector_hit_rate.pct",
    "grid": "Grid Size",  # LaunchStats section
    "registers": "Registers Per Thread",
    "shared_bytes": "Dynamic Shared Memory Per Block",
}
STALLS = re.compile(r"smsp__warp_issue_stalled_(\w+)_per_warp_active\.pct")  # % of active warps, by reason


def metric_list(available: str) -> list[str]:
    """The ncu metrics to ask for on a chip whose ``ncu --query-metrics`` output is ``available``: of each entry
    of METRICS the first whose base name it lists (section rows are left to --section), and the stall reasons."""
    names = set(re.findall(r"[a-z0-9_]+__[a-z0-9_]+", available))
    chosen = []
    for entry in METRICS.values():
        candidates = (entry,) if isinstance(entry, str) else entry
        found = [c for c in candidates if "__" in c and c.split(".")[0] in names]
        chosen += found[:1]
    chosen += sorted(f"{n}.pct" for n in names if STALLS.fullmatch(f"{n}.pct"))
    return chosen


def parse_shape(text: str) -> tuple[int, int, int, int]:
    m, k, n, g = (int(v) for v in text.split(","))
    return m, k, n, g


def run(shape, cache_dir: Path) -> None:
    # ncu's replay saves and restores the memory a kernel writes: with JAX holding 75% of the GPU it fails.
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    import jax

    jax.config.update("jax_compilation_cache_dir", str(cache_dir))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    import jax.numpy as jnp
    import numpy as np

    from bench.grouped_matmul import dense_args, dense_fns, gmm_fns, group_sizes, inputs
    from jax_ep.gmm import grouped_matmul as gm

    m, k, n, g = shape
    x, w, dy = inputs(m, k, n, g)
    s = jnp.asarray(group_sizes("random", m, g))
    plan = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype)
    if plan is None:
        raise SystemExit(f"the Mosaic kernels do not take M,K,N,G={shape} on {jax.devices()[0].device_kind}")
    ours = gmm_fns(plan, x, w)
    dense = dense_fns()
    calls = []
    for op in OPS:
        calls.append((ours[op], {"fwd": (x, w, s), "dx": (dy, w, s), "dw": (x, dy, s)}[op]))
        calls.append((dense[op], dense_args(x, w, dy, g)[op]))
    marker = jax.jit(jnp.cbrt)
    marker_input = jnp.asarray(np.arange(1, 1025, dtype=np.float32))
    for fn, args in calls:
        jax.block_until_ready(marker(marker_input))
        jax.block_until_ready(fn(*args))
    print(f"grouped_matmul_ncu run: M,K,N,G={shape}, plan {plan}", flush=True)


def split_by_marker(kernels: list[dict]) -> dict:
    """The kernels after each marker, named ``(op, side)`` in run()'s order; the markers themselves dropped."""
    starts = [i for i, k in enumerate(kernels) if MARKER in k["name"]]
    labels = [(op, side) for op in OPS for side in SIDES]
    if len(starts) != len(labels):
        raise ValueError(f"{len(starts)} {MARKER} marker kernels in the profile, not {len(labels)}")
    ends = [*starts[1:], len(kernels)]
    return {label: kernels[a + 1 : b] for label, a, b in zip(labels, starts, ends, strict=True)}


def kernel_row(kernel: dict) -> dict:
    row = {"name": kernel["name"], "kernel": kernel["kernel"][:200]}
    metrics = kernel["metrics"]
    for key, entry in METRICS.items():
        found = [m for m in ((entry,) if isinstance(entry, str) else entry) if m in metrics]
        if found:
            row[key] = metrics[found[0]]
    if "us" in row:
        row["us"] /= 1e3  # ncu gives ns
    stalls = {m.group(1): v for name, v in metrics.items() if (m := STALLS.fullmatch(name)) and isinstance(v, float)}
    if stalls:
        row["stalls_pct"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:6])
    return row


def summarize(csv_path: Path, out: Path, shape) -> int:
    from bench.record import provenance, write

    m, k, n, g = shape
    payload = {
        **provenance("python -m bench.grouped_matmul_ncu " + " ".join(sys.argv[1:])),
        "shape": {"M": m, "K": k, "N": n, "G": g, "dtype": "bfloat16", "group_sizes": "random"},
        "method": "Nsight Compute (--clock-control none --cache-control all), one call of each op after a marker",
        "metrics": METRICS,
        "ops": {},
    }
    try:
        parts = split_by_marker(read_kernel_metrics(csv_path))
    except (OSError, ValueError) as error:
        payload["error"] = f"no profile read: {error}"
        write(out, payload)
        print(payload["error"])
        return 1
    flops = 2 * m * k * n
    for (op, side), kernels in parts.items():
        rows = [kernel_row(kernel) for kernel in kernels]
        us = sum(r.get("us", 0.0) for r in rows)
        main = max(rows, key=lambda r: r.get("us", 0.0)) if rows else {}
        payload["ops"].setdefault(op, {})[side] = {
            "us": us,
            "tflops": flops / (us * 1e6) if us else None,
            "main_kernel": main,
            "kernels": rows,
        }
    write(out, payload)
    for line in table(payload):
        print(line)
    return 0


def table(payload: dict) -> list[str]:
    shape = payload["shape"]
    lines = [f"ncu M,K,N,G={shape['M']},{shape['K']},{shape['N']},{shape['G']}: the longest kernel of each op"]
    lines.append(f"{'op':<4} {'side':<7} {'us':>8} {'TFLOP/s':>8} {'tensor%':>8} {'SM%':>6} {'DRAM%':>6} kernel")
    for op, sides in payload["ops"].items():
        for side, result in sides.items():
            main = result["main_kernel"]
            cells = [main.get(key) for key in ("tensor_active_pct", "sm_throughput_pct", "dram_throughput_pct")]
            text = " ".join(f"{c:>6.1f}" if isinstance(c, float) else f"{'-':>6}" for c in cells)
            tflops = f"{result['tflops']:8.0f}" if result["tflops"] else f"{'-':>8}"
            lines.append(f"{op:<4} {side:<7} {result['us']:8.1f} {tflops} {text}  {main.get('name', '')[:60]}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("run", "summarize", "metrics"))
    parser.add_argument("paths", nargs="*", type=Path, help="summarize: K.csv OUT.json; metrics: QUERY.txt")
    parser.add_argument("--shape", type=parse_shape, default=(32768, 7168, 2048, 32), help="M,K,N,G")
    parser.add_argument("--cache-dir", type=Path, default=Path(os.environ.get("TMPDIR", "/tmp")) / "jax_ep_ncu_cache")
    args = parser.parse_args()
    if args.mode == "metrics":  # paths: the output of ncu --query-metrics
        print(",".join(metric_list(args.paths[0].read_text() if args.paths else "")))
    elif args.mode == "run":
        run(args.shape, args.cache_dir)
    elif len(args.paths) != 2:
        parser.error("summarize takes K.csv OUT.json")
    else:
        sys.exit(summarize(*args.paths, args.shape))


if __name__ == "__main__":
    main()
