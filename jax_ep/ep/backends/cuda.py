"""The "cuda" backend: one ``jax.ffi`` call per op into the project's CUDA kernels.

* ``jax_ep_dispatch``: routing layout (kernel 1), then one kernel that stores each token once into every
  peer rank it is routed to and expands what it receives into the layout (kernel 2).
* ``jax_ep_combine_backward``: one kernel: each token's cotangent travels along the handle's routing like a
  dispatch, and each held row gets ``dy = w * g`` and ``dweights = <g, y[row]>`` where it lives.
* ``jax_ep_combine``: one kernel: partial sums to their source ranks, then each source adds them in rank order
  (also the backward pass of dispatch, with the weights' cotangent going back to the slots).

Every call takes this rank's ``lax.axis_index``, which the kernels check against the group's rank.

The split ops run each op's kernel in two launches, one FFI call each: ``*_start`` sends (and, for dispatch,
routes) and leaves the call open on the GPU; ``*_finish`` waits for the peers and receives. Each finish takes
one of its start's outputs, only so that XLA runs it after the start. The backward pass of ``dispatch_finish``
starts a combine that stages this rank's own partial sums as well (``stage_own``), so that the backward pass of
``dispatch_start`` can finish it from the start's own outputs (``token_dest_pos``, ``slot_dest``), without the
cotangent rows.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp

from .. import group as _group
from ..types import CombineStarted, Config, Dispatched, DispatchStarted, Handle, RowType

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


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
    limits = _group.limits()
    if topk > limits["max_topk"]:
        return None, f"topk must be at most {limits['max_topk']} for backend 'cuda', got {topk}"
    if num_experts > limits["max_experts"]:
        return None, f"num_experts must be at most {limits['max_experts']} for backend 'cuda', got {num_experts}"
    return group.id, ""


def _result(like: jax.Array, shape: tuple[int, ...], dtype: Any) -> Any:
    """Result type that varies over the same mesh axes as ``like`` (inside ``shard_map``)."""
    return jax.typeof(like).update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)


def _zeros(like: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros that vary over the same mesh axes as ``like``: a placeholder whose cotangent carries a value."""
    return jax.lax.full_like(like, 0, dtype, shape)


def _check_dtype(name: str, value: jax.Array) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"jax_ep: backend 'cuda' moves float32, bfloat16 or float16 {name}, got {value.dtype}; use backend='xla'"
        )


def _call(target: str, results: dict[str, Any], *args: jax.Array, config: Config, **attrs: Any) -> dict[str, jax.Array]:
    """One FFI call of ``target``. ``results`` maps each result's name to its type; the extension's ``results()``
    (ffi/xla/handlers.h, kTargets) gives their order. Returns each result by its name."""
    names = _group.extension().results()[target]
    assert set(names) == set(results), f"{target} returns {names}, not {sorted(results)}"
    rank = jax.lax.axis_index(config.axis_name).astype(jnp.int32)
    call = jax.ffi.ffi_call(target, tuple(results[name] for name in names))
    return dict(zip(names, call(*args, rank, group=config.group, **attrs), strict=True))


def _dispatch_attrs(config: Config) -> dict[str, Any]:
    return dict(
        config=config,
        num_experts=config.num_experts,
        expert_layout=config.layout == "expert",
        capacity=config.capacity,
        alignment=config.expert_alignment,
    )


def _received(config: Config, x: jax.Array) -> dict[str, Any]:
    """Result types of what a dispatch's receive phase writes."""
    i32 = jnp.int32
    return {
        "x": _result(x, (config.num_rows, x.shape[1]), x.dtype),
        "weights": _result(x, (config.num_rows,), jnp.float32),
        "group_sizes": _result(x, (config.local_experts,), i32),
        "num_dropped": _result(x, (), i32),
        "num_invalid": _result(x, (), i32),
        "send_counts": _result(x, (config.num_ranks,), i32),
        "recv_rows": _result(x, (config.num_ranks, config.num_tokens, config.topk), i32),
        "recv_counts": _result(x, (config.num_ranks,), i32),
        "row_slot": _result(x, (config.num_rows,), i32),
    }


def _routed(config: Config, x: jax.Array) -> dict[str, Any]:
    """Result types of what the routing and send phase writes."""
    return {
        "token_dest_pos": _result(x, (config.num_tokens, config.num_ranks), jnp.int32),
        "slot_dest": _result(x, (config.num_tokens, config.topk), jnp.int32),
    }


def _dispatched(config: Config, hidden: int, out: dict[str, jax.Array]) -> Dispatched:
    """The dispatch's outputs, by name: the receive phase's and the routing phase's."""
    routing = {field.name: out[field.name] for field in dataclasses.fields(Handle) if field.name != "config"}
    return Dispatched(
        x=out["x"].reshape(config.layout_shape(hidden)),
        weights=out["weights"].reshape(config.weights_shape),
        group_sizes=out["group_sizes"],
        num_dropped=out["num_dropped"],
        num_invalid=out["num_invalid"],
        handle=Handle(**routing, config=config),
    )


