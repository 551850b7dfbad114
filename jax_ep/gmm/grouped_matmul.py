"""``jax_ep.grouped_matmul``: ``jax.lax.ragged_dot`` with Pallas Mosaic GPU kernels on Hopper GPUs.

On a Hopper GPU (compute capability 9.x) the forward pass and both gradients run Pallas Mosaic GPU
(wgmma) kernels from :mod:`jax_ep.gmm.mosaic`, or a dense batched matmul over padded groups
(:mod:`jax_ep.gmm.padded`) when every group fits, joined by a ``jax.custom_vjp``; elsewhere, and for shapes or
dtypes the kernels do not take, :func:`grouped_matmul` is ``jax.lax.ragged_dot`` with its own autodiff.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from ..ep._validate import check_array, check_choice, check_float_dtype
from . import padded as _padded
from .vma import varying_axes, varying_like_inputs

try:
    from . import mosaic as _mosaic
    from .mosaic import Blocks
except ImportError as _error:  # a jax without Pallas Mosaic GPU
    _mosaic = None
    _MOSAIC_IMPORT_ERROR: str | None = str(_error)

    class Blocks(NamedTuple):  # type: ignore[no-redef]
        block_m: int
        block_n: int
        block_k: int
        max_concurrent_steps: int
        grid_block_n: int

else:
    _MOSAIC_IMPORT_ERROR = None

IMPLS = ("auto", "mosaic", "xla")
# "auto" takes the Mosaic path on Hopper, where its GPU tests (tests/test_grouped_matmul.py) pass; False makes "auto"
# jax.lax.ragged_dot everywhere.
MOSAIC_BY_DEFAULT = True
MOSAIC_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Plan(NamedTuple):
    """The tiles of each of the three kernels (None runs that op with XLA) and the forward/dx kernel.

    ``rows``: ``"upstream"``, JAX's ``ragged_dot_mgpu.ragged_dot`` (tiles at multiples of ``block_m``),
    ``"tiles"``, :func:`jax_ep.gmm.mosaic.ragged_dot` (tiles from each group's first row, rounded down to a
    multiple of 8), or ``"specialized"``, the same tiles with warp specialization. ``dw_specialized``: dw's kernel
    with warp specialization (tiles ``dw``). ``padded``: rows per group
    of the padded dense path (:mod:`jax_ep.gmm.padded`), which
    the ops named in ``padded_ops`` take instead of their kernel when no group is larger, or None for the
    kernels alone. ``beyond``: where a group is larger, those ops still take the padded path, the forward pass and
    ``dx`` for every group's first ``padded`` rows with jax_ep's row-tile kernel for the rest, ``dw`` with its
    kernel for the larger groups whole (while at most :data:`BEYOND_GROUPS` are larger), instead of their kernel
    for every row.
    """

    fwd: Blocks | None
    dx: Blocks | None
    dw: Blocks | None
    rows: str = "upstream"
    dw_specialized: bool = False
    padded: int | None = None
    padded_ops: tuple[str, ...] = ()
    beyond: bool = False

    def padded_rows(self, op: str) -> int | None:
        """Rows per group of the padded path for ``op``, or None when ``op`` runs its kernel alone."""
        return self.padded if op in self.padded_ops else None


# Tiles per op; "fwd"/"dx": (rows, output columns, contraction step, pipeline stages, column tiles per
# sweep strip); "dw": (rows of dw = K, columns of dw = N, row step, ...). Tried in order; the first that
# divides the shape wins. Each op's first entry is the fastest of a tile sweep (bench/grouped_matmul.py --sweep);
# docs/maintainers/performance_notes.md says which shapes were swept.
_CANDIDATES: dict[str, tuple[Blocks, ...]] = {
    "fwd": (Blocks(64, 256, 64, 4, 4), Blocks(128, 128, 64, 4, 8), Blocks(64, 128, 64, 4, 1), Blocks(64, 64, 64, 4, 1)),
    "dx": (Blocks(128, 128, 64, 6, 16), Blocks(64, 128, 64, 4, 1), Blocks(64, 64, 64, 4, 1)),
    "dw": (Blocks(128, 128, 64, 4, 4), Blocks(64, 128, 64, 4, 1), Blocks(64, 64, 64, 4, 1)),
}


# From this many groups up the forward and dx kernel is jax_ep's per-group-tile kernel ("tiles") instead of JAX's
# ("upstream"): it was the faster at 256 groups and the slower at 64; no count between them was measured
# (docs/maintainers/performance_notes.md).
MANY_GROUPS = 256

# Where every group fits (jax_ep.gmm.padded.padded_rows) the padded dense path replaces dx's and dw's kernels, and
# from MANY_GROUPS up the forward's too: measured against the kernels in one run, the padded path was the faster
# for dx and dw at every group count measured, and for the forward pass only at 256 groups
# (docs/maintainers/performance_notes.md).
PADDED_OPS = ("dx", "dw")


# Where groups average at least LARGE_GROUPS rows, the forward pass, dx and dw run the warp-specialized kernels with
# tiles SPECIALIZED (where N and K are multiples of its block_n), dx and dw instead of the padded path: there they
# beat every other path, and at 128 rows a group they lost. dw's warp-specialized kernel is also dw's kernel
# wherever its tiles divide the shape, as it beat the pipelined kernel at every group count measured; the padded
# path still takes dw where every group fits (docs/maintainers/performance_notes.md).
LARGE_GROUPS = 512
SPECIALIZED = Blocks(128, 256, 64, 3, 8)

# Plan.beyond: dw's padded path takes at most this many groups larger than its rows through its kernel.
BEYOND_GROUPS = 16
# From MANY_GROUPS up, where the forward pass takes the padded path too, Plan.beyond keeps the three ops on it when a
# group is larger than the padded rows, instead of sending them to their kernels: at 256 groups under skewed sizes
# it was the faster for the forward pass and dx, and for dw within a few percent or faster; at 32 groups the kernels
# were; the MoE layer's step at 256 experts was 4-8% faster with it under skewed routing and no slower uniform
# (docs/maintainers/performance_notes.md).
BEYOND_BY_DEFAULT = True


def _pick(op: str, k: int, n: int) -> Blocks | None:
    """Tiles for ``op`` of ``[M, k] x [G, k, n]``, or None when no candidate divides the shape."""
    for blocks in _CANDIDATES[op]:
        if op == "dw":
            fits = k % blocks.block_m == 0 and n % blocks.block_n == 0
            cols = n
        else:
            out_cols, contraction = (n, k) if op == "fwd" else (k, n)
            fits = contraction % blocks.block_k == 0 and out_cols % blocks.block_n == 0
            cols = out_cols
        if fits:
            return _fitted(blocks, cols)
    return None


def _fitted(blocks: Blocks, cols: int) -> Blocks:
    """``blocks`` sweeping at most the ``cols // block_n`` column tiles there are."""
    return blocks._replace(grid_block_n=max(1, min(blocks.grid_block_n, cols // blocks.block_n)))


ROWS_KERNELS = ("upstream", "tiles", "specialized")


def plan_for(x_shape, w_shape, x_dtype, w_dtype, rows: str | None = None) -> Plan | None:
    """The Mosaic kernels' tiles for these operands, or None if the kernels do not take them.

    ``rows`` names the forward and dx kernel (:class:`Plan`'s ``rows``), with its tiles; None picks it.
    """
    if _mosaic is None:
        return None
    m, k = x_shape
    g, _, n = w_shape
    if jnp.dtype(x_dtype) != jnp.dtype(w_dtype) or jnp.dtype(x_dtype) not in MOSAIC_DTYPES or min(m, k, n, g) < 1:
        return None
    padded = _padded.padded_rows(m, g)
    specialized_fits = n % SPECIALIZED.block_n == 0 and k % SPECIALIZED.block_n == 0
    if rows is None:
        if m >= LARGE_GROUPS * g and specialized_fits:
            rows = "specialized"
        else:
            rows = "upstream" if g < MANY_GROUPS and _mosaic.upstream_signature_ok() else "tiles"
    dw_specialized = k % SPECIALIZED.block_m == 0 and n % SPECIALIZED.block_n == 0
    dw = _fitted(SPECIALIZED, n) if dw_specialized else _pick("dw", k, n)
    if rows == "specialized":
        if not specialized_fits:
            return None
        plan = Plan(_fitted(SPECIALIZED, n), _fitted(SPECIALIZED, k), dw, rows, dw_specialized, padded)
    else:
        many = g >= MANY_GROUPS
        padded_ops = ("fwd", *PADDED_OPS) if many else PADDED_OPS
        beyond = many and BEYOND_BY_DEFAULT
        plan = Plan(_pick("fwd", k, n), _pick("dx", k, n), dw, rows, dw_specialized, padded, padded_ops, beyond)
    if padded is None:
        plan = plan._replace(padded_ops=(), beyond=False)
    return None if plan[:3] == (None, None, None) else plan


@functools.cache
def hopper_available() -> bool:
    """Whether jax sees GPUs here and every one is a Hopper (compute capability 9.x)."""
    try:
        devices = jax.devices("gpu")
    except RuntimeError:
        return False
    return bool(devices) and all(str(getattr(d, "compute_capability", "")).startswith("9.") for d in devices)


def grouped_matmul(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    precision: lax.PrecisionLike = None,
    preferred_element_type: jax.typing.DTypeLike | None = None,
    group_offset: jax.Array | None = None,
    *,
    impl: str = "auto",
) -> jax.Array:
    """``jax.lax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type)``, on Hopper GPUs with Pallas
    Mosaic GPU kernels. It takes ``ragged_dot``'s call, keyword for keyword.

    Rows ``[start_g, start_g + group_sizes[g])`` of ``lhs`` (groups laid end to end from row 0) are
    multiplied by ``rhs[g]``.

    Args:
      lhs: ``[M, K]`` floating.
      rhs: ``[G, K, N]`` floating.
      group_sizes: ``[G]``, any integer dtype, ``sum(group_sizes) <= M``.
      precision: as ``ragged_dot``'s, for XLA's path; the Mosaic path (bfloat16 or float16 operands) multiplies
        them exactly and accumulates in float32 whatever it says.
      preferred_element_type: the output dtype, as ``ragged_dot``'s (None: the operands' result dtype). The
        Mosaic path writes the operands' dtype, so another dtype takes XLA's path.
      group_offset: must be None (``ragged_dot``'s sharded-group form is not implemented):
        ``NotImplementedError`` otherwise.
      impl: ``"auto"``: the Mosaic kernels where they run (below), else ``jax.lax.ragged_dot`` (the
        environment variable ``JAX_EP_GROUPED_MATMUL=xla`` or ``=mosaic``, read at trace time, overrides
        it, e.g. for ``jax_ep.nn.MoE``); ``"mosaic"``: the Mosaic kernels, or a ``ValueError`` saying why
        not; ``"xla"``: ``jax.lax.ragged_dot`` and its autodiff.

    Returns:
      ``[M, N]`` in ``ragged_dot``'s dtype. Rows past ``sum(group_sizes)`` are unspecified (the Mosaic
      path does not write them); whatever they hold, and whatever rows of ``lhs`` (or of the output's
      cotangent) past ``sum(group_sizes)`` hold, NaN included, never reaches the valid rows or the
      gradients. The gradient w.r.t. ``lhs`` is 0 on rows past ``sum(group_sizes)``.

    The Mosaic path is taken when every GPU jax sees is a Hopper (compute capability 9.x), ``lhs`` and
    ``rhs`` are both bfloat16 or both float16, ``preferred_element_type`` is None or their dtype, and the
    tiles of at least one of the three kernels divide the shape (``K`` and ``N`` multiples of 64); any ``M``
    is taken (when it is not a multiple of 8, ``lhs`` is padded with zero rows for the kernels). It is a
    ``jax.custom_vjp``: the forward pass, ``dx = ragged_dot(dy, w^T)`` and ``dw[g] = x_g^T dy_g`` each run a
    kernel whose tiles divide the shape, or XLA's ``ragged_dot`` otherwise. When every group has at most
    ``C`` rows (about ``M / G`` plus 4.5 times its square root, and at most 1.5 ``M / G``;
    :mod:`jax_ep.gmm.padded`), checked on the device, ``dw`` runs instead as one dense batched matmul over
    the groups padded to ``C`` rows, and so do the forward pass and ``dx`` when there are at least 256 groups.
    All accumulate in float32 and round once to the output dtype. Inside the computation the choice between
    kernel and XLA is made per platform (``jax.lax.platform_dependent``), so the same function also runs on
    CPU devices.
    """
    if group_offset is not None:
        raise NotImplementedError(
            f"jax_ep.grouped_matmul: group_offset must be None (ragged_dot's sharded-group form is not implemented), "
            f"got {group_offset!r}"
        )
    check_choice("impl", impl, IMPLS)
    check_array("lhs", lhs, ndim=2, kind="floating")
    check_array("rhs", rhs, ndim=3, kind="floating")
    check_array("group_sizes", group_sizes, shape=(rhs.shape[0],), kind="integer")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"jax_ep: lhs [M, K] and rhs [G, K, N] must share K, got {tuple(lhs.shape)} and {tuple(rhs.shape)}"
        )
    if preferred_element_type is not None:
        preferred_element_type = check_float_dtype("preferred_element_type", preferred_element_type)
    group_sizes = group_sizes.astype(jnp.int32)
    dtype = jnp.result_type(lhs.dtype, rhs.dtype)
    if preferred_element_type is None or preferred_element_type == dtype:
        plan = mosaic_plan(lhs.shape, rhs.shape, lhs.dtype, rhs.dtype, impl, "jax_ep.grouped_matmul")
    elif impl == "mosaic":
        raise ValueError(
            f"jax_ep.grouped_matmul: impl='mosaic' writes the operands' dtype {dtype}, not "
            f"preferred_element_type={preferred_element_type}; use impl='auto' or 'xla'"
        )
    else:
        plan = None
    if plan is None:
        return lax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type)
    return custom_grouped_matmul(lhs, rhs, group_sizes, plan)


def mosaic_plan(x_shape, w_shape, x_dtype, w_dtype, impl: str, caller: str) -> Plan | None:
    """The plan of the Mosaic path for ``x [M, K]`` and ``w [G, K, N]``, or None where ``impl`` (:data:`IMPLS`, the
    environment variable overriding ``"auto"``) resolves to XLA's ``ragged_dot``; a ``ValueError`` naming ``caller``
    where ``impl="mosaic"`` cannot run."""
    if impl == "auto":
        impl = os.environ.get("JAX_EP_GROUPED_MATMUL", "auto")
        check_choice("the environment variable JAX_EP_GROUPED_MATMUL", impl, IMPLS)
    if impl == "auto" and not MOSAIC_BY_DEFAULT:
        impl = "xla"
    if impl == "xla":
        return None
    plan = plan_for(x_shape, w_shape, x_dtype, w_dtype)
    if impl == "auto" and (plan is None or not hopper_available()):
        return None
    if plan is None:
        why = _MOSAIC_IMPORT_ERROR or (
            f"x {jnp.dtype(x_dtype)} and w {jnp.dtype(w_dtype)} must be both bfloat16 or both float16, and "
            f"K={x_shape[1]} and N={w_shape[2]} multiples of 64"
        )
        raise ValueError(f"{caller}: impl='mosaic' cannot run: {why}")
    if not hopper_available():
        raise ValueError(f"{caller}: impl='mosaic' needs Hopper GPUs (compute capability 9.x)")
    return plan


# The custom VJP. The kernels run on CUDA devices only; on any other platform each op is XLA's.


def _rows_below(m: int, group_sizes: jax.Array) -> jax.Array:
    """``[m, 1]`` bool: the row is below ``sum(group_sizes)``."""
    return (jnp.arange(m, dtype=jnp.int32) < jnp.sum(group_sizes))[:, None]


def _xla_fwd(x, w, group_sizes):
    return lax.ragged_dot(x, w, group_sizes)


def _xla_dx(dy, w, group_sizes):
    return lax.ragged_dot(dy, jnp.swapaxes(w, 1, 2), group_sizes)


def _xla_dw(x, dy, group_sizes):
    # Rows past sum(group_sizes) are zeroed by a select first: NaN there must not become NaN * 0.
    below = _rows_below(x.shape[0], group_sizes)
    x, dy = jnp.where(below, x, 0), jnp.where(below, dy, 0)
    dims = lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0], rhs_group_dimensions=[]
    )
    return lax.ragged_dot_general(x, dy, group_sizes, dims)


