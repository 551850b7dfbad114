"""Time dispatch and combine (cuda and xla backends) next to a plain CUDA peer copy of the same bytes.

    python bench/bench_dispatch.py OUT.json [--tokens 4096 --hidden 7168 --topk 8 --experts 256]

Uniform random top-k routing, bf16, ragged layout, capacity=None, one process driving 2 GPUs.
Times are wall-clock means over --iters synchronized calls after a warm-up.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from record import provenance, write  # noqa: E402

import jax_ep  # noqa: E402


def seconds_per_call(fn, *args, iters: int) -> float:
    for _ in range(3):
        jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    devices = jax.devices("gpu")[:2]
    ranks = len(devices)
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    t, h, k, e = args.tokens, args.hidden, args.topk, args.experts
    jax_ep.initialize(mesh, "ep", num_tokens=t, hidden=h, topk=k, num_experts=e, dtype=jnp.bfloat16)

    rng = np.random.default_rng(0)
    idx = np.argsort(rng.random((ranks * t, e)), axis=1)[:, :k].astype(np.int32)
    x = jnp.asarray(rng.standard_normal((ranks * t, h)), jnp.bfloat16)
    w = jnp.asarray(rng.random((ranks * t, k)), jnp.float32)
    local = e // ranks
    source = np.repeat(np.arange(ranks), t)
    pairs = [(np.any(idx // local == d, axis=1) & (source != d)).sum() for d in range(ranks)]
    remote_bytes_per_rank = max(pairs) * h * 2

    results = {}
    with jax.set_mesh(mesh):
        for backend in ("cuda", "xla"):

            def dispatch(x, idx, w, backend=backend):
                d = jax_ep.dispatch(x, idx, w, num_experts=e, axis_name="ep", backend=backend)
                return d.x, d.weights, d.handle

            run_dispatch = jax.jit(jax.shard_map(dispatch, in_specs=P("ep"), out_specs=P("ep")))
            layout_x, layout_weights, handle = run_dispatch(x, idx, w)

            def combine(y, handle, weights):
                return jax_ep.combine(y, handle, weights=weights)

            run_combine = jax.jit(jax.shard_map(combine, in_specs=P("ep"), out_specs=P("ep")))

            def routing(x, idx, w, backend=backend):  # dispatch without moving x: d.x is dead code
                d = jax_ep.dispatch(x, idx, w, num_experts=e, axis_name="ep", backend=backend)
                return d.weights, d.handle

            run_routing = jax.jit(jax.shard_map(routing, in_specs=P("ep"), out_specs=P("ep")))

            def layout(idx, backend=backend):
                return jax_ep._backends.module(backend).local_layout(idx, e, ranks).token_dest_pos

            run_layout = jax.jit(jax.shard_map(layout, in_specs=P("ep"), out_specs=P("ep")))
            results[backend] = {
                name: seconds_per_call(fn, *fn_args, iters=args.iters) * 1e6
                for name, fn, fn_args in (
                    ("dispatch_us", run_dispatch, (x, idx, w)),
                    ("combine_us", run_combine, (layout_x, handle, layout_weights)),
                    ("routing_only_us", run_routing, (x, idx, w)),
                    ("local_layout_us", run_layout, (idx,)),
                )
            }
            print(backend, results[backend], flush=True)

    from jax_ep import _cuda

    copy_s = _cuda._extension.peer_copy_seconds(
        devices[0].local_hardware_id, devices[1].local_hardware_id, int(remote_bytes_per_rank), args.iters
    )
    copy_gbps = remote_bytes_per_rank / copy_s / 1e9
    for r in results.values():
        for op in ("dispatch", "combine"):
            gbps = remote_bytes_per_rank / (r[f"{op}_us"] * 1e-6) / 1e9
            r[f"{op}_GBps"] = gbps
            r[f"{op}_vs_peer_copy"] = gbps / copy_gbps
    payload = {
        **provenance("python " + " ".join(sys.argv)),
        "shape": {
            "ranks": ranks,
            "tokens_per_rank": t,
            "hidden": h,
            "topk": k,
            "experts": e,
            "dtype": "bfloat16",
            "layout": "ragged",
            "capacity": None,
            "routing": "uniform random top-k",
        },
        "remote_bytes_per_rank": int(remote_bytes_per_rank),
        "peer_copy": {"us": copy_s * 1e6, "GBps": copy_gbps, "api": "cudaMemcpyPeerAsync, CUDA events"},
        "timing": "wall clock, mean of --iters calls after 3 warm-up calls, block_until_ready at the end",
        "parts": "routing_only: dispatch with d.x unused (handle and weights only); local_layout: the layout step",
        "results": results,
    }
    write(args.out, payload)
    print(f"{'':10}{'dispatch us':>12}{'combine us':>12}{'disp %copy':>12}{'comb %copy':>12}")
    for backend, r in results.items():
        print(
            f"{backend:10}{r['dispatch_us']:12.1f}{r['combine_us']:12.1f}"
            f"{100 * r['dispatch_vs_peer_copy']:11.1f}%{100 * r['combine_vs_peer_copy']:11.1f}%"
        )
    print(f"peer copy of {remote_bytes_per_rank / 1e6:.1f} MB: {copy_s * 1e6:.1f} us, {copy_gbps:.0f} GB/s")


if __name__ == "__main__":
    main()
