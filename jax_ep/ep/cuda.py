"""The "cuda" backend: one ``jax.ffi`` call per op into the project's CUDA kernels.

* ``jax_ep_dispatch``: routing layout (kernel 1), then one kernel that stores each token once into every
  peer rank it is routed to and expands what it receives into the layout (kernel 2).
* ``jax_ep_combine_backward``: one kernel: each token's cotangent travels along the handle's routing like a
  dispatch, and each held row gets ``dy = w * g`` and ``dweights = <g, y[row]>`` where it lives.
* ``jax_ep_combine``: one kernel: partial sums to their source ranks, then each source adds them in rank order
  (also the backward pass of dispatch, with the weights' cotangent going back to the slots).

Each FFI target is specified once, in :data:`TARGETS`: its operands in order (after them, every call passes this
rank's ``lax.axis_index``, which the kernels check against the group's rank), its attributes (one set per op,
:func:`_attrs`) and its results in order, each a name, a dtype and a shape from the call's sizes (a dispatch's are
:data:`jax_ep.ep.types.ROUTED` and :data:`~jax_ep.ep.types.RECEIVED`).
``ffi/xla/handlers.cc`` binds the same operands and results, typed, in the same order, and the attributes as one
struct per op. The results come back by name, and the dispatch's make the :class:`Dispatched` and :class:`Handle`
fields of the same names.

The split ops run each op's kernel in two launches, one FFI call each: ``*_start`` sends (and, for dispatch,
routes) and leaves the call open on the GPU; ``*_finish`` waits for the peers and receives. Each finish takes
one of its start's outputs, only so that XLA runs it after the start. The backward pass of ``dispatch_finish``
starts a combine that stages this rank's own partial sums as well (``stage_own``), so that the backward pass of
``dispatch_start`` can finish it from the start's own outputs (``token_dest_pos``, ``slot_dest``), without the
cotangent rows.

Where the group reaches a rank through NCCL, every call goes to the ``*_uncaptured`` twin of its target, which XLA
never records into a command buffer (:func:`target_name`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from . import call_sites
from . import group as _group
from .types import LIKE_ROWS, RECEIVED, ROUTED, Config, Dispatched, Handle, Result, RowType, dispatched

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


class Target(NamedTuple):
    name: str
    operands: tuple[str, ...]
    results: tuple[Result, ...]


_F32 = jnp.float32
SENT = (Result("sent", _F32, ("1",)),)  # a start's output (0): what its finish takes, to run after it
BACKWARD = (Result("dy", LIKE_ROWS, ("N", "H")), Result("dweights", _F32, ("weighted",)))
COMBINED = (Result("out", LIKE_ROWS, ("T", "H")), Result("slot_values", _F32, ("valued",)))

_DISPATCH_IN = ("x", "topk_idx", "topk_weights")
_BACKWARD_IN = ("g", "y", "weights", "token_dest_pos", "recv_rows", "recv_counts", "row_slot")
_COMBINE_IN = ("y", "weights", "row_values", "recv_rows", "recv_counts", "token_dest_pos", "slot_dest")
TARGETS = {
    target.name: target
    for target in (
        Target("jax_ep_dispatch", _DISPATCH_IN, RECEIVED + ROUTED),
        Target("jax_ep_dispatch_start", _DISPATCH_IN, ROUTED + SENT),
        Target("jax_ep_dispatch_finish", (*_DISPATCH_IN, "token_dest_pos", "slot_dest"), RECEIVED),
        Target("jax_ep_combine_backward", _BACKWARD_IN, BACKWARD),
        Target("jax_ep_combine_backward_start", _BACKWARD_IN, SENT),
        Target("jax_ep_combine_backward_finish", (*_BACKWARD_IN, "sent"), BACKWARD),
        Target("jax_ep_combine", _COMBINE_IN, COMBINED),
        Target("jax_ep_combine_start", _COMBINE_IN, SENT),
        Target("jax_ep_combine_finish", (*_COMBINE_IN, "sent"), COMBINED),
    )
}


class DispatchStarted(NamedTuple):
    """What :func:`dispatch_start` hands to :func:`dispatch_finish`: its inputs and its routing outputs. In the
    backward pass, the cotangent's ``sent`` carries the started combine of the finish's backward pass to the
    start's."""

    rows: jax.Array | None
    topk_idx: jax.Array | None
    topk_weights: jax.Array | None
    sent: jax.Array
    token_dest_pos: jax.Array | None = None
    slot_dest: jax.Array | None = None


class CombineStarted(NamedTuple):
    """What :func:`combine_start` hands to :func:`combine_finish`: ``sent``, which orders the finish after it, and
    ``g_link``, a ``[T, H]`` placeholder whose cotangent carries combine's output cotangent to the backward pass of
    the start."""

    sent: jax.Array
    g_link: jax.Array


