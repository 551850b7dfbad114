"""Dispatch and combine on one rank, in terms of a backend's row exchange.

Each token travels once per destination rank, in a send buffer of ``[R, T, H]``
(the tokens for rank ``d`` in token order in row ``d``; ``counts[d]`` of them).
The receiver expands the tokens into the layout with a gather; combine reduces
a token's slots on the expert side and sends one row per (token, rank) back.
The backend only moves rows: ``exchange(buffer [R, rows, ...], counts [R])``
returns what every rank sent here and how many rows each sent. With backend
"cuda", the token movement and the combine are instead one fused FFI call each
(``_cuda.tokens_to_rows`` and ``_cuda.rows_to_tokens``), over the same handle.
Every function runs on one rank inside ``shard_map``; layout rows are flattened
to ``[N, ...]``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import _backends, _cuda
from ._layout import assign_rows
from ._types import Config, Dispatched, Handle


def _exchange(buffer: jax.Array, counts: jax.Array, config: Config) -> tuple[jax.Array, jax.Array]:
    """Rows ``[:counts[d]]`` of ``buffer[d]`` go to rank ``d``; returns ``(received [R, rows, ...], their counts [R])``.

    Received rows past a count are unspecified: callers mask them.
    """
    return _backends.module(config.backend).exchange(buffer, counts, config)


def _valid_rows(recv_counts: jax.Array, rows: int) -> jax.Array:
    """``[R, rows]``: whether each received row was sent."""
    return jnp.arange(rows)[None, :] < recv_counts[:, None]


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
    backend = _backends.module(config.backend)
    local = backend.local_layout(topk_idx, config.num_experts, num_ranks)
    ones = jnp.ones(num_ranks, jnp.int32)
    all_counts, _ = _exchange(jnp.broadcast_to(local.expert_count, (num_ranks, 1, config.num_experts)), ones, config)
    rank = jax.lax.axis_index(config.axis_name)
    rows = assign_rows(topk_idx, local.slot_rank, all_counts[:, 0], rank, config)

    send_counts = local.rank_token_count
    send_token = _send_tokens(local.token_dest_pos, config)
    for_rank = _take(rows.slot_dest, send_token, fill=-1) == jnp.arange(num_ranks)[:, None, None]
    send_rows = jnp.where(for_rank, _take(rows.slot_row, send_token), -1)
    send_weights = jnp.where(for_rank, _take(topk_weights, send_token), 0.0)
    send_meta = jnp.concatenate([send_rows, jax.lax.bitcast_convert_type(send_weights, jnp.int32)], axis=-1)
    recv_meta, recv_counts = _exchange(send_meta, send_counts, config)
    sent = _valid_rows(recv_counts, num_tokens)[..., None]
    recv_rows = jnp.where(sent, recv_meta[..., :topk], -1)
    recv_weights = jnp.where(sent, jax.lax.bitcast_convert_type(recv_meta[..., topk:], jnp.float32), 0.0).reshape(-1)

    slots = jnp.arange(num_ranks * num_tokens * topk, dtype=jnp.int32)
    flat_rows = recv_rows.reshape(-1)
    row_slot = (
        jnp.full(config.num_rows, -1, jnp.int32)
        .at[jnp.where(flat_rows < 0, config.num_rows, flat_rows)]
        .set(slots, mode="drop")
    )
    hidden = x.shape[-1]
    handle = Handle(local.token_dest_pos, send_counts, rows.slot_dest, recv_rows, recv_counts, row_slot, config)
    return Dispatched(
        x=to_experts(handle, x).reshape(config.layout_shape(hidden)),
        weights=_take(recv_weights, row_slot).reshape(config.weights_shape),
        group_sizes=rows.group_sizes,
        num_dropped=rows.num_dropped,
        num_invalid=local.num_invalid,
        handle=handle,
    )


def to_experts(handle: Handle, x: jax.Array) -> jax.Array:
    """Send token rows ``x [T, H]`` along the dispatch routing: layout rows ``[N, H]``.

    Each token goes once to every rank it is routed to; there it fills the rows of its slots.
    """
    config = handle.config
    send_token = _send_tokens(handle.token_dest_pos, config)
    if config.backend == "cuda":
        self_token = send_token[jax.lax.axis_index(config.axis_name)]
        return _cuda.tokens_to_rows(x, self_token, handle)
    recv_x, _ = _exchange(_take(x, send_token), handle.send_counts, config)
    recv_x = recv_x.reshape(config.num_ranks * config.num_tokens, -1)
    row_slot = handle.row_slot
    return _take(recv_x, jnp.where(row_slot < 0, -1, row_slot // config.topk))


def to_tokens(handle: Handle, y: jax.Array, weights: jax.Array | None) -> jax.Array:
    """Weighted sum of layout rows ``y [N, H]`` back onto tokens: ``[T, H]``, dtype of ``y``.

    Each rank first sums a token's slots in float32 (in k order) and sends that
    float32 partial sum once; the source adds the ranks' partial sums in float32
    and rounds once to ``y.dtype``.
    """
    config = handle.config
    if config.backend == "cuda" and y.dtype in _cuda.COMBINE_DTYPES and config.topk <= _cuda.MAX_FUSED_TOPK:
        flat_weights = jnp.ones(y.shape[0], jnp.float32) if weights is None else weights.astype(jnp.float32)
        return _cuda.rows_to_tokens(y, flat_weights, handle)
    recv_rows = handle.recv_rows.reshape(config.num_ranks * config.num_tokens, config.topk)
    partial = jnp.zeros((recv_rows.shape[0], y.shape[-1]), jnp.float32)
    for k in range(config.topk):
        rows_k = recv_rows[:, k]
        term = _take(y, rows_k).astype(jnp.float32)
        if weights is not None:
            term = term * _take(weights, rows_k).astype(jnp.float32)[:, None]
        partial = partial + term
    partial = partial.reshape(config.num_ranks, config.num_tokens, -1)
    # [R, T, H]: row i from rank d belongs to the token with token_dest_pos[:, d] == i
    back, _ = _exchange(partial, handle.recv_counts, config)
    pos = handle.token_dest_pos
    gathered = back[jnp.arange(config.num_ranks)[None, :], jnp.maximum(pos, 0)]  # [T, R, H]
    gathered = jnp.where((pos >= 0)[..., None], gathered, 0.0)
    return jnp.sum(gathered, axis=1).astype(y.dtype)


def slot_values_to_tokens(handle: Handle, values: jax.Array) -> jax.Array:
    """Per-row scalars ``values [N]`` back to their slots: ``[T, K]`` float32, 0 where not delivered."""
    config = handle.config
    per_slot = _take(values.astype(jnp.float32), handle.recv_rows.reshape(-1))
    back, _ = _exchange(per_slot.reshape(handle.recv_rows.shape), handle.recv_counts, config)  # [R, T, K]
    dest = handle.slot_dest
    pos = jnp.take_along_axis(handle.token_dest_pos, jnp.maximum(dest, 0), axis=1)
    topk = jnp.arange(config.topk)[None, :]
    return jnp.where(dest >= 0, back[jnp.maximum(dest, 0), jnp.maximum(pos, 0), topk], 0.0)
