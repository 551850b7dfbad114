"""The public ops: argument checks, static sizes, backend choice and custom VJPs."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
import warnings
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from . import call_sites, fp8, xla
from ._validate import check_array, check_choice, check_float_dtype, check_positive_int
from .types import (
    DROP_POLICIES,
    LAYOUTS,
    XLA_EXCHANGES,
    Backend,
    Config,
    Dispatched,
    Handle,
    PendingCombine,
    PendingDispatch,
    RowType,
    empty_dispatch,
)

TRANSFERS = ("fused", "separate")
HANDLE = "jax_ep_handle"  # jax.checkpoint names: everything a dispatch returns but its rows
ROWS = "jax_ep_rows"  # the dispatched rows (Dispatched.x)


def default_capacity(
    *, num_ranks: int, num_tokens: int, topk: int, num_experts: int, layout: str = "ragged", expert_alignment: int = 1
) -> int:
    """The capacity ``C`` that ``capacity=None`` stands for.

    Ragged: ``R*T*min(K, L) + L*(expert_alignment-1)``; expert: ``R*T``. With
    distinct expert ids per token nothing is ever dropped at this size.
    ``num_tokens`` and ``topk`` may be 0.
    """
    num_ranks = check_positive_int("num_ranks", num_ranks)
    num_tokens = check_positive_int("num_tokens", num_tokens, minimum=0)
    topk = check_positive_int("topk", topk, minimum=0)
    num_experts = check_positive_int("num_experts", num_experts)
    expert_alignment = check_positive_int("expert_alignment", expert_alignment)
    check_choice("layout", layout, LAYOUTS)
    _check_experts("jax_ep.default_capacity", num_experts, num_ranks, f"num_ranks={num_ranks}")
    return _capacity(num_ranks, num_tokens, topk, num_experts, layout, expert_alignment)


def _check_experts(op: str, num_experts: int, num_ranks: int, ranks: str) -> None:
    if num_experts % num_ranks:
        raise ValueError(
            f"{op}: num_experts must be a multiple of {ranks}; expected a multiple of {num_ranks}, got {num_experts}"
        )


def _capacity(num_ranks: int, num_tokens: int, topk: int, num_experts: int, layout: str, expert_alignment: int) -> int:
    local_experts = num_experts // num_ranks
    if layout == "ragged":
        return num_ranks * num_tokens * min(topk, local_experts) + local_experts * (expert_alignment - 1)
    return num_ranks * num_tokens


BACKENDS = ("auto", "xla", "cuda")
_warned: set[str] = set()


def _resolve_backend(backend: str, axis_name: Hashable, num_ranks: int, topk: int, num_experts: int) -> tuple[str, int]:
    """The concrete backend ("xla" or "cuda") that ``backend`` names for this dispatch, and the cuda group id.

    ``"cuda"`` where it cannot run is a ValueError; ``"auto"`` then picks ``"xla"``, warning once per reason
    when the computation runs on GPUs.
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "xla":
        return "xla", -1
    from . import cuda

    group, reason = cuda.find_group(axis_name, num_ranks, topk, num_experts)
    if group is not None:
        return "cuda", group
    if backend == "cuda":
        raise ValueError(f"jax_ep: backend='cuda' cannot run here: {reason}")
    if cuda.on_gpus() and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"jax_ep: backend='auto' uses 'xla' on these GPUs: {reason}", stacklevel=3)
    return "xla", -1


def _backend(backend: str) -> Backend:
    """The module implementing a resolved backend (:class:`~jax_ep.ep.types.Backend`); "cuda" is imported only
    when used."""
    if backend == "cuda":
        from . import cuda

        return cuda
    return xla


def _axis_size(axis_name: Hashable) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except (NameError, KeyError, ValueError) as err:
        raise ValueError(
            f"jax_ep: axis_name={axis_name!r} is not a bound mesh axis; call dispatch inside "
            f"jax.shard_map over a mesh that has this axis ({err})"
        ) from None