def dispatch(config: Config, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    """Forward dispatch on one rank in one FFI call; see :func:`jax_ep.dispatch`.

    With ``config.wire_dtype`` set, ``x`` holds packed FP8 rows (uint8, ``jax_ep.ep.fp8``): bytes to move.
    """
    if config.wire_dtype is None:
        _check_dtype("x", x)
    results = {**_received(config, x), **_routed(config, x)}
    out = _call("jax_ep_dispatch", results, x, topk_idx, topk_weights, **_dispatch_attrs(config))
    return _dispatched(config, x.shape[1], out)


def route(config: Config, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    """A dispatch of rows of no bytes: the routing, weights, sizes and handle (``x`` has no columns)."""
    return dispatch(config, _zeros(topk_weights, (config.num_tokens, 0), jnp.float32), topk_idx, topk_weights)


def transfer(handle: Handle, rows: jax.Array) -> jax.Array:
    """Token rows ``[T, W]`` along ``handle`` with the combine-backward kernel (weight 1, no ``y``): ``[N, W]``."""
    config = handle.config
    _check_dtype("x", rows)
    h, no_y, no_weights = handle, _zeros(rows, (config.num_rows, 0), rows.dtype), jnp.zeros((0,), jnp.float32)
    operands = (rows, no_y, no_weights, h.token_dest_pos, h.recv_rows, h.recv_counts, h.row_slot)
    results = {
        "dy": _result(rows, (config.num_rows, rows.shape[1]), rows.dtype),
        "dweights": _result(rows, (0,), jnp.float32),
    }
    return _call("jax_ep_combine_backward", results, *operands, config=config)["dy"]


def dispatch_start(
    config: Config, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, x_type: RowType
) -> DispatchStarted:
    """Routing and the send phase. ``link`` (float32 [1], the call's output ``sent``) carries, in the backward
    pass, the combine start of the finish's backward pass to the start's."""
    del x_type
    if config.wire_dtype is None:
        _check_dtype("x", rows)
    out = _call(
        "jax_ep_dispatch_start",
        {**_routed(config, rows), "sent": _result(rows, (1,), jnp.float32)},
        rows,
        topk_idx,
        topk_weights,
        **_dispatch_attrs(config),
    )
    return DispatchStarted(
        rows, topk_idx, topk_weights, link=out["sent"], token_dest_pos=out["token_dest_pos"], slot_dest=out["slot_dest"]
    )


def dispatch_finish(config: Config, started: DispatchStarted) -> Dispatched:
    """The receive phase of :func:`dispatch_start`'s call."""
    rows, topk_idx, topk_weights, _, token_dest_pos, slot_dest = started
    out = _call(
        "jax_ep_dispatch_finish",
        _received(config, rows),
        rows,
        topk_idx,
        topk_weights,
        token_dest_pos,
        slot_dest,
        **_dispatch_attrs(config),
    )
    return _dispatched(config, rows.shape[1], {**out, "token_dest_pos": token_dest_pos, "slot_dest": slot_dest})


def dispatch_finish_backward(handle: Handle, rows_ct: jax.Array, weights_ct: jax.Array) -> DispatchStarted:
    """The backward pass of the finish: the start of the cotangents' combine, carried in ``link``. It stages
    this rank's own partial sums too, so that its finish needs only what the start made."""
    operands = _combine_operands(handle, rows_ct, None, weights_ct)
    sent = _combine_start(handle.config, operands, partial_f32=False, stage_own=True)
    return DispatchStarted(None, None, None, sent)


def dispatch_start_backward(config: Config, started: DispatchStarted, dstarted: DispatchStarted, x_type: RowType):
    """The backward pass of the start: that combine's finish, from the start's own outputs. Returns (dx, dweights)."""
    token_dest_pos, slot_dest = started.token_dest_pos, started.slot_dest
    hidden, dtype = x_type
    empty = jnp.zeros((0,), jnp.int32)
    operands = (
        _zeros(token_dest_pos, (0, hidden), dtype),  # no y: the start staged every partial sum
        empty.astype(jnp.float32),
        empty.astype(jnp.float32),
        empty.reshape(0, 0, 0),
        empty,
        token_dest_pos,
        slot_dest,
    )
    out, values = _combine_finish(config, operands, dstarted.link, hidden, dtype, True, False, stage_own=True)
    return out, values


def _backward_operands(handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None) -> tuple:
    _check_dtype("y", y)
    rows = y.reshape(handle.config.num_rows, -1)
    flat_weights = jnp.zeros((0,), jnp.float32) if weights is None else weights.reshape(-1).astype(jnp.float32)
    h = handle
    return (cotangent.astype(rows.dtype), rows, flat_weights, h.token_dest_pos, h.recv_rows, h.recv_counts, h.row_slot)


def _backward_results(handle: Handle, y: jax.Array, weights: jax.Array | None) -> dict[str, Any]:
    rows = y.reshape(handle.config.num_rows, -1)
    return {
        "dy": _result(rows, rows.shape, rows.dtype),
        "dweights": _result(rows, (rows.shape[0] if weights is not None else 0,), jnp.float32),
    }


def _backward_outputs(y: jax.Array, weights: jax.Array | None, out: dict[str, jax.Array]):
    dy = out["dy"].reshape(y.shape)
    if weights is None:
        return dy, None
    return dy, out["dweights"].reshape(weights.shape).astype(weights.dtype)


def combine_backward(
    handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """The backward pass of combine in one FFI call; see ``backends/xla.py:combine_backward``."""
    operands = _backward_operands(handle, cotangent, y, weights)
    out = _call("jax_ep_combine_backward", _backward_results(handle, y, weights), *operands, config=handle.config)
    return _backward_outputs(y, weights, out)


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


def _combined(config: Config, like: jax.Array, hidden: int, dtype: Any, with_values: bool) -> dict[str, Any]:
    """Result types of a combine's receive phase: the [T, H] sums, and the slot values ([T, K], else [0])."""
    return {
        "out": _result(like, (config.num_tokens, hidden), dtype),
        "slot_values": _result(like, (config.num_tokens, config.topk) if with_values else (0,), jnp.float32),
    }


def combine(
    handle: Handle, rows: jax.Array, weights: jax.Array | None, partial_dtype: Any, row_values: jax.Array | None = None
) -> tuple[jax.Array, jax.Array | None]:
    """Combine (and dispatch's backward pass) in one FFI call; see ``backends/xla.py:combine``."""
    config = handle.config
    out = _call(
        "jax_ep_combine",
        _combined(config, rows, rows.shape[1], rows.dtype, row_values is not None),
        *_combine_operands(handle, rows, weights, row_values),
        config=config,
        partial_f32=_partial_f32(rows, partial_dtype),
    )
    return out["out"], (out["slot_values"] if row_values is not None else None)


def _combine_start(config: Config, operands: tuple, *, partial_f32: bool, stage_own: bool) -> jax.Array:
    """A split combine's send phase; returns the start's output ``sent`` (float32 [1])."""
    out = _call(
        "jax_ep_combine_start",
        {"sent": _result(operands[0], (1,), jnp.float32)},
        *operands,
        config=config,
        partial_f32=partial_f32,
        stage_own=stage_own,
    )
    return out["sent"]


def _combine_finish(config, operands, sent, hidden, dtype, with_values, partial_f32, *, stage_own):
    """A split combine's receive phase: the [T, H] sums (and the slot values, or None)."""
    like = operands[5]  # token_dest_pos
    out = _call(
        "jax_ep_combine_finish",
        _combined(config, like, hidden, dtype, with_values),
        *operands,
        sent,
        config=config,
        partial_f32=partial_f32,
        stage_own=stage_own,
    )
    return out["out"], (out["slot_values"] if with_values else None)


def combine_start(handle: Handle, rows: jax.Array, weights: jax.Array | None, partial_dtype: Any) -> CombineStarted:
    """The send phase."""
    operands = _combine_operands(handle, rows, weights, None)
    sent = _combine_start(handle.config, operands, partial_f32=_partial_f32(rows, partial_dtype), stage_own=False)
    return CombineStarted(sent, _zeros(rows, (handle.config.num_tokens, rows.shape[1]), rows.dtype))


def combine_finish(
    handle: Handle, rows: jax.Array, weights: jax.Array | None, partial_dtype: Any, started: CombineStarted
) -> jax.Array:
    """The receive phase of :func:`combine_start`'s call (this rank's own partial sums from ``rows``)."""
    operands = _combine_operands(handle, rows, weights, None)
    partial_f32 = _partial_f32(rows, partial_dtype)
    args = (handle.config, operands, started.sent, rows.shape[1], rows.dtype, False, partial_f32)
    return _combine_finish(*args, stage_own=False)[0]


def combine_finish_backward(handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None):
    """The backward pass of the finish: the send phase of combine's backward pass. Returns (dy, dweights,
    dstarted), dstarted carrying the start's output and the cotangent to :func:`combine_start_backward`."""
    operands = _backward_operands(handle, cotangent, y, weights)
    results = {"sent": _result(y, (1,), jnp.float32)}
    out = _call("jax_ep_combine_backward_start", results, *operands, config=handle.config)
    return None, None, CombineStarted(out["sent"], operands[0])


def combine_start_backward(handle: Handle, y: jax.Array, weights: jax.Array | None, dstarted: CombineStarted):
    """The backward pass of the start: the receive phase of combine's backward pass. Returns (dy, dweights)."""
    sent, cotangent = dstarted
    operands = _backward_operands(handle, cotangent, y, weights)
    out = _call(
        "jax_ep_combine_backward_finish",
        _backward_results(handle, y, weights),
        *operands,
        sent,
        config=handle.config,
    )
    return _backward_outputs(y, weights, out)
