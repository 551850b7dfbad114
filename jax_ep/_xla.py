"""The "xla" backend: pure JAX over ``lax.all_to_all``, for every platform.

Each token travels once per destination rank, in a fixed-size send buffer of
``[R, T, H]`` (rows in token order, padding zero). The receiver expands the
tokens into the layout with a gather; combine reduces a token's slots on the
expert side and sends one row per (token, rank) back. Every function here runs
on one rank inside ``shard_map``; layout rows are flattened to ``[N, ...]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ._layout import assign_rows, local_layout
from ._types import Config, Dispatched, Handle


def _exchange(buffer: jax.Array, config: Config) -> jax.Array:
    """Row ``d`` of ``buffer [R, ...]`` goes to rank ``d``; row ``r`` of the result came from rank ``r``."""
    return jax.lax.all_to_all(buffer, config.axis_name, 0, 0, tiled=True)


def _take(values: jax.Array, index: jax.Array, fill: int = 0) -> jax.Array:
    """``values[index]`` along axis 0, ``fill`` where ``index < 0``."""
    return jnp.take(values, jnp.where(index < 0, values.shape[0], index), axis=0, mode="fill", fill_value=fill)


def _send_tokens(token_dest_pos: jax.Array, config: Config) -> jax.Array:
    """Token ids of each rank's send list ``[R, T]``, -1 past its end."""
    num_tokens, num_ranks = config.num_tokens, config.num_ranks
    ranks = jnp.broadcast_to(jnp.arange(num_ranks), (num_tokens, num_ranks))
    tokens = jnp.broadcast_to(jnp.arange(num_tokens)[:, None], (num_tokens, num_ranks))
    rows = jnp.where(token_dest_pos < 0, num_tokens, token_dest_pos)
    return jnp.full((num_ranks, num_tokens), -1, jnp.int32).at[ranks, rows].set(tokens, mode="drop")


def dispatch(config: Config, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    """Forward dispatch on one rank; see :func:`jax_ep.dispatch`."""
    num_ranks, num_tokens, topk = config.num_ranks, config.num_tokens, config.topk
    local = local_layout(topk_idx, config.num_experts, num_ranks)
    all_counts = jax.lax.all_gather(local.expert_count, config.axis_name)
    rank = jax.lax.axis_index(config.axis_name)
    rows = assign_rows(topk_idx, local.slot_rank, all_counts, rank, config)

    send_token = _send_tokens(local.token_dest_pos, config)
    for_rank = _take(rows.slot_dest, send_token, fill=-1) == jnp.arange(num_ranks)[:, None, None]
    send_rows = jnp.where(for_rank, _take(rows.slot_row, send_token), -1)
    send_weights = jnp.where(for_rank, _take(topk_weights, send_token), 0.0)
    recv_x = _exchange(_take(x, send_token), config).reshape(num_ranks * num_tokens, -1)
    recv_rows = _exchange(send_rows, config)
    recv_weights = _exchange(send_weights, config).reshape(-1)

    slots = jnp.arange(num_ranks * num_tokens * topk, dtype=jnp.int32)
    flat_rows = recv_rows.reshape(-1)
    row_slot = (
        jnp.full(config.num_rows, -1, jnp.int32)
        .at[jnp.where(flat_rows < 0, config.num_rows, flat_rows)]
        .set(slots, mode="drop")
    )
    hidden = x.shape[-1]
    handle = Handle(local.token_dest_pos, rows.slot_dest, recv_rows, row_slot, config)
    return Dispatched(
        x=_expand(recv_x, row_slot, topk).reshape(config.layout_shape(hidden)),
        weights=_take(recv_weights, row_slot).reshape(config.weights_shape),
        group_sizes=rows.group_sizes,
        num_dropped=rows.num_dropped,
        num_invalid=local.num_invalid,
        handle=handle,
    )


def _expand(recv_x: jax.Array, row_slot: jax.Array, topk: int) -> jax.Array:
    """Layout rows ``[N, H]`` from received tokens ``[R * T, H]``."""
    return _take(recv_x, jnp.where(row_slot < 0, -1, row_slot // topk))


def to_experts(handle: Handle, x: jax.Array) -> jax.Array:
    """Send token rows ``x [T, H]`` along the dispatch routing: layout rows ``[N, H]``."""
    config = handle.config
    send_token = _send_tokens(handle.token_dest_pos, config)
    recv_x = _exchange(_take(x, send_token), config).reshape(config.num_ranks * config.num_tokens, -1)
    return _expand(recv_x, handle.row_slot, config.topk)


def to_tokens(handle: Handle, y: jax.Array, weights: jax.Array | None) -> jax.Array:
    """Weighted sum of layout rows ``y [N, H]`` back onto tokens: ``[T, H]``, dtype of ``y``.

    Each rank first sums a token's slots in float32 (in k order), sends that
    partial sum once, rounded to ``y.dtype``, and the source adds the ranks'
    partial sums in float32.
    """
    config = handle.config
    recv_rows = handle.recv_rows.reshape(config.num_ranks * config.num_tokens, config.topk)
    partial = jnp.zeros((recv_rows.shape[0], y.shape[-1]), jnp.float32)
    for k in range(config.topk):
        rows_k = recv_rows[:, k]
        term = _take(y, rows_k).astype(jnp.float32)
        if weights is not None:
            term = term * _take(weights, rows_k).astype(jnp.float32)[:, None]
        partial = partial + term
    partial = partial.astype(y.dtype).reshape(config.num_ranks, config.num_tokens, -1)
    back = _exchange(partial, config)  # [R, T, H]: row i from rank d = token_dest_pos[:, d] == i
    pos = handle.token_dest_pos
    gathered = back[jnp.arange(config.num_ranks)[None, :], jnp.maximum(pos, 0)]  # [T, R, H]
    gathered = jnp.where((pos >= 0)[..., None], gathered.astype(jnp.float32), 0.0)
    return jnp.sum(gathered, axis=1).astype(y.dtype)


def slot_values_to_tokens(handle: Handle, values: jax.Array) -> jax.Array:
    """Per-row scalars ``values [N]`` back to their slots: ``[T, K]`` float32, 0 where not delivered."""
    config = handle.config
    per_slot = _take(values.astype(jnp.float32), handle.recv_rows.reshape(-1))
    back = _exchange(per_slot.reshape(handle.recv_rows.shape), config)  # [R, T, K]
    dest = handle.slot_dest
    pos = jnp.take_along_axis(handle.token_dest_pos, jnp.maximum(dest, 0), axis=1)
    topk = jnp.arange(config.topk)[None, :]
    return jnp.where(dest >= 0, back[jnp.maximum(dest, 0), jnp.maximum(pos, 0), topk], 0.0)
