"""dispatch moves data, so every field is compared bit for bit with the NumPy reference."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from tests import reference
from tests.conftest import cpu_mesh
from tests.helpers import (
    AXIS,
    INVALID_IDS,
    assert_bits_equal,
    assert_dispatch_equal,
    ep_jit,
    random_inputs,
    routing,
    run_dispatch,
    specified,
)

T, H, K, E = 8, 4, 3, 8

# (routing kind, capacity, expert_alignment, dtype of x)
CASES = [
    pytest.param("distinct", None, 1, jnp.float32, id="distinct-f32"),
    pytest.param("invalid", None, 3, jnp.bfloat16, id="invalid-align3-bf16"),
    pytest.param("skewed", 5, 8, jnp.float32, id="skewed-cap5-align8-f32"),
    pytest.param("invalid", 2, 3, jnp.bfloat16, id="invalid-cap2-align3-bf16"),
]


def _check_padding(d: jax_ep.Dispatched, layout: str, alignment: int) -> None:
    """What SPEC v2 says of rows that hold no slot, checked without the reference.

    Ragged: rows past ``sum(group_sizes)`` have weight 0 (their ``x`` is unspecified and not checked);
    inside each segment the slots come first, then fewer than ``expert_alignment`` padding rows, which
    are zero with weight 0. Expert: rows past ``group_sizes[j]`` of ``x[j]`` are zero with weight 0.
    Kept rows hold real slots (the inputs' weights are positive).
    """
    for rank in range(d.x.shape[0]):
        sizes = d.group_sizes[rank]
        if layout == "ragged":
            used = int(sizes.sum())
            assert used <= d.x.shape[1]
            assert not np.any(d.weights[rank, used:])
            start = 0
            for size in sizes:
                w = d.weights[rank, start : start + size]
                slots = int(np.count_nonzero(w))
                assert np.all(w[:slots] > 0), "a segment holds its slots first, then padding"
                assert not np.any(w[slots:]) and not np.any(d.x[rank, start + slots : start + size].astype(np.float32))
                if start + size < d.x.shape[1]:  # a segment that was not truncated by the capacity
                    assert size - slots < alignment and size % alignment == 0
                start += size
        else:
            for j, size in enumerate(sizes):
                assert not np.any(d.x[rank, j, size:].astype(np.float32))
                assert not np.any(d.weights[rank, j, size:])
                assert np.all(d.weights[rank, j, :size] > 0)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize("num_ranks", [*(pytest.param(r, marks=pytest.mark.slow) for r in (1, 2, 4)), 8])
@pytest.mark.parametrize(("kind", "capacity", "alignment", "dtype"), CASES)
def test_dispatch_matches_reference(num_ranks, layout, kind, capacity, alignment, dtype):
    rng = np.random.default_rng([num_ranks, len(kind), capacity or 0, alignment, len(layout)])
    x, weights = random_inputs(rng, num_ranks, T, H, K, dtype)
    idx = routing(rng, kind, num_ranks, T, K, E)
    kwargs = dict(num_experts=E, layout=layout, capacity=capacity, expert_alignment=alignment)

    got = run_dispatch(x, idx, weights, **kwargs)
    want = reference.dispatch(x, idx, weights, **kwargs)
    assert_dispatch_equal(got, want)

    local = E // num_ranks
    cap = want.capacity
    if capacity is None:
        cap_formula = num_ranks * T * min(K, local) + local * (alignment - 1) if layout == "ragged" else num_ranks * T
        assert cap == cap_formula
        public = jax_ep.default_capacity(
            num_ranks=num_ranks, num_tokens=T, topk=K, num_experts=E, layout=layout, expert_alignment=alignment
        )
        assert public == cap_formula
    shape = (num_ranks, cap, H) if layout == "ragged" else (num_ranks, local, cap, H)
    assert got.x.shape == shape and got.x.dtype == dtype
    assert got.weights.shape == shape[:-1] and got.weights.dtype == np.float32
    assert got.group_sizes.shape == (num_ranks, local) and got.group_sizes.dtype == np.int32
    assert got.num_dropped.dtype == np.int32 and got.num_invalid.dtype == np.int32
    _check_padding(got, layout, alignment)
    if layout == "ragged":
        untruncated = got.group_sizes.sum(axis=1) < cap
        assert np.all(got.group_sizes[untruncated] % alignment == 0)

    expected_invalid = np.sum((idx != -1) & ((idx < 0) | (idx >= E)), axis=(1, 2))
    np.testing.assert_array_equal(got.num_invalid, expected_invalid)
    if kind == "invalid":
        assert got.num_invalid.sum() > 0
    if kind == "distinct":
        np.testing.assert_array_equal(got.num_dropped, 0)  # capacity=None never drops distinct ids
    if capacity is not None:
        assert got.num_dropped.sum() > 0
    # Every valid slot is either delivered or counted as dropped.
    valid = (idx >= 0) & (idx < E)
    delivered = got.group_sizes.sum() if layout == "expert" else np.count_nonzero(got.weights)
    assert delivered + got.num_dropped.sum() == valid.sum()


def _golden_inputs():
    """Two ranks, two tokens each, K=2, E=4 (L=2); tokens a0, a1 on rank 0 and b0, b1 on rank 1."""
    x = np.array([[[1.0, 1.5], [2.0, 2.5]], [[3.0, 3.5], [4.0, 4.5]]], np.float32)
    idx = np.array([[[2, 0], [-1, 2]], [[3, 2], [0, 0]]], np.int32)
    weights = np.array([[[0.1, 0.2], [0.3, 0.4]], [[0.5, 0.6], [0.7, 0.8]]], np.float32)
    return x, idx, weights


# Hand-written expectations: (layout, alignment, capacity, drop_policy) -> per rank (rows as (r, t, k) or None,
# group_sizes, num_dropped). Expert 0 gets a0 (0,0,1), b1 (1,1,0), b1 (1,1,1); expert 1 nothing; expert 2 gets
# a0 (0,0,0), a1 (0,1,1), b0 (1,0,1); expert 3 gets b0 (1,0,0). expert_load is [3, 0] on rank 0, [3, 1] on rank 1.
GOLDEN = {
    ("ragged", 1, None, "balanced"): [
        ([(0, 0, 1), (1, 1, 0), (1, 1, 1)] + [None] * 5, [3, 0], 0),
        ([(0, 0, 0), (0, 1, 1), (1, 0, 1), (1, 0, 0)] + [None] * 4, [3, 1], 0),
    ],
    ("ragged", 2, None, "balanced"): [
        ([(0, 0, 1), (1, 1, 0), (1, 1, 1)] + [None] * 7, [4, 0], 0),
        ([(0, 0, 0), (0, 1, 1), (1, 0, 1), None, (1, 0, 0)] + [None] * 5, [4, 2], 0),
    ],
    # Version 2's rule: the first C rows of the layout without a capacity; expert 3 starves on rank 1 at C=4.
    ("ragged", 2, 5, "expert"): [
        ([(0, 0, 1), (1, 1, 0), (1, 1, 1), None, None], [4, 0], 0),
        ([(0, 0, 0), (0, 1, 1), (1, 0, 1), None, (1, 0, 0)], [4, 1], 0),
    ],
    ("ragged", 2, 4, "expert"): [
        ([(0, 0, 1), (1, 1, 0), (1, 1, 1), None], [4, 0], 0),
        ([(0, 0, 0), (0, 1, 1), (1, 0, 1), None], [4, 0], 1),
    ],
    # Balanced: rank 1's level is c = 2 (align_up(2, 2) + align_up(1, 2) = 4 fits C = 4 and 5; c = 3 needs 6), so
    # expert 2 keeps its first two slots and expert 3 its one; rank 0's c = 3 keeps all (4 rows).
    ("ragged", 2, 5, "balanced"): [
        ([(0, 0, 1), (1, 1, 0), (1, 1, 1), None, None], [4, 0], 0),
        ([(0, 0, 0), (0, 1, 1), (1, 0, 0), None, None], [2, 2], 1),
    ],
    ("ragged", 2, 4, "balanced"): [
        ([(0, 0, 1), (1, 1, 0), (1, 1, 1), None], [4, 0], 0),
        ([(0, 0, 0), (0, 1, 1), (1, 0, 0), None], [2, 2], 1),
    ],
    ("ragged", 1, 3, "balanced"): [
        ([(0, 0, 1), (1, 1, 0), (1, 1, 1)], [3, 0], 0),
        ([(0, 0, 0), (0, 1, 1), (1, 0, 0)], [2, 1], 1),
    ],
    ("expert", 1, None, "balanced"): [
        ([(0, 0, 1), (1, 1, 0), (1, 1, 1), None] + [None] * 4, [3, 0], 0),
        ([(0, 0, 0), (0, 1, 1), (1, 0, 1), None, (1, 0, 0), None, None, None], [3, 1], 0),
    ],
    # The expert layout: each expert keeps its first C slots under either policy.
    **{
        ("expert", 1, 2, policy): [
            ([(0, 0, 1), (1, 1, 0), None, None], [2, 0], 1),
            ([(0, 0, 0), (0, 1, 1), (1, 0, 0), None], [2, 1], 1),
        ]
        for policy in ("balanced", "expert")
    },
}


@pytest.mark.parametrize("key", list(GOLDEN), ids=str)
def test_dispatch_golden(key):
    """A hand-worked example: order by source rank, then token, then k; padding; drops under each policy."""
    layout, alignment, capacity, policy = key
    x, idx, weights = _golden_inputs()
    got = run_dispatch(
        x,
        idx,
        weights,
        num_experts=4,
        layout=layout,
        capacity=capacity,
        expert_alignment=alignment,
        drop_policy=policy,
    )
    for rank, (rows, sizes, dropped) in enumerate(GOLDEN[key]):
        want_x = np.stack([np.zeros(2, np.float32) if s is None else x[s[0], s[1]] for s in rows])
        want_w = np.array([0.0 if s is None else weights[s] for s in rows], np.float32)
        # Ragged rows past sum(group_sizes) are unspecified; alignment padding before them is zero.
        used = sum(sizes) if layout == "ragged" else len(rows)
        assert_bits_equal(got.x[rank].reshape(-1, 2)[:used], want_x[:used], err_msg=f"x of rank {rank}")
        assert_bits_equal(got.weights[rank].reshape(-1), want_w, err_msg=f"weights of rank {rank}")
        np.testing.assert_array_equal(got.group_sizes[rank], sizes)
        assert got.num_dropped[rank] == dropped
        assert got.num_invalid[rank] == 0
        np.testing.assert_array_equal(got.expert_load[rank], [[3, 0], [3, 1]][rank])
        if layout == "ragged":
            want_experts = np.full(len(rows), -1)
            want_experts[:used] = np.repeat(np.arange(2), sizes)
            np.testing.assert_array_equal(got.row_expert[rank], want_experts)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_only_unused_and_invalid_slots(layout):
    """Ids that are -1 or out of range deliver nothing, write nothing and are counted; no crash."""
    num_ranks = 2
    rng = np.random.default_rng(7)
    x, weights = random_inputs(rng, num_ranks, T, H, K)
    idx = rng.choice(np.array([-1, *INVALID_IDS, E, E + 5], np.int64), (num_ranks, T, K)).astype(np.int32)
    idx[0, 0] = [E, -(2**31), 2**31 - 1]
    got = run_dispatch(x, idx, weights, num_experts=E, layout=layout, expert_alignment=3)
    assert_dispatch_equal(got, reference.dispatch(x, idx, weights, num_experts=E, layout=layout, expert_alignment=3))
    np.testing.assert_array_equal(got.group_sizes, 0)
    assert not np.any(got.weights)
    if layout == "expert":  # ragged: every row is past sum(group_sizes) = 0, so x is unspecified
        assert not np.any(got.x)
    np.testing.assert_array_equal(got.num_dropped, 0)
    np.testing.assert_array_equal(got.num_invalid, np.sum(idx != -1, axis=(1, 2)))
    assert got.num_invalid.sum() > 0


def test_auto_backend_equals_xla():
    """backend="auto" (the default) on CPU resolves to "xla": its handle says so, and its outputs are the explicit
    xla backend's, bit for bit."""
    num_ranks = 4
    rng = np.random.default_rng(3)
    x, weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)

    def both(x, idx, weights):
        kw = dict(num_experts=E, axis_name=AXIS, expert_alignment=3, capacity=9)
        return jax_ep.dispatch(x, idx, weights, **kw), jax_ep.dispatch(x, idx, weights, backend="xla", **kw)

    auto, xla = jax.tree.map(np.asarray, ep_jit(both, num_ranks)(x, idx, weights))
    assert auto.handle.config.backend == "xla" and auto.handle.config == xla.handle.config
    assert_dispatch_equal(auto, xla)
    assert_dispatch_equal(auto, reference.dispatch(x, idx, weights, num_experts=E, capacity=9, expert_alignment=3))