def dispatch(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    *,
    num_experts: int,
    axis_name: Hashable,
    layout: str = "ragged",
    capacity: int | None = None,
    expert_alignment: int = 1,
    drop_policy: str = "balanced",
    partial_dtype: Any = None,
    wire_dtype: Any = None,
    backend: str = "auto",
    transfer: str = "fused",
    xla_exchange: str = "auto",
) -> Dispatched:
    """Send each token to the ranks of its top-k experts.

    Call inside ``jax.shard_map`` over the EP mesh axis ``axis_name`` (R ranks);
    every argument is this rank's shard. The op works on the ``T = prod(B)``
    tokens of ``x``'s leading dimensions ``B``.

    Args:
      x: ``[*B, H]`` tokens, any floating dtype.
      topk_idx: ``[*B, K]`` global expert ids in ``[0, num_experts)``, any
        integer dtype; -1 marks an unused slot, any other value (one outside
        int32's range included) is invalid and counted.
      topk_weights: ``[*B, K]`` routing weights, any floating dtype: the weight
        used is its float32 value, and its gradient has ``topk_weights``' dtype.
      num_experts: E, a multiple of R. Expert ``e`` lives on rank ``e // L``.
      axis_name: the EP mesh axis.
      layout: ``"ragged"`` (expert segments one after another, for
        ``jax.lax.ragged_dot``) or ``"expert"`` (``[L, C, H]``).
      capacity: C, rows kept (ragged) or rows per local expert (expert);
        ``None`` is :func:`default_capacity`. Slots that do not fit are
        dropped, and counted in the :class:`Dispatched` returned.
      expert_alignment: ragged segments are padded to a multiple of this.
      drop_policy: which slots a too-small ragged ``capacity`` keeps: within
        each local expert always its first ones in (source rank, token, k)
        order. ``"balanced"``: expert ``j`` keeps ``min(n_j, c)`` of its
        ``n_j`` slots, ``c`` the largest integer with
        ``sum_j align_up(min(n_j, c), expert_alignment) <= C``. ``"expert"``:
        the first ``C`` rows of the layout without a capacity. The expert
        layout keeps each expert's first ``C`` slots under either.
      partial_dtype: the ``partial_dtype`` of the backward pass, a combine of
        the cotangent of ``Dispatched.x`` (None: its dtype);
        ``jnp.float32`` makes ``dx`` the float32 sum over slots, rounded once.
      wire_dtype: None (rows travel in ``x``'s dtype) or ``jnp.float8_e4m3fn``:
        rows travel as e4m3 with one float32 scale per 128 values (``H`` a
        multiple of 128) and ``x`` comes back dequantized; the gradient passes
        straight through.
      backend: ``"auto"``, ``"xla"`` or ``"cuda"``.
      transfer: ``"fused"`` (routing and rows in one exchange) or
        ``"separate"``: the routing in one exchange, then the rows along the
        handle in another, so that a ``jax.checkpoint`` that saves
        ``"jax_ep_handle"`` recomputes only the rows' transfer. Both give the
        same results and gradients bit for bit.
      xla_exchange: how the xla backend moves tokens: ``"dense"`` (a
        ``[R, T, H]`` buffer per trip, ``lax.all_to_all``), ``"ragged"`` (each
        (token, destination rank) pair once, ``lax.ragged_all_to_all``) or
        ``"auto"``: ragged on TPU, dense elsewhere. The same results bit for
        bit; the cuda backend ignores it.

    Returns:
      A :class:`Dispatched`; see its docstring for shapes. Under
      ``jax.checkpoint``, ``x`` is named ``"jax_ep_rows"`` and every other
      field ``"jax_ep_handle"`` (``jax.ad_checkpoint.checkpoint_name``).
    """
    config = _dispatch_config(
        x,
        topk_idx,
        topk_weights,
        num_experts=num_experts,
        axis_name=axis_name,
        layout=layout,
        capacity=capacity,
        expert_alignment=expert_alignment,
        drop_policy=drop_policy,
        partial_dtype=partial_dtype,
        wire_dtype=wire_dtype,
        backend=backend,
        xla_exchange=xla_exchange,
    )
    config = dataclasses.replace(config, site=_dispatch_site("jax_ep.dispatch", config, x))
    check_choice("transfer", transfer, TRANSFERS)
    if transfer == "separate" and config.backend == "cuda" and config.wire_dtype is not None:
        raise ValueError(
            "jax_ep.dispatch: backend 'cuda' moves the rows of transfer='separate' with its combine-backward kernel, "
            "which takes float32, bfloat16 or float16 rows, not FP8; use transfer='fused' with wire_dtype, or "
            "wire_dtype=None"
        )
    x, topk_idx, topk_weights = _flat_inputs(config, x, topk_idx, topk_weights)
    with jax.named_scope("jax_ep.dispatch"):
        if config.empty:
            return _finished(config, empty_dispatch(config, x))
        if transfer == "fused":
            return _finished(config, _dispatch(config, x, topk_idx, topk_weights))
        routed = _finished(config, _route(config, topk_idx, topk_weights))
        rows = _transfer(config, RowType(x.shape[1], jnp.dtype(x.dtype)), x, routed.handle)
        return dataclasses.replace(routed, x=checkpoint_name(rows.reshape(config.layout_shape(x.shape[1])), ROWS))


