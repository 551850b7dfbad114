"""drop_policy (which slots a too-small capacity keeps) and expert_load, against the NumPy reference.

``"balanced"``: local expert ``j`` keeps ``min(n_j, c)`` of its ``n_j`` slots, ``c`` the largest integer with
``sum_j align_up(min(n_j, c), expert_alignment) <= C``; ``"expert"``: version 2's first ``C`` rows of the layout
without a capacity. Within an expert the kept slots are always its first in (source rank, token, k) order.
"""

import numpy as np
import pytest

from jax_ep.ep.routing import balanced_level
from tests import reference
from tests.helpers import assert_dispatch_equal, random_inputs, routing, run_dispatch, slow

T, H, K, E = 8, 4, 3, 16


# (drop policy, routing kind, ranks, capacity, expert_alignment)
CASES = [
    ("balanced", "random", 4, 12, 1),
    ("balanced", "invalid", 8, 10, 3),
    ("expert", "skewed", 2, 9, 1),
    slow("expert", "random", 4, 12, 1),
    slow("expert", "invalid", 8, 10, 3),
    slow("balanced", "skewed", 2, 9, 1),
    *(slow(policy, *case) for policy in ("balanced", "expert") for case in (("random", 2, 28, 4), ("skewed", 4, 7, 2))),
    slow("balanced", "random", 1, 5, 1),
]


@pytest.mark.parametrize(("policy", "kind", "num_ranks", "capacity", "alignment"), CASES)
def test_ragged_drops_match_reference(policy, kind, num_ranks, capacity, alignment):
    """Every field (expert_load and row_expert included) bit for bit; sum(expert_load) = kept + num_dropped."""
    rng = np.random.default_rng([num_ranks, capacity, alignment, len(kind)])
    x, weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, kind, num_ranks, T, K, E)
    kw = dict(num_experts=E, capacity=capacity, expert_alignment=alignment, drop_policy=policy)
    got = run_dispatch(x, idx, weights, **kw)
    want = reference.dispatch(x, idx, weights, **kw)
    assert_dispatch_equal(got, want)
    assert got.num_dropped.sum() > 0
    kept = np.count_nonzero(got.weights, axis=1)  # the inputs' weights are positive
    np.testing.assert_array_equal(got.expert_load.sum(axis=1), kept + got.num_dropped)
    if policy == "balanced":  # segments end on alignment boundaries, all within C
        assert np.all(got.group_sizes % alignment == 0) and np.all(got.group_sizes.sum(axis=1) <= capacity)


def test_balanced_starves_no_expert():
    """One expert gets most slots: "expert" (version 2) cuts the experts after it, "balanced" gives every expert
    the same level ``c``: each expert keeps min(its slots, c)."""
    num_ranks, capacity = 2, 10
    rng = np.random.default_rng(3)
    x, weights = random_inputs(rng, num_ranks, T, H, K)
    idx = np.full((num_ranks, T, K), -1, np.int32)
    idx[:, :, 0] = 0  # expert 0 of rank 0: 16 slots
    idx[:, :3, 1] = np.arange(1, 4)  # experts 1..3: 2 slots each
    kw = dict(num_experts=4, capacity=capacity)
    expert = run_dispatch(x, idx, weights, drop_policy="expert", **kw)
    balanced = run_dispatch(x, idx, weights, drop_policy="balanced", **kw)
    np.testing.assert_array_equal(expert.expert_load[0], [16, 2])
    np.testing.assert_array_equal(expert.group_sizes[0], [10, 0])  # expert 1 starves
    np.testing.assert_array_equal(balanced.group_sizes[0], [8, 2])  # c = 8: 8 + 2 = 10
    np.testing.assert_array_equal(balanced.num_dropped, expert.num_dropped)
    np.testing.assert_array_equal(balanced.row_expert[0], [0] * 8 + [1] * 2)
    for got, policy in ((expert, "expert"), (balanced, "balanced")):
        assert_dispatch_equal(got, reference.dispatch(x, idx, weights, drop_policy=policy, **kw))


@pytest.mark.parametrize("kind", [slow("random"), "skewed"])
def test_expert_layout_ignores_the_policy(kind):
    """The expert layout's capacity is per expert: both policies keep each expert's first C slots."""
    num_ranks = 4
    rng = np.random.default_rng(len(kind))
    x, weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, kind, num_ranks, T, K, E)
    kw = dict(num_experts=E, layout="expert", capacity=3)
    got = {p: run_dispatch(x, idx, weights, drop_policy=p, **kw) for p in ("balanced", "expert")}
    want = reference.dispatch(x, idx, weights, **kw)
    for policy, d in got.items():
        assert_dispatch_equal(d, want)
        assert d.num_dropped.sum() > 0, policy


def test_balanced_level_matches_reference():
    """routing.balanced_level (a binary search over the level's bits) against the reference's count-down, for
    random counts, capacities and alignments, alignments past the capacity included."""
    rng = np.random.default_rng(11)
    for _ in range(200):
        local = int(rng.integers(1, 6))
        counts = rng.integers(0, 30, (3, local)) * rng.integers(0, 2, (3, local))
        capacity = int(rng.integers(1, 60))
        alignment = int(rng.choice([1, 2, 3, 8, capacity + 1]))
        level = np.asarray(balanced_level(counts.astype(np.int32), capacity, alignment))
        for row, c in zip(counts.tolist(), level.tolist(), strict=True):
            want = reference.balanced_keep(row, capacity, alignment)
            assert [min(n, c) for n in row] == want, (row, capacity, alignment, c)
