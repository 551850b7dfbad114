"""The grouped matmul's forward pass, ``dx`` and ``dw`` as a dense batched matmul over groups padded to a fixed size.

Each group's rows are gathered into ``[G, C, ...]`` (zeros past the group's size), multiplied by a batched
``einsum`` (XLA's dense GEMM, float32 accumulation, one rounding), and (forward, ``dx``) gathered back into the
ragged rows.
It holds only while every group has at most ``C`` rows, so :mod:`jax_ep.gmm.grouped_matmul` runs it under a
``lax.cond`` on ``max(group_sizes) <= C``, with the Mosaic kernels as the other branch. With groups of about
``M / G`` rows each it does ``C / (M / G)`` times the useful flops, which :func:`padded_rows` keeps at most
1.5, and the dense GEMM runs much nearer the GPU's peak than a grouped kernel on groups of a hundred rows.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

try:
    from . import row_copies as _row_copies
except ImportError:  # a jax without Pallas Triton (deprecated in jax 0.11): XLA's row copies everywhere
    _row_copies = None

# C covers a group of M / G rows plus this many standard deviations of a binomial count (uniform routing).
SPREAD = 4.5
ROW_STEP = 32  # C is a multiple of this
MOST_FLOPS = 1.5  # C / (M / G) at most


def padded_rows(m: int, g: int, step: int = ROW_STEP) -> int | None:
    """Rows per group ``C`` (a multiple of ``step``) for ``m`` rows in ``g`` groups, or None when padding would cost
    too many flops."""
    if m < 1 or g < 1:
        return None
    mean = m / g
    rows = math.ceil((mean + SPREAD * math.sqrt(mean)) / step) * step
    return rows if rows <= MOST_FLOPS * mean else None


# grouped_mlp's ladder of padded sizes: from M / G plus this many standard deviations, in steps of LADDER_STEP rows,
# at most LADDER_SIZES sizes up to padded_rows.
LADDER_SPREAD = 2.0
LADDER_STEP = 16
LADDER_SIZES = 3


def row_ladder(m: int, g: int) -> tuple[int, ...]:
    """Padded sizes, ascending, for ``m`` rows in ``g`` groups, the last :func:`padded_rows` (empty where that is None):
    the smallest that every group fits multiplies the fewest padding rows."""
    top = padded_rows(m, g)
    if top is None:
        return ()
    mean = m / g
    low = math.ceil((mean + LADDER_SPREAD * math.sqrt(mean)) / LADDER_STEP) * LADDER_STEP
    return (*list(range(low, top, LADDER_STEP))[: LADDER_SIZES - 1], top)


def fits(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Whether every group has at most ``rows`` rows (a scalar bool)."""
    return jnp.max(group_sizes) <= rows


def _row_copy(kernel, xla, *args, shapes: tuple[tuple[int, ...], ...]):
    """``kernel(*args)`` (from :mod:`jax_ep.gmm.row_copies`) on CUDA, ``xla(*args)`` elsewhere; ``xla`` everywhere when
    jax has no Pallas Triton or the arrays (of ``shapes``) are larger than the kernels take."""
    if _row_copies is None or not _row_copies.fits_int32(*shapes):
        return xla(*args)
    return lax.platform_dependent(*args, cuda=kernel, default=xla)