def _finished(config: Config, d: Dispatched) -> Dispatched:
    """A backend's dispatch with ``row_expert`` filled in and its fields named for ``jax.checkpoint`` policies:
    ``x`` ROWS, the others HANDLE."""
    d = dataclasses.replace(d, row_expert=_row_expert(config, d.group_sizes))
    rest = checkpoint_name(dataclasses.replace(d, x=None), HANDLE)
    return dataclasses.replace(rest, x=checkpoint_name(d.x, ROWS))


def _row_expert(config: Config, group_sizes: jax.Array) -> jax.Array | None:
    """Ragged: ``[C]`` int32, the local expert of each row, -1 past ``sum(group_sizes)``; expert layout: None."""
    if config.layout != "ragged":
        return None
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    rows = jax.lax.iota(jnp.int32, config.capacity)
    # Row i lies in segment j when j segments end at or before it (empty segments end where the previous one does).
    expert = jnp.searchsorted(ends, rows, side="right", method="scan_unrolled").astype(jnp.int32)
    return jnp.where(expert < config.local_experts, expert, -1)


def _dispatch_config(
    x,
    topk_idx,
    topk_weights,
    *,
    num_experts,
    axis_name,
    layout,
    capacity,
    expert_alignment,
    drop_policy,
    partial_dtype,
    wire_dtype,
    backend,
    xla_exchange,
) -> Config:
    """The checked arguments of a dispatch (or dispatch_start) as its static Config."""
    check_array("x", x, kind="floating")
    if x.ndim < 1:
        raise ValueError(f"jax_ep: x must have at least 1 dimension ([*B, H]), got shape {tuple(x.shape)}")
    token_shape, hidden = tuple(x.shape[:-1]), x.shape[-1]
    check_array("topk_idx", topk_idx, kind="integer")
    if topk_idx.ndim != x.ndim or tuple(topk_idx.shape[:-1]) != token_shape:
        raise ValueError(
            f"jax_ep: topk_idx must have shape [*B, K] with x's leading dimensions B = {token_shape}, "
            f"got shape {tuple(topk_idx.shape)} (x: {tuple(x.shape)})"
        )
    check_array("topk_weights", topk_weights, shape=topk_idx.shape, kind="floating")
    num_experts = check_positive_int("num_experts", num_experts)
    expert_alignment = check_positive_int("expert_alignment", expert_alignment)
    check_choice("layout", layout, LAYOUTS)
    check_choice("drop_policy", drop_policy, DROP_POLICIES)
    check_choice("xla_exchange", xla_exchange, XLA_EXCHANGES)
    if partial_dtype is not None:
        partial_dtype = check_float_dtype("partial_dtype", partial_dtype).name
    wire = fp8.check_wire_dtype(wire_dtype, hidden)
    if capacity is not None:
        capacity = check_positive_int("capacity", capacity)
    num_ranks = _axis_size(axis_name)
    _check_experts("jax_ep.dispatch", num_experts, num_ranks, f"the size of axis {axis_name!r}")
    num_tokens, topk = math.prod(token_shape), topk_idx.shape[-1]
    if capacity is None:
        capacity = _capacity(num_ranks, num_tokens, topk, num_experts, layout, expert_alignment)
    # An alignment past the capacity fits no segment of a slot: C + 1 keeps both drop policies' layouts (nothing
    # kept under "balanced", every row past C cut under "expert") with segment starts that stay small.
    expert_alignment = min(expert_alignment, capacity + 1)
    if layout == "ragged":
        # Both backends place the ragged layout's segments in int32: every slot that can arrive, with each local
        # expert's alignment padding, must stay within its range.
        local_experts = num_experts // num_ranks
        span = num_ranks * num_tokens * topk + local_experts * (expert_alignment - 1)
        if span > _INT32.max:
            raise ValueError(
                f"jax_ep: the ragged layout's segments span up to {span} rows (R * T * K slots plus "
                f"expert_alignment - 1 rows for each of the {local_experts} local experts), past int32's "
                f"{_INT32.max}; lower expert_alignment (now {expert_alignment}) or capacity"
            )
    resolved, group = _resolve_backend(backend, axis_name, num_ranks, topk, num_experts)
    return Config(
        axis_name=axis_name,
        num_ranks=num_ranks,
        num_experts=num_experts,
        num_tokens=num_tokens,
        topk=topk,
        layout=layout,
        capacity=capacity,
        expert_alignment=expert_alignment,
        backend=resolved,
        group=group,
        wire_dtype=None if wire is None else wire.name,
        drop_policy=drop_policy,
        partial_dtype=partial_dtype,
        xla_exchange=xla_exchange,
        token_shape=token_shape,
    )


