"""combine sums: it is compared with an exact (float64) reference within the rounding of SPEC's summation order,
and bit for bit with that order itself (``reference.combine_ordered``) where every product is exact in float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from tests import reference
from tests.helpers import (
    AXIS,
    assert_bits_equal,
    assert_dispatch_equal,
    assert_sum_close,
    ep_jit,
    random_inputs,
    routing,
    slow,
    to_numpy,
)

T, H, K, E = 8, 4, 3, 8
F32_EPS = 1e-5  # float32 accumulation of a few terms, with room to spare


def _layout_values(rng, ref, dtype=np.float32):
    """Random non-zero expert outputs ``[R, *layout, H]`` and row weights ``[R, *layout]`` (padding rows too)."""
    y = rng.standard_normal((*ref.x.shape[:-1], H)).astype(np.float32)
    y = np.where(np.abs(y) < 0.05, -0.5, y).astype(dtype)
    weights = (rng.random(ref.weights.shape) + 0.5).astype(np.float32)
    return y, weights


def _magnitude(ref, y, weights):
    """The reference sum over absolute values of the terms (scale for rounding errors)."""
    abs_w = None if weights is None else np.abs(weights)
    return reference.combine(ref, np.abs(y.astype(np.float64)), abs_w)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize(("num_ranks", "capacity"), [slow(1, None), (2, 3), slow(4, None), slow(8, 4)])
def test_combine_matches_reference(num_ranks, capacity, layout):
    """Given weights, no weights (1) and the dispatched weights; dropped and padding rows add nothing."""
    rng = np.random.default_rng([num_ranks, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout, capacity=capacity)
    y, row_weights = _layout_values(rng, ref)

    def body(x, idx, topk_weights, y, row_weights):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=E, axis_name=AXIS, layout=layout, capacity=capacity)
        return (
            d,
            jax_ep.combine(y, d.handle, weights=row_weights),
            jax_ep.combine(y, d.handle),
            jax_ep.combine(y, d.handle, weights=d.weights),
        )

    d, given, ones, dispatched = to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights, y, row_weights))
    assert_dispatch_equal(d, ref)
    if capacity is not None:
        assert d.num_dropped.sum() > 0
    for name, out, wts in (("given", given, row_weights), ("None", ones, None), ("d.weights", dispatched, ref.weights)):
        assert out.shape == (num_ranks, T, H) and out.dtype == np.float32
        want = reference.combine(ref, y, wts)
        assert_sum_close(out, want, _magnitude(ref, y, wts), F32_EPS, err_msg=f"weights={name}")
    # A token with no delivered slot gets exactly zero.
    for r in range(num_ranks):
        for t in range(T):
            if not any((r, t, k) in ref.rows for k in range(K)):
                assert not np.any(given[r, t])


# (dtype of the dispatched x, dtype of y, unit roundoff of y's dtype)
LOW_PRECISION = [
    (jnp.float32, jnp.bfloat16, 2.0**-8),
    slow(jnp.float32, jnp.float16, 2.0**-11),
    (jnp.bfloat16, jnp.float32, 2.0**-24),
]


def _exact_products(values):
    """``values`` rounded to bfloat16 (at most 8 significant bits), in their own dtype.

    A product of such a weight and a bfloat16, float16 or rounded float32 ``y`` is exact in float32,
    so the float32 sums of SPEC's order fix every bit of the result, whether or not the compiler
    fuses a multiply and an add.
    """
    return np.asarray(values).astype(jnp.bfloat16).astype(values.dtype)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize("partial_dtype", [None, slow(jnp.float32)], ids=["partial_default", "partial_f32"])
@pytest.mark.parametrize(("x_dtype", "y_dtype", "unit"), LOW_PRECISION, ids=["y_bf16", "y_f16", "x_bf16"])
def test_combine_dtypes(x_dtype, y_dtype, unit, partial_dtype, layout):
    """The output has y's dtype whatever x was, and is SPEC's summation order bit for bit.

    Against the exact sum: by default each rank's partial is rounded to y's dtype and so is the total
    (2 roundings); with ``partial_dtype=float32`` only the total is (1 rounding, the version-1 sum).
    """
    num_ranks = 4
    rng = np.random.default_rng([11, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K, x_dtype)
    topk_weights = _exact_products(topk_weights)
    idx = routing(rng, "random", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout)
    y, _ = _layout_values(rng, ref)
    y = _exact_products(y).astype(y_dtype)

    def body(x, idx, topk_weights, y):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=E, axis_name=AXIS, layout=layout)
        return (
            jax_ep.combine(y, d.handle, weights=d.weights, partial_dtype=partial_dtype),
            jax_ep.combine(y, d.handle, partial_dtype=partial_dtype),
        )

    weighted, ones = to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights, y))
    roundings = 1 if partial_dtype == jnp.float32 or y_dtype == jnp.float32 else 2
    spread = 0
    for out, wts in ((weighted, ref.weights), (ones, None)):
        assert out.dtype == y_dtype
        assert_bits_equal(out, reference.combine_ordered(ref, y, wts, partial_dtype), err_msg="SPEC's order")
        want = reference.combine(ref, y, wts)
        eps = roundings * unit + F32_EPS
        assert_sum_close(out, want, _magnitude(ref, y, wts), eps, err_msg=str(jnp.dtype(y_dtype)))
        # Tokens whose slots sit on several ranks: there the default differs from one rounding of the sum.
        spread += np.count_nonzero(out != reference.combine_ordered(ref, y, wts, np.float32))
    if roundings == 2:
        assert spread > 0, "no token shows the rounding of its partial sums; the test would not notice v1"


# One token, two slots on rank 0 and one on rank 1: (dtype of y, rank 0's rows, rank 1's row, the version-1 sum,
# the default sum).
#   bf16: 1 + 2**-8 + 2**-8 = 1 + 2**-7 is a bfloat16 number; rank 0's partial 1 + 2**-8 is a tie and rounds to 1
#         in bfloat16, and so does the total 1 + 2**-8.
#   f16:  40000 + 40000 - 30000 = 50000 fits in float16; rank 0's partial 80000 does not (inf).
TWO_RANKS = [
    pytest.param(jnp.bfloat16, (1.0, 2.0**-8), 2.0**-8, 1.0 + 2.0**-7, 1.0, id="bf16_tie"),
    pytest.param(jnp.float16, (40000.0, 40000.0), -30000.0, 50000.0, np.inf, id="f16_overflow"),
]


def _two_rank_combine(dtype, rank0_rows, rank1_row, **kwargs):
    """combine of that token in ``dtype``: ``out [2, 1, 2]``."""
    x = np.ones((2, 1, 2), np.float32)
    idx = np.array([[[0, 0, 1]], [[-1, -1, -1]]], np.int32)
    topk_weights = np.ones((2, 1, 3), np.float32)

    def body(x, idx, topk_weights):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=2, axis_name=AXIS, layout="expert")
        rows = jnp.where(jax.lax.axis_index(AXIS) == 0, jnp.array(rank0_rows), rank1_row)  # [C=2]
        return jax_ep.combine((d.x * rows[None, :, None]).astype(dtype), d.handle, **kwargs)

    return np.asarray(ep_jit(body, 2)(x, idx, topk_weights))


@pytest.mark.parametrize(("dtype", "rank0_rows", "rank1_row", "v1_sum", "default_sum"), TWO_RANKS)
def test_combine_accumulates_in_float32(dtype, rank0_rows, rank1_row, v1_sum, default_sum):
    """``partial_dtype=float32`` keeps version 1: the float32 sum over all slots, rounded once to y's dtype."""
    out = _two_rank_combine(dtype, rank0_rows, rank1_row, partial_dtype=jnp.float32)
    assert_bits_equal(out[0, 0], np.full(2, v1_sum).astype(dtype))
    assert not np.any(out[1])


