"""Steps that set the split ops against the whole ops, shared by bench/feature_costs.py (timed) and
bench/profile_kernels.py (every kernel of one step, from Nsight Compute).

A step is ``step(i, *operands)`` inside ``jax.shard_map`` over mesh axis ``"ep"``, returning a float32 scalar that
depends on every output, with ``i`` the loop index that shifts the routing (dispatch) or the weights (combine).
Both versions run a shared expert's first GEMM, ``x [T, H] @ m [H, 2048]``, that does not depend on the
exchange: the whole op passes its results and the matmul through one optimization barrier, and the split op has
the matmul pinned after its start and before its finish by two (:func:`pinned`).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep
from bench.timing import EXPERTS

SHARED_INTERMEDIATE = 2048


def pinned(start, finish, x, m):
    """start() -> the matmul, pinned after it and before finish(pending) -> (result, matmul)."""
    pending = start()
    x_side, pending = jax.lax.optimization_barrier((x, pending))
    side, pending = jax.lax.optimization_barrier((x_side @ m, pending))
    return finish(pending), side


def dispatch_step(split: bool, **kw: Any):
    """``step(i, x, idx, w, m)``: a dispatch (or its start and finish) next to the matmul. ``kw``: dispatch's
    keyword arguments after the routing (``num_experts``, ``axis_name``, ``backend``, ...)."""

    def step(i, x, idx, w, m):
        routing, m = (idx + i) % EXPERTS, m[0]
        if split:
            start = lambda: jax_ep.dispatch_start(x, routing, w, **kw)  # noqa: E731
            d, side = pinned(start, jax_ep.dispatch_finish, x, m)
        else:
            d, side = jax.lax.optimization_barrier((jax_ep.dispatch(x, routing, w, **kw), x @ m))
        flat = d.x.reshape(-1, d.x.shape[-1])
        row = i % flat.shape[0]
        return jnp.sum(flat[row].astype(jnp.float32)) + d.weights.reshape(-1)[row] + side[i % x.shape[0], 0]

    return step


def combine_step(split: bool):
    """``step(i, x, y, handle, weights, m)``: a combine (or its start and finish) of a dispatch's rows next to
    the matmul."""

    def step(i, x, y, handle, weights, m):
        weights, m = weights * (1.0 + i.astype(jnp.float32) * 0.0), m[0]
        if split:
            start = lambda: jax_ep.combine_start(y, handle, weights=weights)  # noqa: E731
            out, side = pinned(start, jax_ep.combine_finish, x, m)
        else:
            out, side = jax.lax.optimization_barrier((jax_ep.combine(y, handle, weights=weights), x @ m))
        return jnp.sum(out[i % x.shape[0]].astype(jnp.float32)) + side[i % x.shape[0], 0]

    return step


def shared_expert_weights(hidden: int) -> jax.Array:
    """The matmul's ``m [1, H, 2048]`` (split over ``"ep"`` like the other operands), bf16."""
    return jnp.asarray(jax.random.normal(jax.random.key(0), (1, hidden, SHARED_INTERMEDIATE)), jnp.bfloat16)


def combine_operands(x, idx, w, *, backend: str):
    """``(y, handle, weights)`` of one dispatch of ``x`` (global arrays over ``"ep"``), for :func:`combine_step`."""

    def made(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=EXPERTS, axis_name="ep", backend=backend)
        return d.x, d.handle, d.weights

    return jax.jit(jax.shard_map(made, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)