def _op(
    name: str,
    blocks: Blocks | None,
    xla,
    mosaic,
    *args,
    padded=None,
    rows: int | None = None,
    beyond=None,
    beyond_fits=None,
):
    """One op: on CUDA its kernel, or ``padded(*args, rows)`` when every group has at most ``rows`` rows, and
    otherwise, with ``beyond``, ``padded(*args, rows, beyond)`` where ``beyond_fits(group_sizes)`` (or always
    without it); elsewhere (or without tiles) ``xla``. ``args[2]`` is ``group_sizes``."""
    if blocks is None:
        return xla(*args)

    kernel = varying_like_inputs(mosaic)
    if padded is not None and rows is not None:
        dense = varying_like_inputs(lambda *a: padded(*a, rows))
        larger = kernel
        if beyond is not None:
            split = varying_like_inputs(lambda *a: padded(*a, rows, beyond))
            larger = split if beyond_fits is None else lambda *a: lax.cond(beyond_fits(a[2]), split, kernel, *a)
        on_gpu = lambda *a: lax.cond(_padded.fits(a[2], rows), dense, larger, *a)  # noqa: E731
    else:
        on_gpu = kernel
    with jax.named_scope(f"grouped_matmul_{name}"):
        return lax.platform_dependent(*args, cuda=on_gpu, default=xla)


