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


def group_bounds(sizes: jax.Array, starts: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
    """Each group's first row and the row past its last (int32): from ``starts``, or laid end to end from row 0."""
    if starts is None:
        ends = jnp.cumsum(sizes)
        return ends - sizes, ends
    starts = starts.astype(jnp.int32)
    return starts, starts + sizes


def tile_table(
    group_sizes: jax.Array,
    block_m: int,
    num_tiles: int,
    align: int = ROW_MULTIPLE,
    starts: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """For each of ``num_tiles`` row tiles: its group, first row, first row of the group in it, and rows.

    Group ``g`` has rows ``[start_g, start_g + s_g)``: laid end to end from row 0, or from ``starts`` (ascending,
    the groups' rows disjoint). It is covered from ``first_g``, ``start_g`` rounded down
    to a multiple of ``align``: tile ``j`` of the group starts at row ``first_g + j * block_m`` (a multiple
    of ``align`` when ``block_m`` is) and its rows of the group are ``[row + skip, row + skip + rows)``
    (``skip`` is ``start_g - first_g`` for the group's first tile and 0 for the others; ``rows`` is 0 for a
    tile of no group). A group of ``s_g > 0`` rows takes ``ceil((start_g - first_g + s_g) / block_m)``
    tiles, in group order; ``num_tiles`` must be at least :func:`num_row_tiles` (which bounds the total
    when ``sum(group_sizes) <= M``).
    """
    sizes = group_sizes.astype(jnp.int32)
    g = sizes.shape[0]
    starts, ends = group_bounds(sizes, starts)
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


def _row_tiles(name: str, lhs, rhs, group_sizes, blocks: Blocks, transpose_rhs: bool, starts=None):
    """The shapes of ``lhs [M, K] x rhs [G, K, N]`` (``[G, N, K]`` with ``transpose_rhs``), checked for ``blocks``,
    and the tile table (of groups from ``starts`` where given): ``(M, K, N, row tiles, column tiles, (group, row,
    skip, rows) per row tile)``."""
    m, k = lhs.shape
    g = rhs.shape[0]
    n, k2 = (rhs.shape[1], rhs.shape[2]) if transpose_rhs else (rhs.shape[2], rhs.shape[1])
    if k != k2 or k % blocks.block_k or n % blocks.block_n or blocks.block_m % ROW_MULTIPLE or lhs.dtype != rhs.dtype:
        raise ValueError(f"{name}: bad shapes {lhs.shape} {lhs.dtype} x {rhs.shape} {rhs.dtype} for {blocks}")
    _check_rows(name, m)
    grid_m = num_row_tiles(m, g, blocks.block_m)
    return m, k, n, grid_m, n // blocks.block_n, tile_table(group_sizes, blocks.block_m, grid_m, starts=starts)


def _copy_rows(count, start, largest: int, copy) -> None:
    """TMA copies have static sizes: ``copy(start, size)`` for ``count`` rows (fewer than ``2 * largest``, a power
    of two) from row ``start`` on, as a sum of powers of two."""
    size = largest
    while size:

        @pl.when(count & size != 0)
        def _(start=start, size=size):
            copy(start, size)

        start += count & size
        size //= 2


def _each_tile(grid_m: int, grid_n: int, grid_block_n: int, table):
    """Runs the decorated ``tile(ni, group, row, skip, rows)`` for each of this SM's output tiles (row tile ``mi``
    of the tile table ``table``, four int32 refs as :func:`tile_table` gives them, and column tile ``ni``)."""
    group_gmem, row_gmem, skip_gmem, rows_gmem = table

    def loop(tile):
        @plgpu.nd_loop((grid_m * grid_n,), collective_axes="sm")
        def mn_loop(loop_info):
            mi, ni = plgpu.planar_snake(loop_info.index[0], (grid_m, grid_n), 1, grid_block_n)
            # The tile table starts every tile at a multiple of ROW_MULTIPLE; layout inference must be told.
            tile(ni, group_gmem[mi], pl.multiple_of(row_gmem[mi], ROW_MULTIPLE), skip_gmem[mi], rows_gmem[mi])

    return loop


def _wgmma_transforms(block_k: int, dtype):
    """The shared-memory tiling and swizzle of a wgmma operand whose rows hold ``block_k`` values."""
    itemsize = jnp.dtype(dtype).itemsize
    swizzle = plgpu.find_swizzle(block_k * itemsize * 8)
    return plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle)


def _persistent_kernel(body, out_shape: tuple[int, ...], dtype, **kwargs):
    """A Mosaic GPU kernel of one block per SM (axis ``"sm"``), in warpgroup semantics."""
    return plgpu.kernel(
        body,
        out_type=jax.ShapeDtypeStruct(out_shape, dtype),
        grid=(_num_sms(),),
        grid_names=("sm",),
        compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
        **kwargs,
    )


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    blocks: Blocks,
    *,
    transpose_rhs: bool = False,
    specialized: bool = False,
    group_starts: jax.Array | None = None,
) -> jax.Array:
    """``out[r] = lhs[r] @ rhs[g(r)]`` for the rows ``r`` of each group; rows outside the groups are not written.

    ``lhs [M, K]``, ``rhs [G, K, N]`` (or ``[G, N, K]`` with ``transpose_rhs``), same 16-bit dtype;
    ``M % ROW_MULTIPLE == 0``, ``K % block_k == 0``, ``N % block_n == 0``, ``block_m % ROW_MULTIPLE == 0``.
    The groups lie end to end from row 0, or from ``group_starts`` (ascending, their rows disjoint and in ``lhs``).

    ``specialized``: warp specialization. One warpgroup loads both operands with TMA; two compute warpgroups
    each multiply half of the tile's ``block_n`` columns and store them through shared memory in tiles of
    :data:`EPILOGUE_TILE`, while the loads of the next tile go on. ``block_m`` and ``block_n / 2`` must be
    multiples of :data:`EPILOGUE_TILE`.
    """
    if specialized and (blocks.block_m % EPILOGUE_TILE or blocks.block_n % (2 * EPILOGUE_TILE)):
        raise ValueError(f"ragged_dot: {blocks}: block_m and block_n / 2 must be multiples of {EPILOGUE_TILE}")
    m, k, n, grid_m, grid_n, tiles = _row_tiles(
        "ragged_dot", lhs, rhs, group_sizes, blocks, transpose_rhs, starts=group_starts
    )
    make = _specialized_kernel if specialized else _pipelined_kernel
    return make(m, k, n, grid_m, grid_n, blocks, transpose_rhs, lhs.dtype)(*tiles, lhs, rhs)


