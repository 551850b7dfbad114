"""The one-GPU targets' training step, shared by bench/one_gpu_targets.py (timed) and bench/profile_kernels.py (every
kernel of one step, from Nsight Compute).

Forward and backward of dispatch -> an elementwise "expert" -> ``combine(weights=d.weights)`` -> ``sum(out * c)``,
with gradients w.r.t. ``x``, ``topk_weights`` and a per-rank ``scale``. Every function runs inside
``jax.shard_map`` over mesh axis ``"ep"``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

import jax_ep
from bench.timing import EXPERTS


def loss(backend: str):
    """``loss(x, w, scale, idx, c)``: a float32 scalar."""

    def f(x, w, scale, idx, c):
        d = jax_ep.dispatch(x, idx, w, num_experts=EXPERTS, axis_name="ep", backend=backend)
        held = (jnp.arange(d.x.shape[0]) < jnp.sum(d.group_sizes))[:, None]  # rows past them hold anything
        h = jnp.where(held, d.x, 0).astype(jnp.float32)  # masked before the product too: 0 * NaN is NaN
        y = jnp.where(held, h * scale[0] + 0.0625 * h * h, 0.0).astype(d.x.dtype)  # the elementwise "expert"
        out = jax_ep.combine(y, d.handle, weights=d.weights)
        return jnp.sum(out.astype(jnp.float32) * c)

    return f


def once(backend: str):
    """``once(x, idx, w, scale, c) -> (loss[None], dx, dw, dscale)``: one step's loss and gradients."""
    grads = jax.value_and_grad(loss(backend), argnums=(0, 1, 2))

    def f(x, idx, w, scale, c):
        value, (gx, gw, gs) = grads(x, w, scale, idx, c)
        return value[None], gx, gw, gs

    return f


def step(backend: str):
    """``step(i, x, idx, w, scale, c)``: a loop step (``bench.timing.seconds_per_call``) that shifts the
    routing by ``i`` and sums every gradient, so that neither pass is loop-invariant or dead code."""
    grads = once(backend)

    def f(i, x, idx, w, scale, c):
        value, gx, gw, gs = grads(x, (idx + i) % EXPERTS, w, scale, c)
        return value[0] + jnp.sum(gx.astype(jnp.float32)) + jnp.sum(gw) + jnp.sum(gs)

    return f