def _starts(group_sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(group_sizes) - group_sizes


def pad(a: jax.Array, group_sizes: jax.Array, rows: int) -> jax.Array:
    """``[M, D]`` ragged rows to ``[G, rows, D]``: row ``c`` of group ``g`` is ``a[start_g + c]``, or 0 past the group
    (a group of more rows gives its first ``rows``).

    No row outside a group (another group's, or past ``sum(group_sizes)``) enters it, so NaN or Inf there never
    does. On CUDA a Pallas Triton kernel (:mod:`jax_ep.gmm.row_copies`), elsewhere XLA's gather and a select.
    """
    return _row_copy(
        lambda a, s: _row_copies.pad(a, _starts(s), s, rows),
        lambda a, s: _xla_pad(a, s, rows),
        a,
        group_sizes,
        shapes=(a.shape, (group_sizes.shape[0], rows, a.shape[1])),
    )


def _xla_pad(a: jax.Array, group_sizes: jax.Array, rows: int) -> jax.Array:
    c = jnp.arange(rows, dtype=jnp.int32)[None, :]
    src = jnp.clip(_starts(group_sizes)[:, None] + c, 0, a.shape[0] - 1)
    gathered = jnp.take(a, src.reshape(-1), axis=0).reshape(group_sizes.shape[0], rows, a.shape[1])
    return jnp.where((c < group_sizes[:, None])[..., None], gathered, 0)


def unpad(
    p: jax.Array,
    group_sizes: jax.Array,
    m: int,
    plus: jax.Array | None = None,
    *,
    into: jax.Array | None = None,
) -> jax.Array:
    """``[G, C, D]`` back to ``[m, D]`` ragged rows: row ``start_g + c`` is ``p[g, c]`` for ``c < min(size_g, C)``,
    rows past ``sum(group_sizes)`` are 0. With ``plus`` (``p``'s shape and dtype) the rows of ``p + plus``, summed in
    float32 as they are copied. The other rows (of groups larger than ``C``) are ``into``'s (an ``[m, D]`` array in
    ``p``'s dtype, updated in place on CUDA), or 0 without it.
    """
    optional = [a for a in (into, plus) if a is not None]

    def split(rest):  # into and plus back from the arguments that _row_copy passes on
        rest = list(rest)
        return (rest.pop(0) if into is not None else None), (rest.pop(0) if plus is not None else None)

    def kernel(p, s, *rest):
        base, add = split(rest)
        return _row_copies.unpad(p, _starts(s), s, m, add, into=base)

    def xla(p, s, *rest):
        base, add = split(rest)
        return _xla_unpad(summed(p, add), s, m, into=base)

    return _row_copy(kernel, xla, p, group_sizes, *optional, shapes=(p.shape, (m, p.shape[2])))


def summed(p: jax.Array, plus: jax.Array | None = None) -> jax.Array:
    """``p + plus`` in float32, rounded once to ``p``'s dtype (``p`` without ``plus``)."""
    return p if plus is None else (p.astype(jnp.float32) + plus).astype(p.dtype)


def _xla_unpad(
    p: jax.Array,
    group_sizes: jax.Array,
    m: int,
    starts: jax.Array | None = None,
    into: jax.Array | None = None,
) -> jax.Array:
    g, rows, d = p.shape
    starts = _starts(group_sizes) if starts is None else starts
    total = jnp.sum(group_sizes)
    r = jnp.arange(m, dtype=jnp.int32)
    # The last group that starts at or before row r (of empty groups at one start, the last: the one that may hold r).
    group = jnp.maximum(jnp.searchsorted(starts, r, side="right").astype(jnp.int32) - 1, 0)
    offset = r - starts[group]
    held = (offset >= 0) & (offset < jnp.minimum(group_sizes[group], rows)) & (r < total)
    index = group * rows + jnp.clip(offset, 0, rows - 1)
    other = 0 if into is None else jnp.where((r < total)[:, None], into, 0)
    return jnp.where(held[:, None], jnp.take(p.reshape(g * rows, d), index, axis=0), other)


def einsum(spec: str, a: jax.Array, b: jax.Array) -> jax.Array:
    # Output in the operands' type: XLA's GEMM accumulates bf16 in float32 and rounds once as it stores, where
    # asking for float32 and rounding after it would write and read the output twice more (15 GB for dw at 256
    # groups of the MoE layer's shape).
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.result_type(a, b))


def zero_rows_from(a: jax.Array, first: jax.Array) -> jax.Array:
    """``a`` with rows ``first`` and after set to 0: on CUDA in place, touching no other row
    (:mod:`jax_ep.gmm.row_copies`), elsewhere by a select."""

    def select(a, first):
        return jnp.where((jnp.arange(a.shape[0], dtype=jnp.int32) < first)[:, None], a, 0)

    return _row_copy(lambda a, first: _row_copies.zero_rows_from(a, first), select, a, first, shapes=(a.shape,))


