"""Routing layout: where every slot goes, computed from expert ids and counts.

Two steps; the cuda backend's kernels compute the same rows, checked bit for bit against these:

1. :func:`local_layout` looks only at this rank's ``topk_idx``.
2. :func:`assign_rows` turns the per-expert slot counts of all ranks into the
   layout row of each of this rank's slots on its destination rank, and this
   rank's own ``group_sizes``, ``num_dropped`` and ``expert_load``.

Under a too-small ragged capacity, ``drop_policy="balanced"`` keeps ``min(n_j, c)`` slots of each local expert
``j`` (``n_j`` its slots), ``c`` the largest level with ``sum_j align_up(min(n_j, c), a) <= C``
(:func:`balanced_level`); ``"expert"`` keeps the first ``C`` rows of the unbounded layout.
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
    expert_load: jax.Array  # [L] valid slots routed to each local expert by all ranks, before capacity


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


def align_up(n: jax.Array, alignment: int) -> jax.Array:
    """``n`` rounded up to a multiple of ``alignment``."""
    return (n + alignment - 1) // alignment * alignment


def balanced_level(counts: jax.Array, capacity: int, alignment: int) -> jax.Array:
    """``[...]``: for the slot counts ``counts [..., L]`` of each rank's local experts, the largest level ``c`` in
    ``[0, 2**b)`` with ``sum_j align_up(min(counts_j, c), alignment) <= capacity``, ``b`` the bits of ``capacity``.

    A binary search, one bit at a time from the highest: a few integer operations per local expert and bit. The
    sum grows with ``c``, and only ``c <= capacity`` can fit unless every count fits (then any ``c`` at or past the
    largest count keeps them all, and ``2**b - 1 >= capacity`` is such a ``c``). ``alignment <= capacity + 1``
    keeps the sums within ``L * (capacity + 1)``.
    """
    level = jnp.zeros(counts.shape[:-1], jnp.int32)
    for bit in reversed(range(capacity.bit_length())):
        trial = level + (1 << bit)
        rows = jnp.sum(align_up(jnp.minimum(counts, trial[..., None]), alignment), axis=-1, dtype=jnp.int32)
        level = jnp.where(rows <= capacity, trial, level)
    return level


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
    position = base[rank][expert] + slot_rank  # index of the slot among its expert's slots
    mine_total = jax.lax.dynamic_slice_in_dim(total, rank * local_experts, local_experts)
    if config.layout == "ragged":
        align = config.expert_alignment
        if config.drop_policy == "balanced":
            level = balanced_level(total.reshape(num_ranks, local_experts), capacity, align)  # [R_dest]
            kept_per_expert = jnp.minimum(total, jnp.repeat(level, local_experts))  # [E]
            seg_size = align_up(kept_per_expert, align).reshape(num_ranks, local_experts)
            seg_start = (jnp.cumsum(seg_size, axis=1, dtype=jnp.int32) - seg_size).reshape(-1)  # [E]
            kept = valid & (position < kept_per_expert[expert])
            group_sizes = jax.lax.dynamic_slice_in_dim(seg_size.reshape(-1), rank * local_experts, local_experts)
            kept_here = jax.lax.dynamic_slice_in_dim(kept_per_expert, rank * local_experts, local_experts)
        else:  # "expert": the first C rows of the unbounded layout
            padded = align_up(total, align).reshape(num_ranks, local_experts)
            seg_start = (jnp.cumsum(padded, axis=1, dtype=jnp.int32) - padded).reshape(-1)  # [E]
            kept = valid & (seg_start[expert] + position < capacity)
            mine = jax.lax.dynamic_slice_in_dim(seg_start, rank * local_experts, local_experts)
            mine_padded = jax.lax.dynamic_slice_in_dim(padded.reshape(-1), rank * local_experts, local_experts)
            group_sizes = jnp.minimum(mine + mine_padded, capacity) - jnp.minimum(mine, capacity)
            kept_here = jnp.clip(capacity - mine, 0, mine_total)
        slot_row = jnp.where(kept, seg_start[expert] + position, -1)
    else:
        kept = valid & (position < capacity)
        slot_row = jnp.where(kept, expert % local_experts * capacity + position, -1)
        group_sizes = jnp.minimum(mine_total, capacity)
        kept_here = group_sizes
    slot_dest = jnp.where(valid, expert // local_experts, -1)
    num_dropped = jnp.sum(mine_total, dtype=jnp.int32) - jnp.sum(kept_here, dtype=jnp.int32)
    return RowAssignment(slot_row, slot_dest, group_sizes.astype(jnp.int32), num_dropped.astype(jnp.int32), mine_total)