def test_auto_backend_takes_cuda_only_where_a_group_serves(monkeypatch):
    """ops._resolve_backend, which dispatch asks: "auto" is "cuda" (with the group's id) where cuda.find_group offers a
    group, else "xla"; "cuda" where no group can serve is a ValueError; "xla" is "xla" even where one could."""
    from jax_ep.ep import cuda
    from jax_ep.ep.ops import _resolve_backend

    where = (AXIS, 4, K, E)
    assert not cuda.on_gpus() and cuda.find_group(*where)[0] is None  # CPU: no group
    assert _resolve_backend("auto", *where) == ("xla", -1)
    with pytest.raises(ValueError, match="backend='cuda' cannot run here"):
        _resolve_backend("cuda", *where)
    monkeypatch.setattr(cuda, "find_group", lambda *args: (7, ""))
    assert _resolve_backend("auto", *where) == ("cuda", 7)
    assert _resolve_backend("cuda", *where) == ("cuda", 7)
    assert _resolve_backend("xla", *where) == ("xla", -1)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_dispatched_is_a_pytree_of_arrays(layout):
    """Dispatched and its handle flatten to arrays only and rebuild from their leaves."""
    num_ranks = 2
    seen = []

    def body(x, idx, weights):
        d = jax_ep.dispatch(x, idx, weights, num_experts=E, axis_name=AXIS, layout=layout)
        leaves, treedef = jax.tree.flatten(d)
        rebuilt = jax.tree.unflatten(treedef, leaves)
        assert isinstance(rebuilt, jax_ep.Dispatched) and isinstance(rebuilt.handle, jax_ep.Handle)
        assert rebuilt.handle.config == d.handle.config
        seen.append((leaves, jax.tree.leaves(d.handle)))
        return d.x

    args = (
        jax.ShapeDtypeStruct((num_ranks * T, H), jnp.float32),
        jax.ShapeDtypeStruct((num_ranks * T, K), jnp.int32),
        jax.ShapeDtypeStruct((num_ranks * T, K), jnp.float32),
    )
    with jax.set_mesh(cpu_mesh((num_ranks,), (AXIS,))):
        jax.eval_shape(jax.shard_map(body, in_specs=P(AXIS), out_specs=P(AXIS)), *args)
    leaves, handle_leaves = seen[0]
    assert handle_leaves, "the handle must carry its routing as arrays"
    assert all(isinstance(leaf, jax.Array) for leaf in leaves)
    # x, weights, group_sizes, num_dropped, num_invalid, expert_load, the handle, and row_expert (ragged; expert None)
    assert len(leaves) == 6 + len(handle_leaves) + (layout == "ragged")


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_undelivered_values_are_never_read(layout):
    """NaN/inf in the weights of unused, invalid and dropped slots, and in tokens with no valid slot, go nowhere."""
    num_ranks = 4
    rng = np.random.default_rng(21)
    x, weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    idx[:, 2] = [-1, E + 5, -7]  # token 2 of every rank has no valid slot
    x[:, 2] = np.inf
    ref = reference.dispatch(x, idx, weights, num_experts=E, layout=layout, capacity=4)
    assert ref.dropped
    for slot in np.argwhere((idx < 0) | (idx >= E)).tolist() + sorted(ref.dropped):
        weights[tuple(slot)] = np.nan
    ref = reference.dispatch(x, idx, weights, num_experts=E, layout=layout, capacity=4)

    def body(x, idx, weights):
        d = jax_ep.dispatch(x, idx, weights, num_experts=E, axis_name=AXIS, layout=layout, capacity=4)
        return d, jax_ep.combine(d.x, d.handle, weights=d.weights)

    got, out = jax.tree.map(np.asarray, ep_jit(body, num_ranks)(x, idx, weights))
    assert_dispatch_equal(got, ref)
    rows = specified(got.x, got.group_sizes)  # the ragged tail is unspecified
    assert np.all(np.isfinite(rows)) and np.all(np.isfinite(got.weights)) and np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[:, 2], 0)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_handle_slot_dest_keeps_dropped_slots_rank(layout):
    """Handle.slot_dest [T, K]: the destination rank of every valid slot, dropped ones included; -1 otherwise."""
    num_ranks = 4
    rng = np.random.default_rng([23, len(layout)])
    x, weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, weights, num_experts=E, layout=layout, capacity=3)
    assert ref.dropped

    call = ep_jit(
        lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, layout=layout, capacity=3).handle,
        num_ranks,
    )
    slot_dest = np.asarray(call(x, idx, weights).slot_dest)
    valid = (idx >= 0) & (idx < E)
    want = np.where(valid, idx // (E // num_ranks), -1).astype(np.int32)
    assert_bits_equal(slot_dest, want)
    assert all(slot_dest[slot] >= 0 for slot in ref.dropped)


@pytest.mark.parametrize("policy", ["balanced", "expert"])
def test_alignment_beyond_capacity(policy):
    """An expert_alignment far past the capacity (2**30) gives the contract's layout, without overflowing the
    segment starts: under "expert" the first segment fills all C rows and the rest are cut; under "balanced" no
    segment of a slot fits, so every slot is dropped (and with one expert holding slots, it keeps C of them)."""
    num_ranks, capacity = 2, 6
    rng = np.random.default_rng(31)
    x, weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    kw = dict(num_experts=E, capacity=capacity, expert_alignment=2**30, drop_policy=policy)
    huge = run_dispatch(x, idx, weights, **kw)
    assert_dispatch_equal(huge, reference.dispatch(x, idx, weights, **kw))
    assert np.all(huge.group_sizes >= 0) and np.all(huge.group_sizes.sum(axis=1) <= capacity)
    assert huge.num_dropped.sum() > 0


def _producer(jaxpr, var) -> str:
    """The primitive that computes ``var`` in ``jaxpr``, followed into nested calls (jit, shard_map, custom_vjp)
    and through checkpoint names (identities)."""
    for eqn in jaxpr.eqns:
        if var in eqn.outvars:
            index = eqn.outvars.index(var)
            if eqn.primitive.name == "name":
                return _producer(jaxpr, eqn.invars[index])
            for name in ("jaxpr", "call_jaxpr", "fun_jaxpr"):
                inner = eqn.params.get(name)
                if inner is not None:
                    inner = getattr(inner, "jaxpr", inner)  # a ClosedJaxpr's Jaxpr
                    return _producer(inner, inner.outvars[index])
            if "branches" in eqn.params:  # a cond (the xla exchange by platform): every branch must agree
                found = {_producer(b.jaxpr, b.jaxpr.outvars[index]) for b in eqn.params["branches"]}
                assert len(found) == 1, f"the branches compute it differently: {found}"
                return found.pop()
            return eqn.primitive.name
    raise AssertionError(f"nothing in the jaxpr computes {var}")


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_xla_row_slot_is_the_scatter_output(layout):
    """Backend xla: Handle.row_slot is the output of the scatter that places the slots, as it was at fb4c00b (with
    either exchange: the default picks one by platform).

    739ecb8 marked the ragged rows past the data -2 with a select on that scatter's result; XLA fused the
    select, which reads sum(group_sizes), into every consumer of row_slot and of d.x (a gather of each token's
    K rows, say) instead of reading one array (the issue of a scan of dispatch and such a sum, slower on an
    H200 at 739ecb8). Writing -2 into the array the slots are scattered into gives the same values.
    """
    num_ranks = 2
    mesh = cpu_mesh((num_ranks,), (AXIS,))

    def row_slot(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, layout=layout, expert_alignment=2, backend="xla")
        return d.handle.row_slot

    f = jax.shard_map(row_slot, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS))
    args = (jnp.zeros((num_ranks * T, H)), jnp.zeros((num_ranks * T, K), jnp.int32), jnp.zeros((num_ranks * T, K)))
    closed = jax.make_jaxpr(f)(*args)
    assert _producer(closed.jaxpr, closed.jaxpr.outvars[0]) == "scatter"