_INT32 = np.iinfo(np.int32)


def _flat_inputs(config: Config, x, topk_idx, topk_weights) -> tuple[jax.Array, jax.Array, jax.Array]:
    """What every backend takes: ``x [T, H]``, ``topk_idx [T, K]`` int32 and ``topk_weights [T, K]`` float32.

    An id outside int32's range becomes ``-2**31``, an invalid id, never one that wraps around into a valid id or
    -1. The weights' float32 values are used, and their gradient comes back in their dtype.
    """
    num_tokens, topk = config.num_tokens, config.topk
    x = x.reshape(num_tokens, x.shape[-1])
    idx = topk_idx.reshape(num_tokens, topk)
    info = jnp.iinfo(idx.dtype)
    if info.min < _INT32.min or info.max > _INT32.max:
        fits = (idx <= np.array(_INT32.max, idx.dtype)) & (idx >= np.array(max(info.min, _INT32.min), idx.dtype))
        idx = jnp.where(fits, idx.astype(jnp.int32), _INT32.min)
    return x, idx.astype(jnp.int32), topk_weights.reshape(num_tokens, topk).astype(jnp.float32)


def combine(y: jax.Array, handle: Handle, *, weights: jax.Array | None = None, partial_dtype: Any = None) -> jax.Array:
    """Bring expert outputs back to their tokens and sum them.

    ``out[t] = sum over delivered slots (t, k) of w * y[row of (t, k)]`` with
    ``w = weights[row]``, or 1 when ``weights`` is None. Each rank sums the
    slots of a token it holds in float32 in row order and rounds that partial
    sum to ``partial_dtype`` (None: ``y``'s dtype); the source rank adds the
    ranks' partial sums in float32 in ascending rank order and rounds once to
    ``y``'s dtype. ``partial_dtype=jnp.float32`` gives the float32 sum over all
    delivered slots, rounded once.

    Args:
      y: expert outputs shaped like ``Dispatched.x`` (``[C, H]`` or
        ``[L, C, H]``), any floating dtype.
      handle: ``Dispatched.handle`` of the dispatch that made the layout.
      weights: optional, shaped like ``Dispatched.weights`` (``[C]`` or
        ``[L, C]``), floating; usually ``Dispatched.weights``.
      partial_dtype: None or a floating dtype: how each rank's partial sum
        travels.

    Returns:
      ``[*B, H']`` in the dtype of ``y``: the leading dimensions of the
      dispatched ``x``, and ``y``'s last dimension.
    """
    partial = _combine_partial_dtype(y, handle, weights, partial_dtype)
    with jax.named_scope("jax_ep.combine"):
        if handle.config.empty:
            return _empty_combine(handle.config, y)
        site = _combine_site("jax_ep.combine", y, handle, weights, partial)
        return _tokens(handle.config, _combine(partial, site, y, handle, weights))


def _tokens(config: Config, out: jax.Array) -> jax.Array:
    """A backend's combine output ``[T, H']`` shaped ``[*B, H']`` like the dispatched ``x``."""
    return out.reshape(*config.batch_shape, out.shape[-1])


def _empty_combine(config: Config, y: jax.Array) -> jax.Array:
    """The combine of a dispatch of no slot: zeros ``[*B, H']``, varying as ``y`` does."""
    return jax.lax.full_like(y, 0, y.dtype, (*config.batch_shape, y.shape[-1]))


def _dispatch_site(op: str, config: Config, x) -> int:
    """The call site of a dispatch, with what its data's layout depends on: its configuration and x's rows."""
    dtype = jnp.dtype(x.dtype).name
    return call_sites.site(op, *config.shape_key(), x.shape[-1], dtype, operands=_described("x", x))


