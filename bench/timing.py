"""The benchmarks' measuring tools, shared by ``python -m bench.exchange``, its multi-process variant and bench/*.py.

* :func:`seconds_per_call`: device seconds of one call of a step, from jitted loops of static trip count.
* :func:`make_inputs`: uniform random top-k routing with distinct experts per token, bf16 tokens.
* :func:`time_backend`: device µs of dispatch and of combine of one backend; :func:`with_rates` adds GB/s.
* :func:`time_ragged`: the MaxText-style ``ragged_all_to_all`` round trip, checked against the exact result.

Every timed step runs inside ``jax.shard_map`` over the mesh axis ``"ep"`` of the current mesh
(``jax.set_mesh``). Importing this module imports jax: set XLA flags and environment variables first.
"""

from __future__ import annotations

import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import jax_ep
from bench.ragged_baseline import ragged_roundtrip

TOPK, EXPERTS = 8, 256
HIDDEN = 7168
_START = time.perf_counter()


def progress(message: str) -> None:
    """A progress line with the seconds since this module was imported."""
    print(f"[{time.perf_counter() - _START:6.1f} s] {message}", flush=True)


def _wall(fn, args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def seconds_per_call(step, args, iters: int, adaptive: bool = True) -> float:
    """Device seconds of one ``step(i, *args)`` (returns a float32 scalar), from jitted loops.

    ``args`` are global arrays split along their first axis over mesh axis ``"ep"``. Time per call is
    ``(wall(1 + iters calls) - wall(1 call)) / iters``, each the median of 5 runs of a jitted ``fori_loop``,
    so Python's dispatch cost cancels out. Trip counts are static, so XLA runs the loop without reading its
    condition back to the host each iteration. If ``iters`` extra calls take under 20 ms, the count is raised
    once to take about 25 ms, which keeps host timer noise near 1% (unless not ``adaptive``: processes that
    run one program together must not pick their counts apart).
    """

    def looped(count):
        def body(*args):
            zero = jax.lax.pcast(jnp.zeros((), jnp.float32), ("ep",), to="varying")
            total = jax.lax.fori_loop(0, count, lambda i, acc: acc + step(i, *args), zero)
            return total[None]

        return jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))

    once = _wall(looped(1), args)
    extra = _wall(looped(1 + iters), args) - once
    if adaptive and extra < 0.02:
        iters = int(min(20_000, iters * 0.025 / max(extra, 1e-5)))
        extra = _wall(looped(1 + iters), args) - once
    return extra / iters


