"""The "cuda" backend: one ``jax.ffi`` call per op into the project's CUDA kernels.

* ``jax_ep_dispatch``: routing layout (kernel 1), then one kernel that stores each token once into every
  peer rank it is routed to and expands what it receives into the layout (kernel 2).
* ``jax_ep_combine_backward``: one kernel: each token's cotangent travels along the handle's routing like a
  dispatch, and each held row gets ``dy = w * g`` and ``dweights = <g, y[row]>`` where it lives.
* ``jax_ep_combine``: one kernel: partial sums to their source ranks, then each source adds them in rank order
  (also the backward pass of dispatch, with the weights' cotangent going back to the slots).

Every call takes this rank's ``lax.axis_index``, which the kernels check against the group's rank.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

import jax
import jax.numpy as jnp

from .. import _group
from .._types import Config, Dispatched, Handle

FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def on_gpus() -> bool:
    """Whether jax's default devices are GPUs."""
    return jax.default_backend() == "gpu"


def find_group(axis_name: Hashable, num_ranks: int, topk: int, num_experts: int) -> tuple[int | None, str]:
    """The id of the group that can serve this dispatch, or None and why not."""
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
    if topk > _group.MAX_TOPK:
        return None, f"topk must be at most {_group.MAX_TOPK} for backend 'cuda', got {topk}"
    if num_experts > _group.MAX_EXPERTS:
        return None, f"num_experts must be at most {_group.MAX_EXPERTS} for backend 'cuda', got {num_experts}"
    return group.id, ""


def _result(like: jax.Array, shape: tuple[int, ...], dtype: Any) -> Any:
    """Result type that varies over the same mesh axes as ``like`` (inside ``shard_map``)."""
    return jax.typeof(like).update(shape=shape, dtype=jnp.dtype(dtype), weak_type=False)


def _check_dtype(name: str, value: jax.Array) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(
            f"jax_ep: backend 'cuda' moves float32, bfloat16 or float16 {name}, got {value.dtype}; use backend='xla'"
        )


def _call(name: str, results: Any, *args: jax.Array, config: Config, **attrs: Any) -> Any:
    _group.extension()
    rank = jax.lax.axis_index(config.axis_name).astype(jnp.int32)
    call = jax.ffi.ffi_call(name, results)
    return call(*args, rank, group=config.group, **attrs)


def dispatch(config: Config, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    """Forward dispatch on one rank in one FFI call; see :func:`jax_ep.dispatch`.

    With ``config.wire_dtype`` set, ``x`` holds packed FP8 rows (uint8, ``jax_ep._fp8``): bytes to move.
    """
    if config.wire_dtype is None:
        _check_dtype("x", x)
    num_ranks, num_tokens, topk, rows = config.num_ranks, config.num_tokens, config.topk, config.num_rows
    i32 = jnp.int32
    results = (
        _result(x, (rows, x.shape[1]), x.dtype),  # x
        _result(x, (rows,), jnp.float32),  # weights
        _result(x, (config.local_experts,), i32),  # group_sizes
        _result(x, (), i32),  # num_dropped
        _result(x, (), i32),  # num_invalid
        _result(x, (num_tokens, num_ranks), i32),  # token_dest_pos
        _result(x, (num_ranks,), i32),  # send_counts
        _result(x, (num_tokens, topk), i32),  # slot_dest
        _result(x, (num_ranks, num_tokens, topk), i32),  # recv_rows
        _result(x, (num_ranks,), i32),  # recv_counts
        _result(x, (rows,), i32),  # row_slot
    )
    out = _call(
        "jax_ep_dispatch",
        results,
        x,
        topk_idx,
        topk_weights,
        config=config,
        num_experts=config.num_experts,
        expert_layout=config.layout == "expert",
        capacity=config.capacity,
        alignment=config.expert_alignment,
    )
    x_rows, weights, group_sizes, num_dropped, num_invalid, *handle = out
    return Dispatched(
        x=x_rows.reshape(config.layout_shape(x.shape[1])),
        weights=weights.reshape(config.weights_shape),
        group_sizes=group_sizes,
        num_dropped=num_dropped,
        num_invalid=num_invalid,
        handle=Handle(*handle, config),
    )


def combine_backward(
    handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None
) -> tuple[jax.Array, jax.Array | None]:
    """The backward pass of combine in one FFI call; see ``backends/xla.py:combine_backward``."""
    _check_dtype("y", y)
    config = handle.config
    rows = y.reshape(config.num_rows, -1)
    flat_weights = jnp.zeros((0,), jnp.float32) if weights is None else weights.reshape(-1).astype(jnp.float32)
    results = (
        _result(rows, rows.shape, rows.dtype),
        _result(rows, (config.num_rows if weights is not None else 0,), jnp.float32),
    )
    h = handle
    dy, dweights = _call(
        "jax_ep_combine_backward",
        results,
        cotangent.astype(rows.dtype),
        rows,
        flat_weights,
        h.token_dest_pos,
        h.recv_rows,
        h.recv_counts,
        h.row_slot,
        config=config,
    )
    if weights is None:
        return dy.reshape(y.shape), None
    return dy.reshape(y.shape), dweights.reshape(weights.shape).astype(weights.dtype)


def combine(
    handle: Handle,
    rows: jax.Array,
    weights: jax.Array | None,
    partial_dtype: jnp.dtype,
    row_values: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array | None]:
    """Combine (and dispatch's backward pass) in one FFI call; see ``backends/xla.py:combine``."""
    _check_dtype("y", rows)
    if jnp.dtype(partial_dtype) not in (jnp.dtype(jnp.float32), rows.dtype):
        raise TypeError(
            f"jax_ep: backend 'cuda' sends partial sums as float32 or as y's dtype {rows.dtype}, got {partial_dtype}"
        )
    config = handle.config
    num_tokens, topk = config.num_tokens, config.topk
    empty = jnp.zeros((0,), jnp.float32)
    h = handle
    results = (
        _result(rows, (num_tokens, rows.shape[1]), rows.dtype),
        _result(rows, (num_tokens, topk) if row_values is not None else (0,), jnp.float32),
    )
    out, values = _call(
        "jax_ep_combine",
        results,
        rows,
        empty if weights is None else weights.astype(jnp.float32),
        empty if row_values is None else row_values.astype(jnp.float32),
        h.recv_rows,
        h.recv_counts,
        h.token_dest_pos,
        h.slot_dest,
        config=config,
        partial_f32=jnp.dtype(partial_dtype) == jnp.dtype(jnp.float32) and rows.dtype != jnp.float32,
    )
    return out, (values if row_values is not None else None)