@pytest.mark.parametrize(("dtype", "rank0_rows", "rank1_row", "v1_sum", "default_sum"), TWO_RANKS)
def test_combine_rounds_each_partial_by_default(dtype, rank0_rows, rank1_row, v1_sum, default_sum):
    """By default each rank's partial sum is rounded to y's dtype before the source adds them.

    ``partial_dtype=y.dtype`` is the same, and both differ from the float32 partials of version 1.
    """
    default = _two_rank_combine(dtype, rank0_rows, rank1_row)
    assert_bits_equal(default[0, 0], np.full(2, default_sum).astype(dtype))
    assert_bits_equal(_two_rank_combine(dtype, rank0_rows, rank1_row, partial_dtype=dtype), default)
    assert np.asarray(v1_sum).astype(dtype) != np.asarray(default_sum).astype(dtype)


def test_combine_accumulates_each_partial_in_float32():
    """Inside one rank the terms are summed in float32 whatever y's dtype: bf16 terms never accumulate in bf16.

    One rank, one token with 4 slots: ``1 + 3 * 2**-9`` rounds up to ``1 + 2**-7`` in bfloat16, where adding
    each ``2**-9`` in bfloat16 would give 1 every time.
    """
    x = np.ones((1, 1, 2), np.float32)
    idx = np.zeros((1, 1, 4), np.int32)
    terms = (1.0, 2.0**-9, 2.0**-9, 2.0**-9)

    def body(x, idx, topk_weights):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=1, axis_name=AXIS, layout="expert", capacity=4)
        y = (d.x * jnp.array(terms)[None, :, None]).astype(jnp.bfloat16)
        return jax_ep.combine(y, d.handle), jax_ep.combine(y, d.handle, partial_dtype=jnp.float32)

    default, exact = to_numpy(ep_jit(body, 1)(x, idx, np.ones((1, 1, 4), np.float32)))
    assert_bits_equal(default[0, 0], np.full(2, 1.0 + 2.0**-7).astype(jnp.bfloat16))
    assert_bits_equal(exact, default)  # one rank: its partial, rounded to bf16, is the total


