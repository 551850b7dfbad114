"""Pallas Mosaic GPU kernels (Hopper, wgmma) behind :func:`jax_ep.grouped_matmul`.

Adapted from JAX's ``jax/experimental/pallas/ops/gpu/ragged_dot_mgpu.py`` and
``transposed_ragged_dot_mgpu.py`` (Copyright 2025 The JAX Authors, Apache License 2.0), with these changes:

* :func:`ragged_dot` tiles each group from its own first row rounded down to a multiple of 8 (a table of
  tiles computed by XLA outside the kernel) instead of from multiples of ``block_m``, so a group of ``s``
  rows costs at most ``ceil((s + 7) / block_m)`` tiles, tiles of no group are skipped, and the kernel has no
  loop over the groups unrolled into it. (The TMA load of a tile's rows into the wgmma operand's shared
  memory, tiled 8 rows at a time, needs a first row that is a multiple of 8.)
* :func:`transposed_ragged_dot` zeroes the rows of other groups (and past ``sum(group_sizes)``) in the
  first and last row block of each group by a select on both operands, not by multiplying one of them by a
  0/1 mask: ``NaN * 0`` is NaN, so the upstream kernel lets NaN or Inf in the unspecified rows past
  ``sum(group_sizes)`` (or in a neighbouring group) into ``dw``.

:func:`upstream_ragged_dot` calls JAX's forward kernel unchanged. All need
``jax.experimental.pallas.mosaic_gpu``; importing this module does not touch a GPU. All need a number of
rows that is a multiple of :data:`ROW_MULTIPLE` (TMA copies between global memory and shared memory tiled 8
rows at a time do not lower otherwise); :func:`jax_ep.grouped_matmul` pads the rows with zeros to one.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

# Rows of every operand with rows (and of the outputs) must be a multiple of this: shared memory is tiled 8
# rows at a time, and a TMA copy does not lower for a global array whose rows are not a multiple of its tile
# (jax 0.11.2: "dimension 0 must have size smaller or a multiple of its tiling 8").
ROW_MULTIPLE = 8


def _check_rows(name: str, rows: int) -> None:
    if rows % ROW_MULTIPLE:
        raise ValueError(f"{name}: the number of rows ({rows}) must be a multiple of {ROW_MULTIPLE}; pad with zeros")


class Blocks(NamedTuple):
    """Tile sizes of one kernel: output tile ``block_m x block_n``, contraction step ``block_k``."""

    block_m: int
    block_n: int
    block_k: int
    max_concurrent_steps: int
    grid_block_n: int


def _num_sms() -> int:
    try:
        return int(jax.devices("gpu")[0].core_count)
    except (RuntimeError, AttributeError, TypeError):
        return 132  # an H100/H200 SXM


def num_row_tiles(m: int, num_groups: int, block_m: int, align: int = ROW_MULTIPLE) -> int:
    """An upper bound on the tiles :func:`tile_table` gives ``num_groups`` groups of ``m`` rows in all."""
    # Group g takes ceil((lead_g + s_g) / block_m) <= (s_g + align - 1 + block_m - 1) / block_m tiles.
    return pl.cdiv(m + (align - 1) * num_groups, block_m) + num_groups


def tile_table(
    group_sizes: jax.Array, block_m: int, num_tiles: int, align: int = ROW_MULTIPLE
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """For each of ``num_tiles`` row tiles: its group, first row, first row of the group in it, and rows.

    Group ``g`` (rows ``[start_g, start_g + s_g)``) is covered from ``first_g``, ``start_g`` rounded down
    to a multiple of ``align``: tile ``j`` of the group starts at row ``first_g + j * block_m`` (a multiple
    of ``align`` when ``block_m`` is) and its rows of the group are ``[row + skip, row + skip + rows)``
    (``skip`` is ``start_g - first_g`` for the group's first tile and 0 for the others; ``rows`` is 0 for a
    tile of no group). A group of ``s_g > 0`` rows takes ``ceil((start_g - first_g + s_g) / block_m)``
    tiles, in group order; ``num_tiles`` must be at least :func:`num_row_tiles` (which bounds the total
    when ``sum(group_sizes) <= M``).
    """
    sizes = group_sizes.astype(jnp.int32)
    g = sizes.shape[0]
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    firsts = starts // align * align
    tiles = jnp.where(sizes > 0, (starts - firsts + sizes + block_m - 1) // block_m, 0)
    tile_ends = jnp.cumsum(tiles)
    t = jnp.arange(num_tiles, dtype=jnp.int32)
    group = jnp.searchsorted(tile_ends, t, side="right").astype(jnp.int32)
    valid = group < g
    gc = jnp.minimum(group, g - 1)
    row = firsts[gc] + (t - (tile_ends[gc] - tiles[gc])) * block_m
    lo = jnp.maximum(starts[gc], row)
    hi = jnp.minimum(ends[gc], row + block_m)
    skip = jnp.where(valid, lo - row, 0)
    rows = jnp.where(valid, hi - lo, 0)
    return gc, jnp.where(valid, row, 0), skip.astype(jnp.int32), rows.astype(jnp.int32)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    blocks: Blocks,
    *,
    transpose_rhs: bool = False,
) -> jax.Array:
    """``out[r] = lhs[r] @ rhs[g(r)]`` for the rows ``r`` of each group; rows past the groups are not written.

    ``lhs [M, K]``, ``rhs [G, K, N]`` (or ``[G, N, K]`` with ``transpose_rhs``), same 16-bit dtype;
    ``M % ROW_MULTIPLE == 0``, ``K % block_k == 0``, ``N % block_n == 0``, ``block_m % ROW_MULTIPLE == 0``.
    """
    bm, bn, bk, steps, gbn = blocks
    m, k = lhs.shape
    g = rhs.shape[0]
    n, k2 = (rhs.shape[1], rhs.shape[2]) if transpose_rhs else (rhs.shape[2], rhs.shape[1])
    if k != k2 or k % bk or n % bn or bm % ROW_MULTIPLE or lhs.dtype != rhs.dtype:
        raise ValueError(f"ragged_dot: bad shapes {lhs.shape} {lhs.dtype} x {rhs.shape} {rhs.dtype} for {blocks}")
    _check_rows("ragged_dot", m)
    grid_m = num_row_tiles(m, g, bm)
    grid_n = n // bn
    tile_group, tile_row, tile_skip, tile_rows = tile_table(group_sizes, bm, grid_m)

    def body(group_gmem, row_gmem, skip_gmem, rows_gmem, lhs_gmem, rhs_gmem, o_gmem):
        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def mn_loop(loop_info):
            mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, gbn)
            group = group_gmem[mi]
            # The tile table starts every tile at a multiple of ROW_MULTIPLE; layout inference must be told.
            row = pl.multiple_of(row_gmem[mi], ROW_MULTIPLE)
            skip = skip_gmem[mi]
            rows = rows_gmem[mi]

            def acc_scope(acc_ref):
                @pl.when(rows > 0)
                def _():
                    plgpu.emit_pipeline(
                        lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
                            acc_ref,
                            lhs_smem,
                            plgpu.transpose_ref(rhs_smem, (1, 0)) if transpose_rhs else rhs_smem,
                        ),
                        grid=(k // bk,),
                        in_specs=[
                            plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), delay_release=1),
                            plgpu.BlockSpec(
                                (bn, bk) if transpose_rhs else (bk, bn),
                                (lambda kk: (ni, kk)) if transpose_rhs else (lambda kk: (kk, ni)),
                                delay_release=1,
                            ),
                        ],
                        max_concurrent_steps=steps,
                    )(lhs_gmem.at[pl.ds(row, bm), :], rhs_gmem.at[group])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=o_gmem.dtype))
            def store_scope(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                # TMA stores have static sizes: store `rows` rows from `skip` as a sum of powers of two
                # (upstream's ladder, which starts from a row loaded at run time the same way).
                smem_start = skip
                remaining = min(bm, m)
                while remaining > 0:
                    chunk = 1 << int(math.log2(remaining))
                    remaining //= 2

                    @pl.when(rows & chunk != 0)
                    def _(start=smem_start, size=chunk):
                        plgpu.copy_smem_to_gmem(
                            o_smem.at[pl.ds(start, size)],
                            o_gmem.at[pl.ds(row + start, size), pl.ds(ni * bn, bn)],
                        )

                    smem_start += rows & chunk
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((m, n), lhs.dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(tile_group, tile_row, tile_skip, tile_rows, lhs, rhs)


def upstream_signature_ok() -> bool:
    """Whether ``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu.ragged_dot`` takes the arguments used here."""
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu
    except ImportError:
        return False
    params = inspect.signature(ragged_dot_mgpu.ragged_dot).parameters
    return all(name in params for name in (*Blocks._fields, "group_sizes", "transpose_rhs"))


def upstream_ragged_dot(
    lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, blocks: Blocks, *, transpose_rhs: bool = False
) -> jax.Array:
    """JAX's own ``ragged_dot_mgpu.ragged_dot`` (tiles at multiples of ``block_m``, a loop over the groups
    unrolled into the kernel), same contract as :func:`ragged_dot`."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    m, k = lhs.shape
    n, k2 = (rhs.shape[1], rhs.shape[2]) if transpose_rhs else (rhs.shape[2], rhs.shape[1])
    if k != k2 or k % blocks.block_k or n % blocks.block_n or lhs.dtype != rhs.dtype:
        raise ValueError(f"ragged_dot: bad shapes {lhs.shape} {lhs.dtype} x {rhs.shape} {rhs.dtype} for {blocks}")
    _check_rows("upstream_ragged_dot", m)
    return ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=group_sizes.astype(jnp.int32), transpose_rhs=transpose_rhs, **blocks._asdict()
    )


