"""Time dispatch and combine (cuda and xla backends) next to a plain CUDA peer copy of the same bytes.

    python bench/bench_dispatch.py OUT.json [--tokens 4096 --hidden 7168 --topk 8 --experts 256]

Uniform random top-k routing, bf16, ragged layout, capacity=None, one process driving 2 GPUs.
Each op runs ``iters`` times inside one jitted ``fori_loop`` (the routing shifts every iteration, so
nothing is loop-invariant); the time per call is the difference between loops of 1 + iters and 1 calls,
divided by iters, so host dispatch overhead cancels out.
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
from jax_ep import _backends  # noqa: E402


def _wall(fn, args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def seconds_per_call(step, args, iters: int) -> float:
    """Device seconds of one ``step(i, *args)`` (returns a float32 scalar), from jitted loops."""

    def looped(count):
        def body(*args):
            zero = jax.lax.pcast(jnp.zeros((), jnp.float32), ("ep",), to="varying")
            total = jax.lax.fori_loop(0, count, lambda i, acc: acc + step(i, *args), zero)
            return total[None]

        return jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))

    return (_wall(looped(1 + iters), args) - _wall(looped(1), args)) / iters


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backends", default="cuda,xla")
    parser.add_argument("--platform", default="gpu", help="cpu runs a dry run of the xla backend")
    args = parser.parse_args()
    devices = jax.devices(args.platform)[:2]
    ranks = len(devices)
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    t, h, k, e = args.tokens, args.hidden, args.topk, args.experts
    backends = args.backends.split(",")
    if "cuda" in backends:
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
        for backend in backends:

            def dispatch(i, x, idx, w, backend=backend):
                return jax_ep.dispatch(x, (idx + i) % e, w, num_experts=e, axis_name="ep", backend=backend)

            def dispatch_step(i, x, idx, w, dispatch=dispatch):
                d = dispatch(i, x, idx, w)
                row = i % d.x.shape[0]
                return jnp.sum(d.x[row].astype(jnp.float32)) + d.weights[row]

            def routing_step(i, x, idx, w, dispatch=dispatch):  # d.x is dead code: routing and weights only
                d = dispatch(i, x, idx, w)
                return d.weights[i % d.weights.shape[0]]

            def layout_step(i, idx, backend=backend):
                layout = _backends.module(backend).local_layout((idx + i) % e, e, ranks)
                return layout.slot_rank[i % t, 0].astype(jnp.float32)

            def layout_and_handle(x, idx, w, dispatch=dispatch):
                d = dispatch(0, x, idx, w)
                return d.x, d.weights, d.handle

            y, y_weights, handle = jax.jit(jax.shard_map(layout_and_handle, in_specs=P("ep"), out_specs=P("ep")))(
                x, idx, w
            )

            def combine_step(i, y, handle, weights):
                out = jax_ep.combine(y, handle, weights=weights * (1.0 + i.astype(jnp.float32) * 0.0))
                return jnp.sum(out[i % t].astype(jnp.float32))

            results[backend] = {
                name: seconds_per_call(step, step_args, args.iters) * 1e6
                for name, step, step_args in (
                    ("dispatch_us", dispatch_step, (x, idx, w)),
                    ("combine_us", combine_step, (y, handle, y_weights)),
                    ("routing_only_us", routing_step, (x, idx, w)),
                    ("local_layout_us", layout_step, (idx,)),
                )
            }
            print(backend, results[backend], flush=True)

    peer_copy = {}
    if args.platform == "gpu":
        from jax_ep import _cuda

        copy_s = _cuda._extension.peer_copy_seconds(
            devices[0].local_hardware_id, devices[1].local_hardware_id, int(remote_bytes_per_rank), args.iters
        )
        copy_gbps = remote_bytes_per_rank / copy_s / 1e9
        peer_copy = {"us": copy_s * 1e6, "GBps": copy_gbps, "api": "cudaMemcpyPeerAsync, CUDA events"}
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
            "routing": "uniform random top-k (shifted by the iteration index)",
        },
        "remote_bytes_per_rank": int(remote_bytes_per_rank),
        "peer_copy": peer_copy,
        "timing": "device time per call: (wall(1 + iters calls in one jitted fori_loop) - wall(1 call)) / iters",
        "parts": "routing_only: dispatch with d.x unused (handle and weights only); local_layout: the layout step",
        "results": results,
    }
    write(args.out, payload)
    print(f"{'':8}{'dispatch us':>12}{'combine us':>12}{'routing us':>12}{'layout us':>12}")
    for backend, r in results.items():
        print(
            f"{backend:8}{r['dispatch_us']:12.1f}{r['combine_us']:12.1f}"
            f"{r['routing_only_us']:12.1f}{r['local_layout_us']:12.1f}"
        )
    if peer_copy:
        print(f"peer copy of {remote_bytes_per_rank / 1e6:.1f} MB: {peer_copy['us']:.1f} us, {copy_gbps:.0f} GB/s")
        for backend, r in results.items():
            print(
                f"{backend}: dispatch {100 * r['dispatch_vs_peer_copy']:.1f}% and combine "
                f"{100 * r['combine_vs_peer_copy']:.1f}% of the peer copy's bandwidth"
            )


if __name__ == "__main__":
    main()