def on_gpus() -> bool:
    """Whether jax's default devices are GPUs."""
    return jax.default_backend() == "gpu"


def find_group(axis_name: Hashable, num_ranks: int, topk: int, num_experts: int) -> tuple[int | None, str]:
    """The id of the group that can serve this dispatch, or None and why not."""
    if not on_gpus():
        return None, f"it runs on NVIDIA GPUs, and jax's devices here are {jax.default_backend()} devices"
    if not _group.available():
        return None, _group.unavailable_reason()
    group = _group.group_for(axis_name)
    if group is None:
        return None, f"call jax_ep.initialize(mesh, {axis_name!r}, ...) first to create the group's GPU memory"
    if group.num_ranks != num_ranks:
        return None, (
            f"jax_ep.initialize made the group of axis {axis_name!r} for {group.num_ranks} ranks, "
            f"but this dispatch runs over {num_ranks}"
        )
    reason = _group.over_limits(topk=topk, num_experts=num_experts)
    return (None, reason) if reason else (group.id, "")


def target_name(target: str, group: _group.Group) -> str:
    """The FFI target that runs ``target`` for ``group``: one XLA may capture in command buffers, or, where the group
    talks NCCL (whose captured calls every rank must capture alike), one it never captures."""
    return target + "_uncaptured" if group.uses_nccl() else target


def _attrs(config: Config, target: str, site: int, **combine: bool) -> dict[str, Any]:
    """The attributes of a call of ``target``: the group and the call site, then the op's own (ffi/xla/handlers.cc:
    DispatchAttrs, CombineAttrs, CallAttrs)."""
    attrs = dict(group=config.group, site=site)
    if target.startswith("jax_ep_dispatch"):
        attrs.update(
            num_experts=config.num_experts,
            capacity=config.capacity,
            alignment=config.expert_alignment,
            expert_layout=config.layout == "expert",
            balanced=config.drop_policy == "balanced",
        )
    return {**attrs, **combine}


def _call(
    target: str,
    config: Config,
    like: jax.Array,
    sizes: dict[str, tuple[int, ...]],
    rows_dtype: Any,
    *operands,
    site: int,
    **combine: bool,
) -> dict[str, jax.Array]:
    """One FFI call of ``target`` (its spec in TARGETS) from call site ``site`` (call_sites): the operands, then this
    rank's axis index. Results vary over the mesh axes of ``like`` (inside ``shard_map``); returns them by name."""
    spec = TARGETS[target]
    assert len(operands) == len(spec.operands), (target, len(operands))
    types = []
    for result in spec.results:
        dtype = jnp.dtype(rows_dtype if result.dtype is LIKE_ROWS else result.dtype)
        types.append(jax.typeof(like).update(shape=result.shape_in(sizes), dtype=dtype, weak_type=False))
    rank = jax.lax.axis_index(config.axis_name).astype(jnp.int32)
    call = jax.ffi.ffi_call(target_name(target, _group.group_by_id(config.group)), tuple(types))
    out = call(*operands, rank, **_attrs(config, target, site, **combine))
    return {result.name: value for result, value in zip(spec.results, out, strict=True)}


