"""The baseline jax_ep is measured against: a MaxText-style MoE exchange over ``jax.lax.ragged_all_to_all``.

Per rank (inside ``shard_map``): replicate each token by its top-k, sort the copies by expert,
``ragged_all_to_all`` them to the experts' ranks, sort what arrived by local expert; then the way
back: undo that sort, ``ragged_all_to_all`` back, undo the first sort, and sum each token's copies
with its routing weights. With identity experts this is dispatch + combine:
``out[t] = sum over k of topk_weights[t, k] * x[t]``. Every slot must hold a valid expert id.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import jax
import jax.numpy as jnp


def _offsets(sizes: jax.Array) -> jax.Array:
    return jnp.cumsum(sizes) - sizes


def ragged_roundtrip(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    *,
    num_experts: int,
    axis_name: Hashable,
    exchange: Callable[..., jax.Array] = jax.lax.ragged_all_to_all,
) -> jax.Array:
    """``x [T, H]`` to the experts and back, summed with ``topk_weights``: ``[T, H]`` (float32 sums).

    ``exchange`` has the signature of ``jax.lax.ragged_all_to_all`` (tests pass an emulation on CPU).
    """
    num_tokens, topk = topk_idx.shape
    num_ranks = jax.lax.axis_size(axis_name)
    local_experts = num_experts // num_ranks
    rank = jax.lax.axis_index(axis_name)
    slots = num_tokens * topk
    capacity = num_ranks * slots  # worst case: every rank sends all its copies here

    # Replicate by top-k and sort by global expert.
    expert = topk_idx.reshape(-1)
    order = jnp.argsort(expert, stable=True)
    copies = jnp.repeat(x, topk, axis=0)[order]
    per_expert = jnp.zeros(num_experts, jnp.int32).at[expert].add(1)
    per_rank_expert = jax.lax.all_gather(per_expert, axis_name).reshape(num_ranks, num_ranks, local_experts)
    sent = per_rank_expert.sum(-1)  # [source, dest] copies
    send_sizes = sent[rank]
    recv_sizes = sent[:, rank]
    input_offsets = _offsets(send_sizes)
    output_offsets = (jnp.cumsum(sent, axis=0) - sent)[rank]  # where this rank's copies start on each dest
    received = exchange(
        copies,
        jnp.zeros((capacity, x.shape[1]), x.dtype),
        input_offsets,
        send_sizes,
        output_offsets,
        recv_sizes,
        axis_name=axis_name,
    )

    # Group what arrived by local expert: source-major blocks, each sorted by expert already.
    arrived = per_rank_expert[:, rank]  # [source, local expert]
    row = jnp.arange(capacity)
    source = jnp.searchsorted(jnp.cumsum(recv_sizes), row, side="right")
    within = row - _offsets(recv_sizes)[jnp.minimum(source, num_ranks - 1)]
    bounds = jnp.cumsum(arrived, axis=1)[jnp.minimum(source, num_ranks - 1)]  # [capacity, L]
    local = jnp.where(source < num_ranks, jnp.sum(within[:, None] >= bounds, axis=1), local_experts)
    local_order = jnp.argsort(local, stable=True)
    grouped = received[local_order]  # experts would run here, on rows grouped by local expert

    # And back.
    returned = jnp.zeros_like(grouped).at[local_order].set(grouped)
    back_offsets = (jnp.cumsum(sent, axis=1) - sent)[:, rank]  # where each source's copies sat in its buffer
    back = exchange(
        returned,
        jnp.zeros((slots, x.shape[1]), x.dtype),
        _offsets(recv_sizes),
        recv_sizes,
        back_offsets,
        send_sizes,
        axis_name=axis_name,
    )
    unsorted = jnp.zeros_like(back).at[order].set(back).reshape(num_tokens, topk, -1)
    return jnp.einsum("tk,tkh->th", topk_weights, unsorted.astype(jnp.float32))


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
) -> jax.Array:
    """``jax.lax.ragged_all_to_all`` semantics over ``all_to_all``, for platforms without it (XLA:CPU).

    Rows ``operand[input_offsets[j] : + send_sizes[j]]`` land in rank ``j``'s ``output`` at
    ``output_offsets[j]`` (an offset in the receiver's buffer); the rest of ``output`` is kept.
    """
    num_ranks = input_offsets.shape[0]
    rows = operand.shape[0]
    index = jnp.arange(rows)
    chunks = jnp.stack(
        [jnp.roll(operand, -input_offsets[j], axis=0) * (index < send_sizes[j])[:, None] for j in range(num_ranks)]
    )
    got = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # [source, rows, H]
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where each source writes here
    out_rows = jnp.arange(output.shape[0])
    for source in range(num_ranks):
        start = at[source]
        inside = (out_rows >= start) & (out_rows < start + recv_sizes[source])
        picked = jnp.take(got[source], jnp.clip(out_rows - start, 0, rows - 1), axis=0)
        output = jnp.where(inside[:, None], picked, output)
    return output