def _rows_kernel(plan: Plan):
    if plan.rows == "upstream":
        return _mosaic.upstream_ragged_dot
    return functools.partial(_mosaic.ragged_dot, specialized=plan.rows == "specialized")


def past_rows_kernel(plan: Plan, op: str):
    """``kernel(a, b, sizes, starts)``: jax_ep's row-tile kernel of ``op`` (``"fwd"`` or ``"dx"``) over groups from
    explicit starts, which ``Plan.beyond`` runs past the padded rows."""
    blocks, transpose = (plan.fwd, False) if op == "fwd" else (plan.dx, True)
    specialized = plan.rows == "specialized"

    def kernel(a, b, sizes, starts):
        return _mosaic.ragged_dot(
            a, b, sizes, blocks, transpose_rhs=transpose, specialized=specialized, group_starts=starts
        )

    return kernel


def dw_kernel(plan: Plan):
    """``kernel(x, dy, sizes, starts=None)``: dw's kernel, over groups laid end to end or from ``starts``."""

    def kernel(a, b, sizes, starts=None):
        return _mosaic.transposed_ragged_dot(a, b, sizes, plan.dw, specialized=plan.dw_specialized, group_starts=starts)

    return kernel


def fwd_op(x, w, group_sizes, plan: Plan):
    def mosaic(a, b, c):
        return _rows_kernel(plan)(a, b, c, plan.fwd)

    beyond = past_rows_kernel(plan, "fwd") if plan.beyond else None
    rows = plan.padded_rows("fwd")
    return _op("fwd", plan.fwd, _xla_fwd, mosaic, x, w, group_sizes, padded=_padded.fwd, rows=rows, beyond=beyond)