def _zeros(like: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros that vary over the same mesh axes as ``like``: a placeholder whose cotangent carries a value."""
    return jax.lax.full_like(like, 0, dtype, shape)


def _check_dtype(name: str, value: jax.Array) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"jax_ep: backend 'cuda' moves float32, bfloat16 or float16 {name}, got {value.dtype}; use backend='xla'"
        )


def _dispatch(target: str, config: Config, rows: jax.Array, *operands: jax.Array) -> dict[str, jax.Array]:
    if config.wire_dtype is None:
        _check_dtype("x", rows)
    sizes = config.sizes(rows.shape[1])
    return _call(target, config, rows, sizes, rows.dtype, rows, *operands, site=config.site)


def dispatch(config: Config, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    """Forward dispatch on one rank in one FFI call; see :func:`jax_ep.dispatch`.

    With ``config.wire_dtype`` set, ``x`` holds packed FP8 rows (uint8, ``jax_ep.ep.fp8``): bytes to move.
    """
    return dispatched(config, _dispatch("jax_ep_dispatch", config, x, topk_idx, topk_weights))


def route(config: Config, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    """A dispatch of rows of no bytes: the routing, weights, sizes and handle (``x`` has no columns)."""
    return dispatch(config, _zeros(topk_weights, (config.num_tokens, 0), jnp.float32), topk_idx, topk_weights)


def dispatch_start(
    config: Config, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, x_type: RowType
) -> DispatchStarted:
    """Routing and the send phase."""
    del x_type
    out = _dispatch("jax_ep_dispatch_start", config, rows, topk_idx, topk_weights)
    return DispatchStarted(rows, topk_idx, topk_weights, out["sent"], out["token_dest_pos"], out["slot_dest"])


def dispatch_finish(config: Config, started: DispatchStarted) -> Dispatched:
    """The receive phase of :func:`dispatch_start`'s call."""
    s = started
    out = _dispatch("jax_ep_dispatch_finish", config, s.rows, s.topk_idx, s.topk_weights, s.token_dest_pos, s.slot_dest)
    return dispatched(config, {**out, "token_dest_pos": s.token_dest_pos, "slot_dest": s.slot_dest})


def _combine_operands(
    handle: Handle, rows: jax.Array, weights: jax.Array | None, row_values: jax.Array | None
) -> tuple[jax.Array, ...]:
    _check_dtype("y", rows)
    empty = jnp.zeros((0,), jnp.float32)
    h = handle
    return (
        rows,
        empty if weights is None else weights.astype(jnp.float32),
        empty if row_values is None else row_values.astype(jnp.float32),
        h.recv_rows,
        h.recv_counts,
        h.token_dest_pos,
        h.slot_dest,
    )


def _partial_f32(rows: jax.Array, partial_dtype: Any) -> bool:
    if jnp.dtype(partial_dtype) not in (jnp.dtype(jnp.float32), rows.dtype):
        raise TypeError(
            f"jax_ep: backend 'cuda' sends partial sums as float32 or as y's dtype {rows.dtype}, got {partial_dtype}"
        )
    return jnp.dtype(partial_dtype) == jnp.dtype(jnp.float32) and rows.dtype != jnp.float32


def _combine(
    target: str,
    config: Config,
    operands: tuple,
    hidden: int,
    dtype: Any,
    *,
    site: int,
    with_values: bool = False,
    partial_f32: bool = False,
    stage_own: bool = False,
) -> dict[str, jax.Array]:
    """A combine call (whole, start or finish): the [T, H] sums ``out`` and, with values, ``slot_values``."""
    like = operands[5]  # token_dest_pos: a finish with staged partial sums may have no rows
    sizes = config.sizes(hidden, valued=(config.num_tokens, config.topk) if with_values else (0,))
    combine = dict(partial_f32=partial_f32, stage_own=stage_own)
    return _call(target, config, like, sizes, dtype, *operands, site=site, **combine)


def combine(
    handle: Handle,
    rows: jax.Array,
    weights: jax.Array | None,
    partial_dtype: Any,
    row_values: jax.Array | None = None,
    *,
    site: int,
) -> tuple[jax.Array, jax.Array | None]:
    """Combine (and dispatch's backward pass) in one FFI call; see ``xla.py:combine``."""
    operands = _combine_operands(handle, rows, weights, row_values)
    with_values, partial_f32 = row_values is not None, _partial_f32(rows, partial_dtype)
    args = (handle.config, operands, rows.shape[1], rows.dtype)
    out = _combine("jax_ep_combine", *args, site=site, with_values=with_values, partial_f32=partial_f32)
    return out["out"], (out["slot_values"] if with_values else None)


def combine_start(
    handle: Handle, rows: jax.Array, weights: jax.Array | None, partial_dtype: Any, *, site: int
) -> CombineStarted:
    """The send phase."""
    operands = _combine_operands(handle, rows, weights, None)
    args = (handle.config, operands, rows.shape[1], rows.dtype)
    sent = _combine("jax_ep_combine_start", *args, site=site, partial_f32=_partial_f32(rows, partial_dtype))["sent"]
    return CombineStarted(sent, _zeros(rows, (handle.config.num_tokens, rows.shape[1]), rows.dtype))


def combine_finish(
    handle: Handle, rows: jax.Array, weights: jax.Array | None, partial_dtype: Any, started: CombineStarted, *, site
) -> jax.Array:
    """The receive phase of :func:`combine_start`'s call (this rank's own partial sums from ``rows``)."""
    operands = (*_combine_operands(handle, rows, weights, None), started.sent)
    args = (handle.config, operands, rows.shape[1], rows.dtype)
    return _combine("jax_ep_combine_finish", *args, site=site, partial_f32=_partial_f32(rows, partial_dtype))["out"]


def dispatch_finish_backward(handle: Handle, rows_ct: jax.Array, weights_ct: jax.Array) -> DispatchStarted:
    """The backward pass of the finish: the start of the cotangents' combine, carried in ``sent``. It stages this
    rank's own partial sums too, so that its finish needs only what the start made."""
    config = handle.config
    operands = _combine_operands(handle, rows_ct, None, weights_ct)
    site = call_sites.backward(config.site, "the backward pass")
    partial_f32 = _partial_f32(rows_ct, config.partial_dtype or rows_ct.dtype)
    args = (config, operands, rows_ct.shape[1], rows_ct.dtype)
    sent = _combine("jax_ep_combine_start", *args, site=site, partial_f32=partial_f32, stage_own=True)["sent"]
    return DispatchStarted(None, None, None, sent)


def dispatch_start_backward(config: Config, started: DispatchStarted, dstarted: DispatchStarted, x_type: RowType):
    """The backward pass of the start: that combine's finish, from the start's own outputs. Returns (dx, dweights)."""
    hidden, dtype = x_type
    empty = jnp.zeros((0,), jnp.float32)
    operands = (
        _zeros(started.token_dest_pos, (0, hidden), dtype),  # no y: the start staged every partial sum
        empty,
        empty,
        jnp.zeros((0, 0, 0), jnp.int32),
        jnp.zeros((0,), jnp.int32),
        started.token_dest_pos,
        started.slot_dest,
        dstarted.sent,
    )
    site = call_sites.backward(config.site, "the backward pass")
    partial_f32 = _partial_f32(operands[0], config.partial_dtype or dtype)  # as the start's (its rows' dtype)
    args = (config, operands, hidden, dtype)
    out = _combine("jax_ep_combine_finish", *args, site=site, with_values=True, partial_f32=partial_f32, stage_own=True)
    return out["out"], out["slot_values"]


def _backward(target: str, handle: Handle, operands: tuple, y: jax.Array, weights: jax.Array | None, site: int):
    config = handle.config
    weighted = (config.num_rows,) if weights is not None else (0,)
    rows = y.reshape(config.num_rows, -1)
    return _call(target, config, rows, config.sizes(rows.shape[1], weighted=weighted), y.dtype, *operands, site=site)


def _backward_operands(handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None) -> tuple:
    _check_dtype("y", y)
    rows = y.reshape(handle.config.num_rows, -1)
    flat_weights = jnp.zeros((0,), jnp.float32) if weights is None else weights.reshape(-1).astype(jnp.float32)
    h = handle
    return (cotangent.astype(rows.dtype), rows, flat_weights, h.token_dest_pos, h.recv_rows, h.recv_counts, h.row_slot)


def _backward_outputs(y: jax.Array, weights: jax.Array | None, out: dict[str, jax.Array]):
    dy = out["dy"].reshape(y.shape)
    if weights is None:
        return dy, None
    return dy, out["dweights"].reshape(weights.shape).astype(weights.dtype)


def combine_backward(
    handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None, *, site: int
) -> tuple[jax.Array, jax.Array | None]:
    """The backward pass of combine in one FFI call; see ``xla.py:combine_backward``."""
    operands = _backward_operands(handle, cotangent, y, weights)
    return _backward_outputs(y, weights, _backward("jax_ep_combine_backward", handle, operands, y, weights, site))


def transfer(handle: Handle, rows: jax.Array, *, site: int) -> jax.Array:
    """Token rows ``[T, W]`` along ``handle`` with the combine-backward kernel (weight 1, no ``y``): ``[N, W]``."""
    config = handle.config
    _check_dtype("x", rows)
    no_y = _zeros(rows, (config.num_rows, 0), rows.dtype)
    h = handle
    operands = (rows, no_y, jnp.zeros((0,), jnp.float32), h.token_dest_pos, h.recv_rows, h.recv_counts, h.row_slot)
    sizes = config.sizes(rows.shape[1], weighted=(0,))
    return _call("jax_ep_combine_backward", config, rows, sizes, rows.dtype, *operands, site=site)["dy"]


def combine_finish_backward(handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None, *, site):
    """The backward pass of the finish: the send phase of combine's backward pass. Returns (dy, dweights,
    dstarted), dstarted carrying the start's output and the cotangent to :func:`combine_start_backward`."""
    operands = _backward_operands(handle, cotangent, y, weights)
    sent = _backward("jax_ep_combine_backward_start", handle, operands, y, weights, site)["sent"]
    return None, None, CombineStarted(sent, operands[0])


def combine_start_backward(
    handle: Handle, y: jax.Array, weights: jax.Array | None, dstarted: CombineStarted, *, site: int
):
    """The backward pass of the start: the receive phase of combine's backward pass. Returns (dy, dweights)."""
    operands = (*_backward_operands(handle, dstarted.g_link, y, weights), dstarted.sent)
    out = _backward("jax_ep_combine_backward_finish", handle, operands, y, weights, site)
    return _backward_outputs(y, weights, out)
