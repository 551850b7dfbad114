"""Row copies of the padded grouped matmul as Pallas Triton kernels (CUDA): ragged rows to padded groups and back,
and zeroing the rows past the groups in place.

XLA's gathers of the same rows took 1.3 (to groups) and 4.5 times (back) as long on one H200 at 32 groups
(docs/maintainers/performance_notes.md); these kernels move blocks of rows with wide, masked loads and stores. Each
takes ``starts`` and ``sizes`` (int32 ``[G]``) of groups laid end to end, and reads no row outside a group, so
whatever the other rows hold (NaN included) never reaches the result; no kernel touches a row outside its arrays,
whatever the sizes. They take arrays of fewer than 2**31 elements (:func:`fits_int32`); larger ones go to XLA's
copies, since the kernels were never run with indices past int32.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

from .vma import vary_like

BLOCK_ROWS = 16
BLOCK_COLS = 512  # 1 KiB of bfloat16 a row: 16-byte loads and stores for every thread of 4 warps
_PARAMS = plt.CompilerParams(num_warps=4, num_stages=1)


def fits_int32(*shapes: tuple[int, ...]) -> bool:
    """Whether arrays of these shapes have fewer than 2**31 elements each (what the kernels were run with)."""
    return all(math.prod(shape) < 2**31 for shape in shapes)


def _cols(d: int) -> int:
    return min(BLOCK_COLS, pl.next_power_of_2(d))


def _rows_within(c: jax.Array, size: jax.Array, row: jax.Array, m: int) -> jax.Array:
    """Row ``c`` of a group of ``size`` rows, at ``row`` of an array of ``m`` rows, is the group's and inside the
    array: group sizes that do not fit the array (a caller's error) never make a kernel touch memory outside it."""
    return (c < size) & (row >= 0) & (row < m)


def _out(shape: tuple[int, ...], *args: jax.Array) -> tuple[jax.ShapeDtypeStruct, list[jax.Array]]:
    """A kernel's output type (``args[-1]``'s dtype) and its arguments, all varying over every mesh axis one of
    them varies over inside ``jax.shard_map`` (a Pallas call's output type must say so)."""
    args = [vary_like(a, *args) for a in args]
    aval = jax.typeof(args[-1])
    manual = getattr(aval, "manual_axis_type", None)
    if manual is not None:
        return jax.ShapeDtypeStruct(shape, aval.dtype, manual_axis_type=manual), args
    return jax.ShapeDtypeStruct(shape, aval.dtype, vma=getattr(aval, "vma", frozenset())), args


def _tile(d: int) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Inside a kernel of :func:`_over_groups`: its group, row block ``cb``, column block ``db``, and the group's rows
    ``c`` and the columns ``col`` of the block."""
    group, cb, db = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    c = cb * BLOCK_ROWS + jnp.arange(BLOCK_ROWS, dtype=jnp.int32)
    col = db * _cols(d) + jnp.arange(_cols(d), dtype=jnp.int32)
    return group, cb, db, c, col


def _over_groups(
    kernel, shape: tuple[int, ...], g: int, rows: int, d: int, name: str, *args: jax.Array, aliases: dict | None = None
):
    """``kernel`` on a grid of (group, block of ``rows``, block of ``d`` columns), with an output of ``shape`` (the
    buffer of an argument where ``aliases`` say so, as ``pallas_call``'s ``input_output_aliases``)."""
    out, args = _out(shape, *args)
    grid = (g, pl.cdiv(rows, BLOCK_ROWS), pl.cdiv(d, _cols(d)))
    return pl.pallas_call(
        kernel, out_shape=out, grid=grid, input_output_aliases=aliases or {}, compiler_params=_PARAMS, name=name
    )(*args)


def pad(a: jax.Array, starts: jax.Array, sizes: jax.Array, rows: int) -> jax.Array:
    """``[M, D]`` to ``[G, rows, D]``: row ``c`` of group ``g`` is ``a[starts[g] + c]`` for ``c < sizes[g]``, else 0."""
    m, d = a.shape
    bc, bd = BLOCK_ROWS, _cols(d)

    def kernel(starts_ref, sizes_ref, a_ref, o_ref):
        group, cb, db, c, col = _tile(d)
        in_cols = (col < d)[None, :]
        start = starts_ref[group]
        held = _rows_within(c, sizes_ref[group], start + c, m)
        src = a_ref.at[pl.ds(start + cb * bc, bc), pl.ds(db * bd, bd)]
        values = plt.load(src, mask=held[:, None] & in_cols, other=0)
        plt.store(o_ref.at[group, pl.ds(cb * bc, bc), pl.ds(db * bd, bd)], values, mask=(c < rows)[:, None] & in_cols)

    g = sizes.shape[0]
    return _over_groups(kernel, (g, rows, d), g, rows, d, "jax_ep_pad_rows", starts, sizes, a)


def unpad(
    p: jax.Array,
    starts: jax.Array,
    sizes: jax.Array,
    m: int,
    plus: jax.Array | None = None,
    *,
    into: jax.Array | None = None,
) -> jax.Array:
    """``[G, C, D]`` back to ``[m, D]``: row ``starts[g] + c`` is ``p[g, c]`` (``p[g, c] + plus[g, c]`` in float32 with
    ``plus``) for ``c < min(sizes[g], C)``; rows past ``sum(sizes)`` are 0. The other rows are ``into``'s (``[m, D]``,
    ``p``'s dtype; the output takes its buffer), or unspecified without it."""
    g, rows, d = p.shape
    bc, bd = BLOCK_ROWS, _cols(d)

    def kernel(starts_ref, sizes_ref, *refs):
        refs = list(refs)
        if into is not None:
            refs.pop(0)  # aliased to o_ref: its rows that no group writes stay
        p_ref, *plus_ref, o_ref = refs
        group, cb, db, c, col = _tile(d)
        start = starts_ref[group]
        held = _rows_within(c, jnp.minimum(sizes_ref[group], rows), start + c, m)
        mask = held[:, None] & (col < d)[None, :]
        block = (group, pl.ds(cb * bc, bc), pl.ds(db * bd, bd))
        values = plt.load(p_ref.at[block], mask=mask, other=0)
        if plus_ref:
            values = (values.astype(jnp.float32) + plt.load(plus_ref[0].at[block], mask=mask, other=0)).astype(p.dtype)
        plt.store(o_ref.at[pl.ds(start + cb * bc, bc), pl.ds(db * bd, bd)], values, mask=mask)

    operands = [a for a in (into, p, plus) if a is not None]
    aliases = None if into is None else {2: 0}  # into, after starts and sizes
    out = _over_groups(kernel, (m, d), g, rows, d, "jax_ep_unpad_rows", starts, sizes, *operands, aliases=aliases)
    return zero_rows_from(out, jnp.sum(sizes))


def zero_rows_from(a: jax.Array, first: jax.Array) -> jax.Array:
    """``a`` with rows ``first`` and after set to 0, in place: the other rows are neither read nor written."""
    m, d = a.shape
    br, bd = BLOCK_ROWS, _cols(d)

    def kernel(first_ref, a_ref, o_ref):
        del a_ref  # aliased to o_ref
        rb, db = pl.program_id(0), pl.program_id(1)
        r = rb * br + jnp.arange(br, dtype=jnp.int32)
        col = db * bd + jnp.arange(bd, dtype=jnp.int32)
        first_row = first_ref[0]

        @pl.when((rb + 1) * br > first_row)
        def _():
            mask = ((r >= first_row) & (r < m))[:, None] & (col < d)[None, :]
            plt.store(o_ref.at[pl.ds(rb * br, br), pl.ds(db * bd, bd)], jnp.zeros((br, bd), a.dtype), mask=mask)

    out, args = _out(a.shape, jnp.reshape(first, (1,)).astype(jnp.int32), a)
    return pl.pallas_call(
        kernel,
        out_shape=out,
        grid=(pl.cdiv(m, br), pl.cdiv(d, bd)),
        input_output_aliases={1: 0},
        compiler_params=_PARAMS,
        name="jax_ep_zero_rows_from",
    )(*args)
