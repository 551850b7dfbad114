"""An independent NumPy reference of dispatch and combine, written from the contract alone (docs/api.md).

Plain loops over slots, on purpose: it shares no code and no technique with ``jax_ep``.
Every array here is stacked over ranks: ``x [R, T, H]``, ``topk_idx [R, T, K]``,
``topk_weights [R, T, K]``; per-rank outputs have a leading ``R`` axis too.
A slot is ``(r, t, k)``: source rank, token, top-k position.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

LAYOUTS = ("ragged", "expert")
DROP_POLICIES = ("balanced", "expert")


def default_capacity(
    *, num_ranks: int, num_tokens: int, topk: int, num_experts: int, layout: str, alignment: int
) -> int:
    """SPEC: ragged ``R*T*min(K, L) + L*(expert_alignment-1)``, expert ``R*T``."""
    local = num_experts // num_ranks
    if layout == "ragged":
        return num_ranks * num_tokens * min(topk, local) + local * (alignment - 1)
    return num_ranks * num_tokens


@dataclasses.dataclass
class RefDispatch:
    """What every rank should get from ``jax_ep.dispatch``, plus where each slot went.

    ``rows`` maps each delivered slot ``(r, t, k)`` to ``(d, row)``: destination rank
    and flat row of the layout (``row`` indexes ``x[d].reshape(-1, H)``).
    ``dropped`` holds the valid slots that did not fit.
    """

    layout: str
    capacity: int
    expert_alignment: int
    num_experts: int
    num_tokens: int
    topk: int
    x: np.ndarray  # [R, C, H] or [R, L, C, H], dtype of x
    weights: np.ndarray  # [R, C] or [R, L, C], float32
    group_sizes: np.ndarray  # [R, L] int32
    num_dropped: np.ndarray  # [R] int32
    num_invalid: np.ndarray  # [R] int32
    expert_load: np.ndarray  # [R, L] int32
    row_expert: np.ndarray | None  # [R, C] int32 (ragged), None (expert)
    rows: dict[tuple[int, int, int], tuple[int, int]]
    dropped: set[tuple[int, int, int]]

    @property
    def num_ranks(self) -> int:
        return self.x.shape[0]

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks


def align_up(n: int, alignment: int) -> int:
    return -(-n // alignment) * alignment


def balanced_keep(counts: list[int], capacity: int, alignment: int) -> list[int]:
    """SPEC v3 ``drop_policy="balanced"``: expert ``j`` keeps ``min(n_j, c)``, ``c`` the largest integer with
    ``sum_j align_up(min(n_j, c), alignment) <= capacity``. Found by counting down from the largest ``n_j``."""
    level = max(counts, default=0)
    while sum(align_up(min(n, level), alignment) for n in counts) > capacity:
        level -= 1
    return [min(n, level) for n in counts]


def dispatch(
    x: np.ndarray,
    topk_idx: np.ndarray,
    topk_weights: np.ndarray,
    *,
    num_experts: int,
    layout: str = "ragged",
    capacity: int | None = None,
    expert_alignment: int = 1,
    drop_policy: str = "balanced",
) -> RefDispatch:
    """The contract's dispatch on every rank of an EP group of ``R = x.shape[0]`` ranks.

    ``x [R, *B, H]``, ``topk_idx`` and ``topk_weights`` ``[R, *B, K]`` (flattened to ``T = prod(B)`` tokens);
    ids of any integer dtype, weights of any float dtype (their float32 values are used).
    """
    assert layout in LAYOUTS and drop_policy in DROP_POLICIES
    num_ranks, num_tokens, topk, hidden = (
        topk_idx.shape[0],
        math.prod(topk_idx.shape[1:-1]),
        topk_idx.shape[-1],
        x.shape[-1],
    )
    x = x.reshape(num_ranks, num_tokens, hidden)
    topk_idx = topk_idx.reshape(num_ranks, num_tokens, topk)
    topk_weights = topk_weights.reshape(num_ranks, num_tokens, topk).astype(np.float32)
    local = num_experts // num_ranks
    assert local * num_ranks == num_experts
    if capacity is None:
        capacity = default_capacity(
            num_ranks=num_ranks,
            num_tokens=num_tokens,
            topk=topk,
            num_experts=num_experts,
            layout=layout,
            alignment=expert_alignment,
        )

    # Slots of each global expert, ordered by source rank, then token, then k.
    per_expert: list[list[tuple[int, int, int]]] = [[] for _ in range(num_experts)]
    num_invalid = np.zeros(num_ranks, np.int32)
    for r in range(num_ranks):
        for t in range(num_tokens):
            for k in range(topk):
                e = int(topk_idx[r, t, k])
                if 0 <= e < num_experts:
                    per_expert[e].append((r, t, k))
                elif e != -1:
                    num_invalid[r] += 1

    flat_rows = capacity if layout == "ragged" else local * capacity
    out_x = np.zeros((num_ranks, flat_rows, hidden), x.dtype)
    out_w = np.zeros((num_ranks, flat_rows), np.float32)
    group_sizes = np.zeros((num_ranks, local), np.int32)
    num_dropped = np.zeros(num_ranks, np.int32)
    expert_load = np.zeros((num_ranks, local), np.int32)
    row_expert = np.full((num_ranks, capacity), -1, np.int32) if layout == "ragged" else None
    rows: dict[tuple[int, int, int], tuple[int, int]] = {}
    dropped: set[tuple[int, int, int]] = set()

    def place(d: int, row: int, slot: tuple[int, int, int]) -> None:
        r, t, k = slot
        out_x[d, row] = x[r, t]
        out_w[d, row] = topk_weights[r, t, k]
        rows[slot] = (d, row)

    def drop(d: int, slot: tuple[int, int, int]) -> None:
        dropped.add(slot)
        num_dropped[d] += 1

    for d in range(num_ranks):
        experts = [per_expert[d * local + j] for j in range(local)]
        expert_load[d] = [len(slots) for slots in experts]
        if layout == "expert":
            for j, slots in enumerate(experts):
                for i, slot in enumerate(slots):
                    if i < capacity:
                        place(d, j * capacity + i, slot)
                    else:
                        drop(d, slot)
                group_sizes[d, j] = min(len(slots), capacity)
        elif drop_policy == "balanced":
            keep = balanced_keep([len(slots) for slots in experts], capacity, expert_alignment)
            start = 0
            for j, slots in enumerate(experts):
                for i, slot in enumerate(slots):
                    if i < keep[j]:
                        place(d, start + i, slot)
                    else:
                        drop(d, slot)
                group_sizes[d, j] = align_up(keep[j], expert_alignment)
                start += group_sizes[d, j]
        else:  # "expert": the first C rows of the layout without a capacity
            start = 0
            for j, slots in enumerate(experts):
                for i, slot in enumerate(slots):
                    if start + i < capacity:
                        place(d, start + i, slot)
                    else:
                        drop(d, slot)
                end = start + align_up(len(slots), expert_alignment)
                group_sizes[d, j] = min(end, capacity) - min(start, capacity)
                start = end
        if row_expert is not None:
            row_expert[d, : group_sizes[d].sum()] = np.repeat(np.arange(local), group_sizes[d])

    if layout == "ragged":
        x_shape, w_shape = (num_ranks, capacity, hidden), (num_ranks, capacity)
    else:
        x_shape, w_shape = (num_ranks, local, capacity, hidden), (num_ranks, local, capacity)
    return RefDispatch(
        layout=layout,
        capacity=capacity,
        expert_alignment=expert_alignment,
        num_experts=num_experts,
        num_tokens=num_tokens,
        topk=topk,
        x=out_x.reshape(x_shape),
        weights=out_w.reshape(w_shape),
        group_sizes=group_sizes,
        num_dropped=num_dropped,
        num_invalid=num_invalid,
        expert_load=expert_load,
        row_expert=row_expert,
        rows=rows,
        dropped=dropped,
    )


def _flat(values: np.ndarray, d: int, trailing: int) -> np.ndarray:
    """Rank ``d``'s layout-shaped ``values`` as flat rows (``trailing`` = 1 for ``[..., H]``, 0 for scalars)."""
    part = np.asarray(values[d])
    return part.reshape((-1, part.shape[-1])) if trailing else part.reshape(-1)


