"""A softmax top-K router's expert loads, and tokens shifted so that its busiest expert gets a chosen load: the
skewed routings of bench/moe_layer_baselines.py and bench/moe_layer_profile.py."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def router(x, w_router, topk):
    probs = jax.nn.softmax(x.astype(jnp.float32) @ w_router, axis=-1)
    return jax.lax.top_k(probs, topk)


def load(x, w_router, topk: int) -> dict:
    """The router's expert loads on ``x``: the busiest expert over the mean, and the experts that get no slot."""
    sizes = np.bincount(np.asarray(router(x, w_router, topk)[1]).reshape(-1), minlength=w_router.shape[1])
    return {"max_over_mean": float(sizes.max() * sizes.size / sizes.sum()), "empty": int((sizes == 0).sum())}


def most_skew(experts: int, topk: int) -> float:
    """The largest busiest-expert load over the mean a top-K router can give: every token to one expert, E / K."""
    return experts / topk


def skewed_tokens(x, w_router, topk: int, target: float, steps: int = 24):
    """``x`` shifted by ``s`` times a fixed random direction (standard normal, like a token), ``s`` found by bisection
    so that the router's busiest expert gets about ``target`` times the mean load; ``target`` 1 keeps ``x``. Returns
    the tokens and ``{"shift": s, **load(...)}``; a ``ValueError`` where the shift cannot reach ``target``."""
    if target <= 1:
        return x, {"shift": 0.0, **load(x, w_router, topk)}
    if target > most_skew(w_router.shape[1], topk):
        raise ValueError(f"skew {target}: a top-{topk} router of {w_router.shape[1]} experts gives at most E/K")
    direction = jax.random.normal(jax.random.key(3), (1, x.shape[1]))

    def shifted(shift):
        return (x.astype(jnp.float32) + shift * direction).astype(x.dtype)

    def skew(shift):
        return load(shifted(shift), w_router, topk)["max_over_mean"]

    lo, hi = 0.0, 1.0
    while (reached := skew(hi)) < target:
        if hi > 1e3:
            raise ValueError(f"skew {target}: shifting the tokens by up to {hi:g} reached {reached:.2f} only")
        lo, hi = hi, 2 * hi
    for _ in range(steps):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if skew(mid) < target else (lo, mid)
    tokens = shifted(hi)
    return tokens, {"shift": hi, **load(tokens, w_router, topk)}