def _pipelined_kernel(m, k, n, grid_m, grid_n, blocks: Blocks, transpose_rhs: bool, dtype):
    """:func:`ragged_dot`'s kernel: one warpgroup per block pipelines the loads and multiplies."""
    bm, bn, bk, steps, gbn = blocks

    def body(group_gmem, row_gmem, skip_gmem, rows_gmem, lhs_gmem, rhs_gmem, o_gmem):
        @_each_tile(grid_m, grid_n, gbn, (group_gmem, row_gmem, skip_gmem, rows_gmem))
        def tile(ni, group, row, skip, rows):
            def acc_scope(acc_ref):
                @pl.when(rows > 0)
                def _():
                    plgpu.emit_pipeline(
                        lambda _, lhs_smem, rhs_smem: plgpu.wgmma(
                            acc_ref,
                            lhs_smem,
                            rhs_smem.transpose((1, 0)) if transpose_rhs else rhs_smem,
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
                _copy_rows(
                    rows,
                    skip,
                    1 << int(math.log2(min(bm, m))),
                    lambda start, size: plgpu.copy_smem_to_gmem(
                        o_smem.at[pl.ds(start, size)], o_gmem.at[pl.ds(row + start, size), pl.ds(ni * bn, bn)]
                    ),
                )
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _persistent_kernel(body, (m, n), dtype)


# The tiled epilogue of :func:`ragged_dot` with ``specialized``: each compute warpgroup stores its accumulator
# through shared memory in tiles of this many rows and columns.
EPILOGUE_TILE = 64


def _specialized_kernel(m, k, n, grid_m, grid_n, blocks: Blocks, transpose_rhs: bool, dtype):
    """:func:`ragged_dot`'s kernel with warp specialization."""
    bm, bn, bk, steps, gbn = blocks
    wn = bn // 2
    transforms = _wgmma_transforms(bk, dtype)
    e = EPILOGUE_TILE

    def pipeline(body, compute_context):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(k // bk,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bm, bk), lambda kk: (0, kk), transforms=transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec(
                    (bn, bk) if transpose_rhs else (bk, bn),
                    (lambda kk: (0, kk)) if transpose_rhs else (lambda kk: (kk, 0)),
                    transforms=transforms,
                    memory_space=plgpu.SMEM,
                ),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=steps,
            compute_context=compute_context,
        )

    def rhs_tile(rhs_gmem, group, ni):
        cols = pl.ds(ni * bn, bn)
        return rhs_gmem.at[group, cols, :] if transpose_rhs else rhs_gmem.at[group, :, cols]

    def body(group_gmem, row_gmem, skip_gmem, rows_gmem, lhs_gmem, rhs_gmem, o_gmem):
        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            allocations=pipeline(ignore, ignore).get_allocations(
                lhs_gmem.at[pl.ds(0, bm), :], rhs_tile(rhs_gmem, 0, 0)
            ),
            # No tiling: a warpgroup's stores start at any row of its tile.
            out_smem=plgpu.SMEM((2, e, e), o_gmem.dtype),
            collective_axes="wg",
        )
        def pipeline_scope(allocations, out_smem):
            wg = lax.axis_index("wg")

            @_each_tile(grid_m, grid_n, gbn, (group_gmem, row_gmem, skip_gmem, rows_gmem))
            def tile(ni, group, row, skip, rows):
                wg_cols = pl.ds(wg * wn, wn)

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, wn), jnp.float32))
                    def acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        acc = acc_ref[...].astype(o_gmem.dtype)
                        for em in range(bm // e):
                            lo = jnp.clip(skip - em * e, 0, e)
                            count = jnp.maximum(jnp.clip(skip + rows - em * e, 0, e) - lo, 0)

                            @pl.when(count > 0)
                            def _(em=em, lo=lo, count=count):
                                for en in range(wn // e):
                                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                                    out_smem[wg] = acc[em * e : (em + 1) * e, en * e : (en + 1) * e]
                                    plgpu.commit_smem()
                                    col = ni * bn + wg * wn + en * e
                                    _copy_rows(
                                        count,
                                        lo,
                                        e,
                                        lambda start, size, em=em, col=col: plgpu.copy_smem_to_gmem(
                                            out_smem.at[wg, pl.ds(start, size)],
                                            o_gmem.at[pl.ds(row + em * e + start, size), pl.ds(col, e)],
                                        ),
                                    )

                def mma(_, lhs_smem, rhs_smem, acc_ref):
                    if transpose_rhs:
                        operand = rhs_smem.at[wg_cols, :].transpose((1, 0))
                    else:
                        operand = rhs_smem.at[:, wg_cols]

                    plgpu.wgmma(acc_ref, lhs_smem, operand)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                @pl.when(rows > 0)
                def _():
                    pipeline(mma, compute_context)(
                        lhs_gmem.at[pl.ds(row, bm), :], rhs_tile(rhs_gmem, group, ni), allocations=allocations
                    )

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _persistent_kernel(body, (m, n), dtype, num_threads=3, thread_name="wg")


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


def transposed_ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    blocks: Blocks,
    *,
    specialized: bool = False,
    group_starts: jax.Array | None = None,
) -> jax.Array:
    """``out[g] = lhs[rows of g].T @ rhs[rows of g]``: ``lhs [R, M]``, ``rhs [R, N]`` -> ``[G, M, N]``.

    The groups lie end to end from row 0, or from ``group_starts`` (within the rows). Rows outside a group never
    reach its output, whatever they hold (NaN included); empty groups give 0.
    ``R % ROW_MULTIPLE == 0``, ``M % block_m == 0``, ``N % block_n == 0``; the rows are split in blocks of
    ``block_k``, a multiple of 64
    (the masks are wgmma-layout registers, 64 rows per warpgroup).

    ``specialized``: warp specialization, as in :func:`ragged_dot`: one warpgroup loads both operands with TMA;
    two compute warpgroups each multiply half of the tile's ``block_n`` columns (a multiple of 128) and store
    their half of the tile through shared memory while the loads of the next tile go on.
    """
    bm, bn, bk, steps, gbn = blocks
    r, m = lhs.shape
    r2, n = rhs.shape
    g = group_sizes.shape[0]
    if r != r2 or m % bm or n % bn or bk % 64 or lhs.dtype != rhs.dtype or (specialized and bn % 128):
        raise ValueError(
            f"transposed_ragged_dot: bad shapes {lhs.shape} {lhs.dtype} x {rhs.shape} {rhs.dtype} for {blocks}"
            + (" (specialized: block_n a multiple of 128)" if specialized else "")
        )
    _check_rows("transposed_ragged_dot", r)
    sizes = group_sizes.astype(jnp.int32)
    starts, ends = group_bounds(sizes, group_starts)
    block_starts = starts // bk * bk
    num_blocks = ((ends + bk - 1) // bk * bk - block_starts) // bk
    make = _transposed_specialized_kernel if specialized else _transposed_pipelined_kernel
    kernel = make(g, r, m, n, blocks, lhs.dtype)
    return kernel(sizes, starts, ends, num_blocks, block_starts, lhs, rhs)


def _group_rows_only(block_idx, num_blocks, start, end, bk: int, refs) -> None:
    """In a group's first and last row block (``block_idx`` of ``num_blocks``), zeroes the rows of the
    ``(bk, cols)`` shared-memory ``refs`` outside the group's rows ``[start, end)``: by a select, so that NaN
    there stays out."""
    first = block_idx == 0
    last = block_idx == num_blocks - 1

    @pl.when(first | last)
    def _():
        lo = lax.select(first, lax.rem(start, bk), jnp.int32(0))
        hi = lax.select(last, lax.rem(end - 1, bk), jnp.int32(bk - 1))
        for ref in refs:
            reg = ref[...]
            idx = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, reg.shape, 0), plgpu.Layout.WGMMA)
            zero = plgpu.layout_cast(jnp.zeros(reg.shape, reg.dtype), plgpu.Layout.WGMMA)
            ref[...] = lax.select((idx >= lo) & (idx <= hi), reg, zero)
        plgpu.commit_smem()