def fwd(x: jax.Array, w: jax.Array, group_sizes: jax.Array, rows: int, beyond=None) -> jax.Array:
    """``ragged_dot(x, w, group_sizes)``, 0 past ``sum(group_sizes)``.

    Every group must have at most ``rows`` rows, unless ``beyond`` is given: ``beyond(x, w, sizes, starts)``, a
    grouped matmul of the groups of ``sizes`` rows from ``starts`` that writes only those rows, computes the rows
    of each group past its first ``rows`` (:func:`rows_beyond`).
    """
    y = einsum("gck,gkn->gcn", pad(x, group_sizes, rows), w)
    into = None if beyond is None else beyond(x, w, *rows_beyond(group_sizes, rows, x.shape[0]))
    return unpad(y, group_sizes, x.shape[0], into=into)


def dx(dy: jax.Array, w: jax.Array, group_sizes: jax.Array, rows: int, beyond=None) -> jax.Array:
    """``ragged_dot(dy, w^T, group_sizes)``, 0 past ``sum(group_sizes)``; ``beyond`` as :func:`fwd`'s (for ``dy``
    and ``w^T``)."""
    d = einsum("gcn,gkn->gck", pad(dy, group_sizes, rows), w)
    into = None if beyond is None else beyond(dy, w, *rows_beyond(group_sizes, rows, dy.shape[0]))
    return unpad(d, group_sizes, dy.shape[0], into=into)


def dw(x: jax.Array, dy: jax.Array, group_sizes: jax.Array, rows: int, beyond=None, most: int = 0) -> jax.Array:
    """``dw[g] = x_g^T dy_g`` over each group's rows (``[G, K, N]``; 0 for an empty group).

    Every group must have at most ``rows`` rows, unless ``beyond`` is given and at most ``most`` groups have more
    (:func:`fits_beyond`): ``beyond(x, dy, sizes, starts)``, a transposed grouped matmul of the groups of
    ``sizes`` rows from ``starts``, then computes those groups whole (one float32 sum, one rounding, as every
    group's), and their results replace the padded ones.
    """
    d = einsum("gck,gcn->gkn", pad(x, group_sizes, rows), pad(dy, group_sizes, rows))
    return d if beyond is None else larger_groups_whole(d, x, dy, group_sizes, rows, beyond, most)


def larger_groups_whole(
    d: jax.Array, x: jax.Array, dy: jax.Array, group_sizes: jax.Array, rows: int, kernel, most: int
) -> jax.Array:
    """``d`` (``[G, K, N]``, :func:`dw` of the groups' first ``rows`` rows) with each group of more than ``rows`` rows
    (at most ``most`` of them, :func:`fits_beyond`) replaced by ``kernel(x, dy, sizes, starts)`` over its rows
    whole."""
    if most < 1:
        raise ValueError(f"jax_ep.gmm.padded.dw: beyond needs most >= 1, got {most}")
    g = group_sizes.shape[0]
    _, largest = lax.top_k(group_sizes, min(most, g))
    larger = group_sizes[largest] > rows
    whole = kernel(x, dy, jnp.where(larger, group_sizes[largest], 0), _starts(group_sizes)[largest])
    return d.at[jnp.where(larger, largest, g)].set(whole.astype(d.dtype), mode="drop")


def rows_beyond(group_sizes: jax.Array, rows: int, m: int) -> tuple[jax.Array, jax.Array]:
    """Each group's rows past its first ``rows``: their number and first row (at most ``m``, ascending)."""
    return jnp.maximum(group_sizes - rows, 0), jnp.minimum(_starts(group_sizes) + rows, m)


def fits_beyond(group_sizes: jax.Array, rows: int, most: int) -> jax.Array:
    """Whether at most ``most`` groups have more than ``rows`` rows (a scalar bool): :func:`dw` with ``beyond``."""
    return jnp.sum(group_sizes > rows) <= most