def _combine_site(op: str, y, handle, weights, partial) -> int:
    """The call site of a combine, with what its data's layout depends on: the dispatch's configuration, y's rows,
    the weights' presence and the partial sums' dtype."""
    shape = (y.shape[-1], jnp.dtype(y.dtype).name, weights is None, jnp.dtype(partial).name)
    return call_sites.site(op, *handle.config.shape_key(), *shape, operands=_described("y", y))


def _described(name: str, a) -> str:
    """``name [shape] dtype``: an operand in a call site's description."""
    return f"{name} [{', '.join(map(str, a.shape))}] {jnp.dtype(a.dtype).name}"


def _combine_partial_dtype(y, handle, weights, partial_dtype) -> Any:
    """Checks combine's (or combine_start's) arguments; returns the partial sums' dtype."""
    if not isinstance(handle, Handle):
        raise TypeError(f"jax_ep.combine: handle must be a jax_ep.Handle (Dispatched.handle), got {type(handle)}")
    config = handle.config
    check_array("y", y, ndim=len(config.weights_shape) + 1, kind="floating", leading=config.weights_shape)
    if weights is not None:
        check_array("weights", weights, shape=config.weights_shape, kind="floating")
    return y.dtype if partial_dtype is None else check_float_dtype("partial_dtype", partial_dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(config: Config, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    rows = fp8.wire_rows(x, config.wire_dtype)  # packed FP8 rows travel as bytes; the backward pass is unchanged
    d = _backend(config.backend).dispatch(config, rows, topk_idx, topk_weights)
    return _unwire(config, d, RowType(x.shape[1], x.dtype))


def _unwire(config: Config, d: Dispatched, x_type: RowType) -> Dispatched:
    """``d`` with its layout rows dequantized, where they travelled as FP8."""
    if config.wire_dtype is None:
        return d
    rows = fp8.unpack(d.x.reshape(config.num_rows, -1), x_type.hidden, x_type.dtype)
    return dataclasses.replace(d, x=rows.reshape(config.layout_shape(x_type.hidden)))


def _dispatch_fwd(config, x, topk_idx, topk_weights):
    result = _dispatch(config, x, topk_idx, topk_weights)
    return result, checkpoint_name(result.handle, HANDLE)


def _dispatch_bwd(config, handle, cotangent):
    rows_ct = cotangent.x.reshape(config.num_rows, cotangent.x.shape[-1])
    backend = _backend(config.backend)
    partial = config.partial_dtype or rows_ct.dtype
    site = call_sites.backward(config.site, "the backward pass")
    dx, dtopk_weights = backend.combine(handle, rows_ct, None, partial, cotangent.weights.reshape(-1), site=site)
    return dx, None, dtopk_weights


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


# transfer="separate": the routing (no rows) and the rows' transfer along its handle, each with its own VJP.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _route(config: Config, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    return _backend(config.backend).route(config, topk_idx, topk_weights)


def _route_fwd(config, topk_idx, topk_weights):
    result = _route(config, topk_idx, topk_weights)
    return result, checkpoint_name(result.handle, HANDLE)


def _route_bwd(config, handle, cotangent):
    no_rows = jax.lax.full_like(handle.row_slot, 0, jnp.float32, (config.num_rows, 0))  # varies as the handle
    backend = _backend(config.backend)
    site = call_sites.backward(config.site, "the backward pass")
    _, dtopk_weights = backend.combine(handle, no_rows, None, jnp.float32, cotangent.weights.reshape(-1), site=site)
    return None, dtopk_weights


_route.defvjp(_route_fwd, _route_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _transfer(config: Config, x_type: RowType, x: jax.Array, handle: Handle) -> jax.Array:
    site = call_sites.backward(config.site, "the rows' transfer")
    rows = _backend(config.backend).transfer(handle, fp8.wire_rows(x, config.wire_dtype), site=site)
    return rows if config.wire_dtype is None else fp8.unpack(rows, x_type.hidden, x_type.dtype)


def _transfer_fwd(config, x_type, x, handle):
    return _transfer(config, x_type, x, handle), checkpoint_name(handle, HANDLE)


def _transfer_bwd(config, x_type, handle, rows_ct):
    site = call_sites.backward(config.site, "the backward pass of the rows' transfer")
    partial = config.partial_dtype or rows_ct.dtype
    dx, _ = _backend(config.backend).combine(handle, rows_ct, None, partial, site=site)
    return dx, None


_transfer.defvjp(_transfer_fwd, _transfer_bwd)


# A combine op's static arguments: partial_dtype and its call site (call_sites).
@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine(partial_dtype: Any, site: int, y: jax.Array, handle: Handle, weights: jax.Array | None) -> jax.Array:
    rows, flat_weights = _combine_rows(y, handle, weights)
    return _backend(handle.config.backend).combine(handle, rows, flat_weights, partial_dtype, site=site)[0]


def _saving_combine_inputs(op):
    """The fwd rule of a combine op whose backward pass needs ``y``, the handle and the weights."""

    def fwd(partial_dtype, site, y, handle, weights, *rest):
        return op(partial_dtype, site, y, handle, weights, *rest), (y, handle, weights)

    return fwd


def _combine_bwd(partial_dtype, site, residuals, cotangent):
    y, handle, weights = residuals
    backend = _backend(handle.config.backend)
    backward = call_sites.backward(site, "the backward pass")
    dy, dweights = backend.combine_backward(handle, cotangent, y, weights, site=backward)
    return dy, None, dweights


_combine.defvjp(_saving_combine_inputs(_combine), _combine_bwd)


def dispatch_start(x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, **kwargs: Any) -> PendingDispatch:
    """The first half of :func:`dispatch` (same arguments): its result goes to :func:`dispatch_finish`.

    ``dispatch_finish(dispatch_start(...))`` equals ``dispatch(...)`` bit for bit, gradients included, and
    XLA may schedule computation that does not depend on the dispatch between the two. On the cuda backend
    the start routes and sends, and the finish waits for the peers and receives; between the two the EP group
    must run no other jax_ep op (the kernels fail the call otherwise). On the xla backend the finish runs the
    whole exchange, which XLA schedules as it always does. See docs/guide.md.
    """
    keywords = _dispatch_keywords(kwargs)
    if keywords.pop("transfer") != "fused":
        raise ValueError("jax_ep.dispatch_start: transfer must be 'fused'; the split ops route and send in the start")
    config = _dispatch_config(x, topk_idx, topk_weights, **keywords)
    config = dataclasses.replace(config, site=_dispatch_site("jax_ep.dispatch_start", config, x))
    x, topk_idx, topk_weights = _flat_inputs(config, x, topk_idx, topk_weights)
    x_type = RowType(x.shape[1], jnp.dtype(x.dtype))
    with jax.named_scope("jax_ep.dispatch_start"):
        if config.empty:  # the finish makes the empty dispatch from x alone
            started = x
        else:
            started = _dispatch_start(config, x_type, x, topk_idx, topk_weights)
    return PendingDispatch(started, config, x_type)


def _dispatch_keywords(kwargs: dict[str, Any]) -> dict[str, Any]:
    """dispatch's keyword arguments, defaults filled in (a TypeError names a missing or unknown one)."""
    bound = inspect.signature(dispatch).bind(None, None, None, **kwargs)
    bound.apply_defaults()
    return {name: value for name, value in bound.arguments.items() if name not in ("x", "topk_idx", "topk_weights")}


def dispatch_finish(pending: PendingDispatch) -> Dispatched:
    """The :class:`Dispatched` of a :func:`dispatch_start`."""
    if not isinstance(pending, PendingDispatch):
        raise TypeError(
            f"jax_ep.dispatch_finish: expected what jax_ep.dispatch_start returned, got {type(pending).__name__}"
        )
    config = pending.config
    with jax.named_scope("jax_ep.dispatch_finish"):
        if config.empty:
            return _finished(config, empty_dispatch(config, pending.started))
        return _finished(config, _dispatch_finish(config, pending.x_type, pending.started))


def combine_start(
    y: jax.Array, handle: Handle, *, weights: jax.Array | None = None, partial_dtype: Any = None
) -> PendingCombine:
    """The first half of :func:`combine` (same arguments): its result goes to :func:`combine_finish`.

    ``combine_finish(combine_start(...))`` equals ``combine(...)`` bit for bit, gradients included; the
    halves split as :func:`dispatch_start`'s do.
    """
    partial = _combine_partial_dtype(y, handle, weights, partial_dtype)
    site = _combine_site("jax_ep.combine_start", y, handle, weights, partial)
    with jax.named_scope("jax_ep.combine_start"):
        started = None if handle.config.empty else _combine_start(partial, site, y, handle, weights)
    return PendingCombine(y, handle, weights, started, partial, site)


def combine_finish(pending: PendingCombine) -> jax.Array:
    """The ``[*B, H']`` output of a :func:`combine_start`."""
    if not isinstance(pending, PendingCombine):
        raise TypeError(
            f"jax_ep.combine_finish: expected what jax_ep.combine_start returned, got {type(pending).__name__}"
        )
    q = pending
    config = q.handle.config
    with jax.named_scope("jax_ep.combine_finish"):
        if config.empty:
            return _empty_combine(config, q.y)
        return _tokens(config, _combine_finish(q.partial_dtype, q.site, q.y, q.handle, q.weights, q.started))


# The split ops' custom VJPs. The backward pass of each finish starts the backward exchange and the backward
# pass of its start finishes it; the cotangent of `started` carries what the second needs from the first. A
# dispatch's finish takes only `started`, so the cotangents of x and topk_weights come from the start, as from
# a whole dispatch, and add up with x's other uses in the same order.


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_start(config: Config, x_type: RowType, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Any:
    rows = fp8.wire_rows(x, config.wire_dtype)
    return _backend(config.backend).dispatch_start(config, rows, topk_idx, topk_weights, x_type)


def _dispatch_start_fwd(config, x_type, x, topk_idx, topk_weights):
    started = _dispatch_start(config, x_type, x, topk_idx, topk_weights)
    return started, started


def _dispatch_start_bwd(config, x_type, started, dstarted):
    dx, dweights = _backend(config.backend).dispatch_start_backward(config, started, dstarted, x_type)
    return dx, None, dweights


_dispatch_start.defvjp(_dispatch_start_fwd, _dispatch_start_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _dispatch_finish(config: Config, x_type: RowType, started: Any) -> Dispatched:
    return _unwire(config, _backend(config.backend).dispatch_finish(config, started), x_type)


def _dispatch_finish_fwd(config, x_type, started):
    result = _dispatch_finish(config, x_type, started)
    return result, checkpoint_name(result.handle, HANDLE)


def _dispatch_finish_bwd(config, x_type, handle, cotangent):
    rows_ct = cotangent.x.reshape(config.num_rows, cotangent.x.shape[-1])
    backend = _backend(config.backend)
    return (backend.dispatch_finish_backward(handle, rows_ct, cotangent.weights.reshape(-1)),)


_dispatch_finish.defvjp(_dispatch_finish_fwd, _dispatch_finish_bwd)


def _combine_rows(y: jax.Array, handle: Handle, weights: jax.Array | None) -> tuple[jax.Array, jax.Array | None]:
    return y.reshape(handle.config.num_rows, y.shape[-1]), None if weights is None else weights.reshape(-1)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine_start(partial_dtype: Any, site: int, y: jax.Array, handle: Handle, weights: jax.Array | None) -> Any:
    rows, flat_weights = _combine_rows(y, handle, weights)
    return _backend(handle.config.backend).combine_start(handle, rows, flat_weights, partial_dtype, site=site)


def _combine_start_bwd(partial_dtype, site, residuals, dstarted):
    y, handle, weights = residuals
    backend = _backend(handle.config.backend)
    backward = call_sites.backward(site, "the backward pass")
    dy, dweights = backend.combine_start_backward(handle, y, weights, dstarted, site=backward)
    return dy, None, dweights


_combine_start.defvjp(_saving_combine_inputs(_combine_start), _combine_start_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _combine_finish(
    partial_dtype: Any, site: int, y: jax.Array, handle: Handle, weights: jax.Array | None, started: Any
) -> jax.Array:
    rows, flat_weights = _combine_rows(y, handle, weights)
    backend = _backend(handle.config.backend)
    return backend.combine_finish(handle, rows, flat_weights, partial_dtype, started, site=site)


def _combine_finish_bwd(partial_dtype, site, residuals, cotangent):
    y, handle, weights = residuals
    backend = _backend(handle.config.backend)
    backward = call_sites.backward(site, "the backward pass")
    dy, dweights, dstarted = backend.combine_finish_backward(handle, cotangent, y, weights, site=backward)
    return dy, None, dweights, dstarted


_combine_finish.defvjp(_saving_combine_inputs(_combine_finish), _combine_finish_bwd)