def _transposed_pipelined_kernel(g, r, m, n, blocks: Blocks, dtype):
    """:func:`transposed_ragged_dot`'s kernel: one warpgroup per block pipelines the loads and multiplies."""
    bm, bn, bk, steps, gbn = blocks
    transforms = _wgmma_transforms(bk, dtype)

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
                    _group_rows_only(
                        block_idx[0], num_blocks_gmem[g_i], starts_gmem[g_i], ends_gmem[g_i], bk, (lhs_smem, rhs_smem)
                    )
                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_smem)
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

    return _persistent_kernel(body, (g, m, n), dtype)


def _transposed_specialized_kernel(g, r, m, n, blocks: Blocks, dtype):
    """:func:`transposed_ragged_dot`'s kernel with warp specialization."""
    bm, bn, bk, steps, gbn = blocks
    wn = bn // 2
    grid_m, grid_n = m // bm, n // bn
    transforms = _wgmma_transforms(bk, dtype)

    def pipeline(body, compute_context, num_blocks):
        return plgpu.emit_pipeline_warp_specialized(
            body,
            grid=(num_blocks,),
            memory_registers=40,
            in_specs=[
                plgpu.BlockSpec((bk, bm), lambda kk: (kk, 0), transforms=transforms, memory_space=plgpu.SMEM),
                plgpu.BlockSpec((bk, bn), lambda kk: (kk, 0), transforms=transforms, memory_space=plgpu.SMEM),
            ],
            wg_axis="wg",
            num_compute_wgs=2,
            max_concurrent_steps=steps,
            compute_context=compute_context,
        )

    def body(sizes_gmem, starts_gmem, ends_gmem, num_blocks_gmem, block_starts_gmem, lhs_gmem, rhs_gmem, o_gmem):
        del sizes_gmem  # an empty group's pipeline has no steps: its tiles are stored as zeros
        ignore = lambda *_, **__: None  # noqa: E731

        @functools.partial(
            pl.run_scoped,
            # A grid known only in the kernel, as the real one is: a static one would shrink the stages to it.
            allocations=pipeline(ignore, ignore, num_blocks_gmem[0]).get_allocations(
                lhs_gmem.at[pl.ds(0, bk), pl.ds(0, bm)], rhs_gmem.at[pl.ds(0, bk), pl.ds(0, bn)]
            ),
            out_smem=plgpu.SMEM((2, bm, wn), o_gmem.dtype, transforms=transforms),
            collective_axes="wg",
        )
        def pipeline_scope(allocations, out_smem):
            wg = lax.axis_index("wg")

            @plgpu.nd_loop((g, grid_m * grid_n), collective_axes="sm")
            def mn_loop(loop_info):
                g_i = loop_info.index[0]
                m_i, n_i = plgpu.planar_snake(loop_info.index[1], (grid_m, grid_n), 1, gbn)
                rows = pl.ds(pl.multiple_of(block_starts_gmem[g_i], bk), r)  # the pipeline reads the group's blocks
                num_blocks = num_blocks_gmem[g_i]
                wg_cols = pl.ds(wg * wn, wn)

                def mma(block_idx, lhs_smem, rhs_smem, acc_ref):
                    # Both compute warpgroups zero the same rows of lhs_smem: the same values, so no conflict.
                    rhs_half = rhs_smem.at[:, wg_cols]
                    _group_rows_only(
                        block_idx[0], num_blocks, starts_gmem[g_i], ends_gmem[g_i], bk, (lhs_smem, rhs_half)
                    )
                    plgpu.wgmma(acc_ref, lhs_smem.transpose((1, 0)), rhs_half)
                    plgpu.wgmma_wait(0)
                    return acc_ref

                def compute_context(eval_pipeline):
                    @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((bm, wn), jnp.float32))
                    def acc_scope(acc_ref):
                        eval_pipeline(acc_ref)
                        plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                        out_smem[wg] = acc_ref[...].astype(o_gmem.dtype)
                        plgpu.commit_smem()
                        plgpu.copy_smem_to_gmem(
                            out_smem.at[wg], o_gmem.at[g_i, pl.ds(m_i * bm, bm), pl.ds(n_i * bn + wg * wn, wn)]
                        )

                pipeline(mma, compute_context, num_blocks)(
                    lhs_gmem.at[rows, pl.ds(m_i * bm, bm)],
                    rhs_gmem.at[rows, pl.ds(n_i * bn, bn)],
                    allocations=allocations,
                )

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    return _persistent_kernel(body, (g, m, n), dtype, num_threads=3, thread_name="wg")