def test_combine_sums_in_row_order_then_rank_order():
    """Each rank adds a token's slots in row order (not k order); the source adds the partials by rank.

    R=4, E=8 (L=2), y = 1 so each term is its slot's weight (powers of two, exact). Token 0 of rank 0
    picks experts [1, 0, 0] with weights [1, 1, 2**24]: its rows on rank 0 hold k=1, k=2 (expert 0), then
    k=0 (expert 1), so the row order sums (1 + 2**24) + 1 = 2**24 (ties to even) where k order gives
    2**24 + 2. Token 0 of rank 3 picks experts [0, 2, 4] (ranks 0, 1, 2) with weights [2**24, 1, 1]:
    ascending rank order gives (2**24 + 1) + 1 = 2**24 where descending gives 2**24 + 2.
    """
    num_ranks, experts, big = 4, 8, 2.0**24
    x = np.ones((num_ranks, 1, 2), np.float32)
    idx = np.full((num_ranks, 1, 3), -1, np.int32)
    topk_weights = np.ones((num_ranks, 1, 3), np.float32)
    idx[0, 0], topk_weights[0, 0] = [1, 0, 0], [1, 1, big]
    idx[3, 0], topk_weights[3, 0] = [0, 2, 4], [big, 1, 1]
    ref = reference.dispatch(x, idx, topk_weights, num_experts=experts)
    assert [ref.rows[0, 0, k] for k in range(3)] == [(0, 3), (0, 0), (0, 1)]  # k=0 lands after k=1 and k=2

    def body(x, idx, topk_weights):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=experts, axis_name=AXIS)
        return [jax_ep.combine(d.x, d.handle, weights=d.weights, partial_dtype=p) for p in (None, jnp.float32)]

    for out in to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights)):
        assert_bits_equal(out[0, 0], np.full(2, big, np.float32), err_msg="row order on rank 0")
        assert_bits_equal(out[3, 0], np.full(2, big, np.float32), err_msg="ascending rank order")
        assert_bits_equal(out, reference.combine_ordered(ref, ref.x, ref.weights))
    exact = reference.combine(ref, ref.x, ref.weights)
    assert exact[0, 0, 0] == exact[3, 0, 0] == big + 2  # k order, descending rank order or float64: 2**24 + 2


