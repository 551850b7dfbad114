"""What the split ops and FP8 dispatch cost on ONE GPU (an EP group of one GPU, mesh axis "ep"), in one run.

    python -m bench.feature_costs OUT.json [--tokens 128,4096] [--backend cuda] [--iters 20]
    python -m bench.feature_costs OUT.json --platform cpu --backend xla --hidden 256 --tokens 64   # a dry run

Shapes: H=7168 (--hidden), K=8, E=256, bf16, ragged layout, uniform random routing with distinct experts per
token (``bench.timing.make_inputs``). Device µs per call from ``bench.timing.seconds_per_call``
(jitted ``fori_loop``s, routing shifted every iteration). OUT.json holds, per T:

* ``split``: ``dispatch + matmul`` against ``dispatch_start``, the matmul pinned after it and before
  ``dispatch_finish`` by ``jax.lax.optimization_barrier``, then ``dispatch_finish``; the same for combine. The
  matmul is ``x [T, H] @ m [H, 2048]``, a shared expert's first GEMM, independent of the exchange. Both versions
  pass their results through an optimization barrier, so that XLA computes all of them (the steps read one row).
  In a group of one GPU nothing travels between GPUs, so the difference is only the cost of splitting (target:
  at most 5%).
* ``fp8``: one dispatch with rows in bf16 and with ``wire_dtype=float8_e4m3fn`` (quantization on the sender,
  dequantization on the receiver, bytes on the wire 7392 instead of 14336 per row at H=7168), and their ratio.

The table is printed last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

SPLIT_COST_MAX = 1.05


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--backend", default="cuda", choices=["cuda", "xla"])
    parser.add_argument("--platform", default="gpu", choices=["gpu", "cpu"])
    parser.add_argument("--iters", type=int, default=20)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax
    import jax.numpy as jnp

    import jax_ep
    from bench.record import provenance, write
    from bench.split_steps import (
        SHARED_INTERMEDIATE,
        combine_operands,
        combine_step,
        dispatch_step,
        shared_expert_weights,
    )
    from bench.timing import EXPERTS, TOPK, make_inputs, progress, seconds_per_call, time_backend

    tokens_list = [int(v) for v in args.tokens.split(",") if v]
    device = jax.devices(args.platform)[0]
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=[device])
    command = "python -m bench.feature_costs " + " ".join(argv)
    payload = {
        **provenance(command),
        "platform": args.platform,
        "device": str(device),
        "backend": args.backend,
        "ranks": 1,
        "hidden": args.hidden,
        "topk": TOPK,
        "experts": EXPERTS,
        "dtype": "bfloat16",
        "matmul": f"x [T, H] @ m [H, {SHARED_INTERMEDIATE}] bf16",
        "split_cost_max": SPLIT_COST_MAX,
        "results": {},
    }
    if args.backend == "cuda":
        jax_ep.initialize(
            mesh, "ep", num_tokens=max(tokens_list), hidden=args.hidden, topk=TOPK, num_experts=EXPERTS,
            dtype=jnp.bfloat16,
        )  # fmt: skip
    kw = dict(num_experts=EXPERTS, axis_name="ep", backend=args.backend)

    with jax.set_mesh(mesh):
        for tokens in tokens_list:
            x, idx, w, _ = make_inputs(1, tokens, args.hidden)
            idx = jnp.asarray(idx)
            m = shared_expert_weights(args.hidden)
            y, handle, y_weights = combine_operands(x, idx, w, backend=args.backend)
            row = {"split": {}, "fp8": {}}
            for op, step, operands in (
                ("dispatch", lambda split: dispatch_step(split, **kw), (x, idx, w, m)),
                ("combine", combine_step, (x, y, handle, y_weights, m)),
            ):
                whole = seconds_per_call(step(False), operands, args.iters) * 1e6
                split = seconds_per_call(step(True), operands, args.iters) * 1e6
                row["split"][op] = {"whole_us": whole, "split_us": split, "ratio": split / whole}
                progress(f"T={tokens} {op} + matmul: whole {whole:.1f} us, split {split:.1f} us")
            if args.hidden % 128 == 0:
                rows = time_backend(args.backend, x, idx, w, iters=args.iters)["dispatch_us"]
                fp8 = time_backend(args.backend, x, idx, w, wire_dtype=jnp.float8_e4m3fn, iters=args.iters)
                row["fp8"] = {"bf16_dispatch_us": rows, "fp8_dispatch_us": fp8["dispatch_us"]}
                row["fp8"]["ratio"] = fp8["dispatch_us"] / rows
                progress(f"T={tokens} dispatch: bf16 rows {rows:.1f} us, FP8 rows {fp8['dispatch_us']:.1f} us")
            payload["results"][str(tokens)] = row
    write(args.out, payload)
    print(f"{'T':>6} {'op':>9} {'whole + mm us':>14} {'split + mm us':>14} {'ratio':>6}   target <= {SPLIT_COST_MAX}")
    for tokens, row in payload["results"].items():
        for op, r in row["split"].items():
            print(f"{tokens:>6} {op:>9} {r['whole_us']:14.1f} {r['split_us']:14.1f} {r['ratio']:6.3f}")
        if row["fp8"]:
            f = row["fp8"]
            print(f"{tokens:>6} FP8 dispatch {f['fp8_dispatch_us']:.1f} us vs bf16 {f['bf16_dispatch_us']:.1f} us: "
                  f"{f['ratio']:.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