def _slot_weight(weights: np.ndarray | None, d: int, row: int) -> float:
    return 1.0 if weights is None else float(_flat(weights, d, 0)[row])


def combine(ref: RefDispatch, y: np.ndarray, weights: np.ndarray | None = None) -> np.ndarray:
    """``out [R, T, H]`` in float64: ``out[r, t] = sum over delivered (t, k) of w * y[row]``.

    ``y`` is layout-shaped per rank (``[R, C, H]`` or ``[R, L, C, H]``), ``weights`` like
    ``ref.weights`` or None (weight 1). The caller rounds to the output dtype.
    """
    hidden = y.shape[-1]
    out = np.zeros((ref.num_ranks, ref.num_tokens, hidden), np.float64)
    for (r, t, _), (d, row) in ref.rows.items():
        out[r, t] += _slot_weight(weights, d, row) * _flat(y, d, 1)[row].astype(np.float64)
    return out


def combine_ordered(
    ref: RefDispatch, y: np.ndarray, weights: np.ndarray | None = None, partial_dtype: object = None
) -> np.ndarray:
    """``out [R, T, H]`` in ``y``'s dtype, summed in SPEC's combine order (version 2).

    1. Each destination rank ``d`` sums, in float32, ``w * y[row]`` over the delivered slots of token
       ``(r, t)`` that it holds, in ascending row order (not ``k`` order).
    2. It rounds that partial sum to ``partial_dtype`` (None: ``y``'s dtype).
    3. The source adds the partials in float32 in ascending rank order and rounds once to ``y``'s dtype.

    With ``partial_dtype=np.float32`` this is the float32 sum over all delivered slots, rounded once.
    """
    out_dtype = np.dtype(y.dtype)
    partial_dtype = out_dtype if partial_dtype is None else np.dtype(partial_dtype)
    held: dict[tuple[int, int], dict[int, list[int]]] = {}
    for (r, t, _), (d, row) in ref.rows.items():
        held.setdefault((r, t), {}).setdefault(d, []).append(row)
    out = np.zeros((ref.num_ranks, ref.num_tokens, y.shape[-1]), out_dtype)
    for (r, t), per_rank in held.items():
        total = np.zeros(y.shape[-1], np.float32)
        for d in sorted(per_rank):
            partial = np.zeros(y.shape[-1], np.float32)
            for row in sorted(per_rank[d]):
                term = _flat(y, d, 1)[row].astype(np.float32)
                if weights is not None:
                    term = np.float32(_slot_weight(weights, d, row)) * term
                partial = (partial + term).astype(np.float32)
            total = (total + partial.astype(partial_dtype).astype(np.float32)).astype(np.float32)
        out[r, t] = total.astype(out_dtype)
    return out