def make_inputs(ranks: int, tokens: int, hidden: int, seed: int = 0):
    """Uniform random top-k routing (distinct experts per token), bf16 tokens, and the remote bytes per rank.

    Returns ``x [R*T, H]`` bf16 (standard normal), ``idx [R*T, K]`` int32 (numpy), ``w [R*T, K]`` float32
    (uniform in [0, 1)), and the bytes of the largest count of distinct (token, remote rank) pairs of a
    rank, times ``H * 2``.
    """
    rng = np.random.default_rng(seed)
    idx = np.argsort(rng.random((ranks * tokens, EXPERTS)), axis=1)[:, :TOPK].astype(np.int32)
    x = jnp.asarray(rng.standard_normal((ranks * tokens, hidden)), jnp.bfloat16)
    w = jnp.asarray(rng.random((ranks * tokens, TOPK)), jnp.float32)
    source = np.repeat(np.arange(ranks), tokens)
    local = EXPERTS // ranks
    pairs = [(np.any(idx // local == d, axis=1) & (source != d)).sum() for d in range(ranks)]
    return x, idx, w, int(max(pairs)) * hidden * 2


def time_backend(
    backend,
    x,
    idx,
    w,
    *,
    layout="ragged",
    capacity=None,
    partial_dtype=None,
    wire_dtype=None,
    iters=20,
    adaptive=True,
) -> dict:
    """Device µs of one dispatch (rows sent as ``wire_dtype``) and of one combine (``weights=d.weights``,
    ``partial_dtype``) of a backend.

    The routing shifts by the iteration index (``(idx + i) % E``, still distinct experts per token), so
    nothing is loop-invariant. The dispatch step reads one row of ``d.x`` and ``d.weights``; the combine step
    combines the rows of one dispatch, with its weights made loop-variant (times ``1 + 0 * i``), and reads one
    row of the result. Both times include those small XLA ops. ``wire_dtype`` and ``partial_dtype`` reach the ops
    only when set, so the same method also times builds whose ops lack them (bench/compare_builds.py).
    """
    ranks = jax.sharding.get_abstract_mesh().shape["ep"]
    t = x.shape[0] // ranks
    kw = dict(num_experts=EXPERTS, axis_name="ep", layout=layout, capacity=capacity, backend=backend)
    if wire_dtype is not None:
        kw["wire_dtype"] = wire_dtype
    combine_kw = {} if partial_dtype is None else {"partial_dtype": partial_dtype}

    def dispatch(i, x, idx, w):
        return jax_ep.dispatch(x, (idx + i) % EXPERTS, w, **kw)

    def dispatch_step(i, x, idx, w):
        d = dispatch(i, x, idx, w)
        flat = d.x.reshape(-1, d.x.shape[-1])
        row = i % flat.shape[0]
        return jnp.sum(flat[row].astype(jnp.float32)) + d.weights.reshape(-1)[row]

    def made(x, idx, w):
        d = dispatch(0, x, idx, w)
        return d.x, d.weights, d.handle

    y, y_weights, handle = jax.jit(jax.shard_map(made, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)

    def combine_step(i, y, handle, weights):
        weights = weights * (1.0 + i.astype(jnp.float32) * 0.0)
        out = jax_ep.combine(y, handle, weights=weights, **combine_kw)
        return jnp.sum(out[i % t].astype(jnp.float32))

    steps = [("dispatch_us", dispatch_step, (x, idx, w)), ("combine_us", combine_step, (y, handle, y_weights))]
    return {name: seconds_per_call(step, args, iters, adaptive) * 1e6 for name, step, args in steps}


def with_rates(result: dict, remote_bytes: int, copy_us: float | None) -> dict:
    """Adds GB/s of remote bytes and the share of the peer copy's bandwidth (None without a peer copy) to
    dispatch and combine timings."""
    for op in ("dispatch", "combine"):
        us = result[f"{op}_us"]
        result[f"{op}_gbps"] = remote_bytes / us / 1e3
        result[f"{op}_pct_of_copy"] = 100 * copy_us / us if copy_us else None
    return result


def time_ragged(x, idx, w, *, exchange, iters=20) -> dict:
    """Device µs of the ragged_all_to_all round trip (dispatch + combine), checked against the exact result."""

    def roundtrip(i, x, idx, w):
        out = ragged_roundtrip(x, (idx + i) % EXPERTS, w, num_experts=EXPERTS, axis_name="ep", exchange=exchange)
        return out, jnp.sum(out[i % out.shape[0]])

    once = jax.jit(jax.shard_map(lambda x, idx, w: roundtrip(0, x, idx, w)[0], in_specs=P("ep"), out_specs=P("ep")))
    got = np.asarray(once(x, idx, w))
    want = np.asarray(w).sum(1, keepdims=True) * np.asarray(x.astype(jnp.float32))
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    us = seconds_per_call(lambda i, x, idx, w: roundtrip(i, x, idx, w)[1], (x, idx, w), iters) * 1e6
    return {"roundtrip_us": us, "max_relative_error": error, "correct": error < 1e-2}


def transport_facts(transport: str) -> dict:
    """How rows traveled: jax_ep's transport, each GPU's NCCL ranks, and NCCL's P2P switch."""
    return {
        "transport": transport,
        "nccl_ranks": {str(device): list(ranks) for device, ranks in jax_ep.nccl_ranks().items()},
        "NCCL_P2P_DISABLE": os.environ.get("NCCL_P2P_DISABLE", ""),
    }