def dx_op(dy, w, group_sizes, plan: Plan):
    # Rows past sum(group_sizes) are 0 in every branch: the kernel leaves them unwritten and an in-place kernel
    # zeroes them (a select would be one more pass over all of dx), the padded path's unpad writes zeros there,
    # and XLA's branch selects.
    def mosaic(a, b, c):
        return _padded.zero_rows_from(_rows_kernel(plan)(a, b, c, plan.dx, transpose_rhs=True), jnp.sum(c))

    def xla(a, b, c):
        return jnp.where(_rows_below(a.shape[0], c), _xla_dx(a, b, c), 0)

    beyond = past_rows_kernel(plan, "dx") if plan.beyond else None
    rows = plan.padded_rows("dx")
    return _op("dx", plan.dx, xla, mosaic, dy, w, group_sizes, padded=_padded.dx, rows=rows, beyond=beyond)


def dw_op(x, dy, group_sizes, plan: Plan):
    mosaic = dw_kernel(plan)
    rows = plan.padded_rows("dw")
    padded = functools.partial(_padded.dw, most=BEYOND_GROUPS)
    beyond = mosaic if plan.beyond else None
    fits = None if rows is None else functools.partial(_padded.fits_beyond, rows=rows, most=BEYOND_GROUPS)
    options = dict(padded=padded, rows=rows, beyond=beyond, beyond_fits=fits)
    return _op("dw", plan.dw, _xla_dw, mosaic, x, dy, group_sizes, **options)