def dispatch_vjp(ref: RefDispatch, ct_x: np.ndarray, ct_weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """SPEC Gradients, dispatch: ``dx [R, T, H]`` (float64) and ``dtopk_weights [R, T, K]`` (float32).

    ``dx[t] = sum over delivered slots of ct_x[row]``; ``dtopk_weights[t, k] = ct_weights[row]``
    when delivered, else 0.
    """
    hidden = ct_x.shape[-1]
    dx = np.zeros((ref.num_ranks, ref.num_tokens, hidden), np.float64)
    dw = np.zeros((ref.num_ranks, ref.num_tokens, ref.topk), np.float32)
    for (r, t, k), (d, row) in ref.rows.items():
        dx[r, t] += _flat(ct_x, d, 1)[row].astype(np.float64)
        dw[r, t, k] = _flat(ct_weights, d, 0)[row]
    return dx, dw


def combine_vjp(
    ref: RefDispatch, y: np.ndarray, weights: np.ndarray | None, ct_out: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """SPEC Gradients, combine: ``dy`` (layout-shaped, float64) and ``dweights`` (layout-shaped, float64).

    ``dy[row] = w * g[t]``; ``dweights[row] = <g[t], y[row]>``; padding and dropped rows get 0.
    """
    hidden = y.shape[-1]
    dy = np.zeros((ref.num_ranks, *ref.weights.shape[1:], hidden), np.float64)
    dweights = np.zeros(ref.weights.shape, np.float64)
    dy_flat = dy.reshape(ref.num_ranks, -1, hidden)
    dw_flat = dweights.reshape(ref.num_ranks, -1)
    for (r, t, _), (d, row) in ref.rows.items():
        g = ct_out[r, t].astype(np.float64)
        dy_flat[d, row] = _slot_weight(weights, d, row) * g
        dw_flat[d, row] = float(np.dot(g, _flat(y, d, 1)[row].astype(np.float64)))
    return dy, dweights


def dense_moe(x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``out[t] = sum over valid k of topk_weights[t, k] * x[t] @ w[topk_idx[t, k]]`` in float64; ``x [N, H]``."""
    out = np.zeros((x.shape[0], w.shape[-1]), np.float64)
    for t in range(x.shape[0]):
        for k in range(topk_idx.shape[1]):
            e = int(topk_idx[t, k])
            if 0 <= e < w.shape[0]:
                out[t] += float(topk_weights[t, k]) * (x[t].astype(np.float64) @ w[e].astype(np.float64))
    return out