def transposed_ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, blocks: Blocks) -> jax.Array:
    """``out[g] = lhs[rows of g].T @ rhs[rows of g]``: ``lhs [R, M]``, ``rhs [R, N]`` -> ``[G, M, N]``.

    Rows outside a group never reach its output, whatever they hold (NaN included); empty groups give 0.
    ``R % ROW_MULTIPLE == 0``, ``M % block_m == 0``, ``N % block_n == 0``; the rows are split in blocks of
    ``block_k``, a multiple of 64
    (the masks are wgmma-layout registers, 64 rows per warpgroup).
    """
    bm, bn, bk, steps, gbn = blocks
    r, m = lhs.shape
    r2, n = rhs.shape
    g = group_sizes.shape[0]
    if r != r2 or m % bm or n % bn or bk % 64 or lhs.dtype != rhs.dtype:
        raise ValueError(
            f"transposed_ragged_dot: bad shapes {lhs.shape} {lhs.dtype} x {rhs.shape} {rhs.dtype} for {blocks}"
        )
    _check_rows("transposed_ragged_dot", r)
    sizes = group_sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    block_starts = starts // bk * bk
    block_ends = (ends + bk - 1) // bk * bk
    num_blocks = (block_ends - block_starts) // bk

    itemsize = jnp.dtype(lhs.dtype).itemsize
    swizzle = plgpu.find_swizzle(bk * itemsize * 8)
    transforms = (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))

    def body(sizes_gmem, starts_gmem, ends_gmem, num_blocks_gmem, block_starts_gmem, lhs_gmem, rhs_gmem, o_gmem):
        grid_m = m // bm
        grid_n = n // bn

        @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
        def mn_loop(loop_info):
            g_i = loop_info.index[0]
            m_i, n_i = plgpu.planar_snake(loop_info.index[1], (grid_m, grid_n), 1, gbn)
            block_start = pl.multiple_of(block_starts_gmem[g_i], bk)
            rows = pl.ds(block_start, r)  # may run past the end; the pipeline reads only the group's blocks

            def acc_scope(acc_ref):
                def block_matmul(block_idx, lhs_smem, rhs_smem):
                    block_idx = block_idx[0]
                    first = block_idx == 0
                    last = block_idx == num_blocks_gmem[g_i] - 1

                    @pl.when(first | last)
                    def _():
                        # Keep rows [lo, hi] of this block: the group's own rows.
                        lo = lax.select(first, lax.rem(starts_gmem[g_i], bk), jnp.int32(0))
                        hi = lax.select(last, lax.rem(ends_gmem[g_i] - 1, bk), jnp.int32(bk - 1))
                        for ref, cols in ((lhs_smem, bm), (rhs_smem, bn)):
                            reg = ref[...]
                            idx = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, (bk, cols), 0), plgpu.Layout.WGMMA)
                            zero = plgpu.layout_cast(jnp.zeros((bk, cols), reg.dtype), plgpu.Layout.WGMMA)
                            ref[...] = lax.select((idx >= lo) & (idx <= hi), reg, zero)
                        plgpu.commit_smem()

                    plgpu.wgmma(acc_ref, plgpu.transpose_ref(lhs_smem, (1, 0)), rhs_smem)
                    if steps == 1:
                        plgpu.wgmma_wait(0)

                @pl.when(sizes_gmem[g_i] > 0)
                def _():
                    plgpu.emit_pipeline(
                        block_matmul,
                        grid=(num_blocks_gmem[g_i],),
                        in_specs=[
                            plgpu.BlockSpec(
                                (bk, bm),
                                lambda k_i: (k_i, m_i),
                                delay_release=1 if steps > 1 else 0,
                                transforms=transforms,
                            ),
                            plgpu.BlockSpec(
                                (bk, bn),
                                lambda k_i: (k_i, n_i),
                                delay_release=1 if steps > 1 else 0,
                                transforms=transforms,
                            ),
                        ],
                        max_concurrent_steps=steps,
                    )(lhs_gmem.at[rows, :], rhs_gmem.at[rows, :])

                return acc_ref[...]

            acc = pl.run_scoped(acc_scope, plgpu.ACC((bm, bn)))

            @functools.partial(pl.run_scoped, o_smem=plgpu.SMEM((bm, bn), dtype=o_gmem.dtype, transforms=transforms))
            def store_scope(o_smem):
                o_smem[...] = acc.astype(o_smem.dtype)
                plgpu.commit_smem()
                plgpu.copy_smem_to_gmem(o_smem, o_gmem.at[g_i, pl.ds(m_i * bm, bm), pl.ds(n_i * bn, bn)])
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    kernel = plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct((g, m, n), lhs.dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
    )
    return kernel(sizes, starts, ends, num_blocks, block_starts, lhs, rhs)
