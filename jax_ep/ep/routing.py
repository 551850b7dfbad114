"""Routing layout: where every slot goes, computed from expert ids and counts.

Two steps; the cuda backend's kernels compute the same rows, checked bit for bit against these:

1. :func:`local_layout` looks only at this rank's ``topk_idx``.
2. :func:`assign_rows` turns the per-expert slot counts of all ranks into the
   layout row of each of this rank's slots on its destination rank, and this
   rank's own ``group_sizes`` and ``num_dropped``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from .types import Config


class LocalLayout(NamedTuple):
    """Routing facts of one rank's ``topk_idx [T, K]`` (all int32)."""

    token_dest_pos: jax.Array  # [T, R] row of token t in the send list to rank d, or -1
    rank_token_count: jax.Array  # [R] tokens sent to each rank
    expert_count: jax.Array  # [E] valid slots routed to each global expert
    slot_rank: jax.Array  # [T, K] index of the slot among this rank's slots of its expert, or -1
    num_invalid: jax.Array  # [] slots that are neither -1 nor in [0, E)


class RowAssignment(NamedTuple):
    """Rows of this rank's slots on their destinations, and its own receive sizes."""

    slot_row: jax.Array  # [T, K] layout row on the destination rank, -1 if not delivered
    slot_dest: jax.Array  # [T, K] destination rank of a valid slot (kept or dropped), -1 if unused or invalid
    group_sizes: jax.Array  # [L]
    num_dropped: jax.Array  # []


def local_layout(topk_idx: jax.Array, num_experts: int, num_ranks: int) -> LocalLayout:
    """Counts and positions of one rank's slots; see :class:`LocalLayout`."""
    num_tokens, topk = topk_idx.shape
    local_experts = num_experts // num_ranks
    valid = (topk_idx >= 0) & (topk_idx < num_experts)
    num_invalid = jnp.sum(~valid & (topk_idx != -1), dtype=jnp.int32)

    # Rank of each slot within its expert, in (t, k) order: a stable sort by expert.
    expert = jnp.where(valid, topk_idx, num_experts).reshape(-1)
    order = jnp.argsort(expert, stable=True).astype(jnp.int32)
    counts = jnp.zeros(num_experts + 1, jnp.int32).at[expert].add(1)
    starts = jnp.cumsum(counts, dtype=jnp.int32) - counts
    rank_sorted = jnp.arange(expert.size, dtype=jnp.int32) - starts[expert[order]]
    slot_rank = jnp.zeros_like(expert).at[order].set(rank_sorted).reshape(num_tokens, topk)
    slot_rank = jnp.where(valid, slot_rank, -1)

    # A token goes to a rank once, however many of its experts it picked there.
    dest = jnp.where(valid, topk_idx // local_experts, num_ranks)
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)[:, None]
    sends = jnp.zeros((num_tokens, num_ranks + 1), bool).at[tokens, dest].set(True)[:, :num_ranks]
    position = jnp.cumsum(sends, axis=0, dtype=jnp.int32) - 1
    token_dest_pos = jnp.where(sends, position, -1)
    rank_token_count = jnp.sum(sends, axis=0, dtype=jnp.int32)
    return LocalLayout(token_dest_pos, rank_token_count, counts[:num_experts], slot_rank, num_invalid)


def assign_rows(
    topk_idx: jax.Array,
    slot_rank: jax.Array,
    all_counts: jax.Array,
    rank: jax.Array,
    config: Config,
) -> RowAssignment:
    """Layout rows of this rank's slots, from every rank's per-expert counts.

    ``all_counts [R, E]`` holds ``expert_count`` of every source rank; ``rank``
    is this rank's index on the EP axis.
    """
    num_ranks, local_experts, capacity = config.num_ranks, config.local_experts, config.capacity
    valid = slot_rank >= 0
    expert = jnp.where(valid, topk_idx, 0)

    # Slots of each expert from lower source ranks come first.
    base = jnp.cumsum(all_counts, axis=0, dtype=jnp.int32) - all_counts  # [R_src, E]
    total = jnp.sum(all_counts, axis=0, dtype=jnp.int32)  # [E]
    if config.layout == "ragged":
        align = config.expert_alignment
        padded = (total + align - 1) // align * align
        per_dest = padded.reshape(num_ranks, local_experts)
        seg_start = (jnp.cumsum(per_dest, axis=1, dtype=jnp.int32) - per_dest).reshape(-1)  # [E]
        position = seg_start[expert] + base[rank][expert] + slot_rank
        kept = valid & (position < capacity)
        slot_row = jnp.where(kept, position, -1)
        mine = jax.lax.dynamic_slice_in_dim(seg_start, rank * local_experts, local_experts)
        mine_padded = jax.lax.dynamic_slice_in_dim(padded, rank * local_experts, local_experts)
        mine_total = jax.lax.dynamic_slice_in_dim(total, rank * local_experts, local_experts)
        group_sizes = jnp.minimum(mine + mine_padded, capacity) - jnp.minimum(mine, capacity)
        kept_here = jnp.clip(capacity - mine, 0, mine_total)
    else:
        position = base[rank][expert] + slot_rank
        kept = valid & (position < capacity)
        slot_row = jnp.where(kept, expert % local_experts * capacity + position, -1)
        mine_total = jax.lax.dynamic_slice_in_dim(total, rank * local_experts, local_experts)
        group_sizes = jnp.minimum(mine_total, capacity)
        kept_here = group_sizes
    slot_dest = jnp.where(valid, expert // local_experts, -1)
    num_dropped = jnp.sum(mine_total, dtype=jnp.int32) - jnp.sum(kept_here, dtype=jnp.int32)
    return RowAssignment(slot_row, slot_dest, group_sizes.astype(jnp.int32), num_dropped.astype(jnp.int32))