@pytest.mark.parametrize("layout", ["ragged", slow("expert")])
def test_dropped_slots_contribute_nothing(layout):
    """Every token picks experts 0 and 3 (E=4, R=2); capacity 3 keeps only rank 0's first three tokens."""
    num_ranks, tokens, experts = 2, 4, 4
    rng = np.random.default_rng(5)
    x, topk_weights = random_inputs(rng, num_ranks, tokens, H, 2)
    idx = np.broadcast_to(np.array([0, 3], np.int32), (num_ranks, tokens, 2)).copy()

    def body(x, idx, topk_weights):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=experts, axis_name=AXIS, layout=layout, capacity=3)
        return d.num_dropped, jax_ep.combine(2 * d.x, d.handle, weights=d.weights)

    dropped, out = to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights))
    np.testing.assert_array_equal(dropped, [2 * tokens - 3] * num_ranks)
    want = np.zeros((num_ranks, tokens, H), np.float64)
    want[0, :3] = 2 * topk_weights[0, :3].sum(-1, keepdims=True) * x[0, :3]
    assert_sum_close(out, want, np.abs(want), F32_EPS)
    assert not np.any(out[0, 3:]) and not np.any(out[1])


@pytest.mark.parametrize("layout", [slow("ragged"), "expert"])
def test_padding_rows_are_never_read(layout):
    """Rows that hold no delivered slot (padding, rows past the data) may hold NaN in y and weights: no effect."""
    num_ranks = 2
    rng = np.random.default_rng(13)
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout, capacity=6, expert_alignment=3)
    y, row_weights = _layout_values(rng, ref)
    used = np.zeros(ref.weights.shape, bool)
    for d, row in ref.rows.values():
        used.reshape(num_ranks, -1)[d, row] = True
    assert not used.all()
    y[~used] = np.nan
    row_weights[~used] = np.inf

    def body(x, idx, topk_weights, y, row_weights):
        d = jax_ep.dispatch(
            x, idx, topk_weights, num_experts=E, axis_name=AXIS, layout=layout, capacity=6, expert_alignment=3
        )
        return jax_ep.combine(y, d.handle, weights=row_weights), jax_ep.combine(y, d.handle)

    outs = ep_jit(body, num_ranks)(x, idx, topk_weights, y, row_weights)
    clean_y = np.where(used[..., None], y, 0)
    for out, wts in zip(outs, (np.where(used, row_weights, 0), None), strict=True):
        assert np.all(np.isfinite(out))
        want = reference.combine(ref, clean_y, wts)
        assert_sum_close(np.asarray(out), want, _magnitude(ref, clean_y, wts), F32_EPS)


@pytest.mark.parametrize("layout", ["ragged", slow("expert")])
def test_handle_crosses_jit_boundaries(layout):
    """The handle is data: dispatch in one jitted call, combine in another, with the handle as an argument."""
    num_ranks = 4
    rng = np.random.default_rng(9)
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout, capacity=5)
    y, _ = _layout_values(rng, ref)

    first = ep_jit(
        lambda x, i, w: jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS, layout=layout, capacity=5), num_ranks
    )
    d = first(x, idx, topk_weights)
    assert isinstance(d, jax_ep.Dispatched)
    out = ep_jit(lambda d, y: jax_ep.combine(y, d.handle, weights=d.weights), num_ranks)(d, y)
    want = reference.combine(ref, y, ref.weights)
    assert_sum_close(np.asarray(out), want, _magnitude(ref, y, ref.weights), F32_EPS)
