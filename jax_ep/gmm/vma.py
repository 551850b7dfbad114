"""The mesh axes a value varies over inside ``jax.shard_map``, for Pallas calls, whose outputs jax cannot type."""

from __future__ import annotations

import jax
from jax import lax


def varying_axes(value) -> frozenset:
    """The mesh axes ``value`` varies over inside ``jax.shard_map`` (empty outside)."""
    aval = jax.typeof(value)
    manual = getattr(aval, "manual_axis_type", None)
    return frozenset(manual.varying) if manual is not None else frozenset(getattr(aval, "vma", ()))


def vary_like(value: jax.Array, *others) -> jax.Array:
    """``value`` marked varying over every axis one of ``others`` varies over."""
    missing = frozenset().union(*map(varying_axes, others)) - varying_axes(value)
    return lax.pcast(value, tuple(sorted(missing, key=str)), to="varying") if missing else value


def varying_like_inputs(fn):
    """``fn`` with every output marked varying over each axis one of its array arguments varies over: a Pallas call's
    output is not marked varying over ``shard_map``'s axes, where XLA's op's is, and the branches of a conditional
    must agree."""

    def run(*args):
        leaves = jax.tree.leaves(args)
        return jax.tree.map(lambda out: vary_like(out, *leaves), fn(*args))

    return run