# The kernels need a number of rows that is a multiple of 8 (_mosaic_gmm.ROW_MULTIPLE).
ROW_MULTIPLE = 8 if _mosaic is None else _mosaic.ROW_MULTIPLE


def custom_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, plan: Plan) -> jax.Array:
    """The Mosaic path of :func:`grouped_matmul` with explicit tiles (no checks: use ``grouped_matmul``).

    When ``M`` is not a multiple of 8 (the kernels' row tile), ``x`` gets zero rows up to one before the
    custom VJP and the output is sliced back. The padding rows lie past ``sum(group_sizes)``, outside every
    group, so they reach nothing; autodiff of the slice pads the output's cotangent with zero rows the
    same way, and the padding rows of ``dx`` are sliced off.
    """
    return with_rows_padded(lambda rows: _custom_grouped_matmul(rows, w, group_sizes, plan), x)


def with_rows_padded(fn, x: jax.Array) -> jax.Array:
    """``fn(x)``, with ``x`` given zero rows up to a multiple of :data:`ROW_MULTIPLE` first where it needs them and the
    output sliced back to ``x``'s rows."""
    m = x.shape[0]
    pad = -m % ROW_MULTIPLE
    if not pad:
        return fn(x)
    return fn(jnp.pad(x, ((0, pad), (0, 0))))[:m]


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _custom_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, plan: Plan) -> jax.Array:
    return fwd_op(x, w, group_sizes, plan)


def _custom_fwd(x, w, group_sizes, plan):
    return fwd_op(x, w, group_sizes, plan), (x, w, group_sizes)


def summed_to(cotangent: jax.Array, primal: jax.Array) -> jax.Array:
    """The cotangent summed over the mesh axes it varies over and its primal does not (inside shard_map, ``w``
    replicated over a data axis gets the sum of every data shard's ``dw``), so it has its primal's type."""
    extra = varying_axes(cotangent) - varying_axes(primal)
    return lax.psum(cotangent, tuple(sorted(extra, key=str))) if extra else cotangent


def _custom_bwd(plan, residuals, dy):
    x, w, group_sizes = residuals
    dy = dy.astype(x.dtype)
    dx = dx_op(dy, w, group_sizes, plan).astype(x.dtype)
    dw = dw_op(x, dy, group_sizes, plan).astype(w.dtype)
    return summed_to(dx, x), summed_to(dw, w), None


_custom_grouped_matmul.defvjp(_custom_fwd, _custom_bwd)
