"""combine sums, so it is compared with an exact (float64) reference within the rounding of its dtype."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import reference
from helpers import AXIS, assert_dispatch_equal, assert_sum_close, ep_jit, random_inputs, routing, to_numpy

import jax_ep

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
@pytest.mark.parametrize(("num_ranks", "capacity"), [(1, None), (2, 3), (4, None), (8, 4)])
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


# (dtype of the dispatched x, dtype of y, allowed error relative to the sum of |terms|): float32 accumulation
# and one rounding to y's dtype
LOW_PRECISION = [
    (jnp.float32, jnp.bfloat16, 2.0**-8 + F32_EPS),  # unit roundoff of bfloat16
    (jnp.float32, jnp.float16, 2.0**-11 + F32_EPS),
    (jnp.bfloat16, jnp.float32, F32_EPS),
]


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize(("x_dtype", "y_dtype", "eps"), LOW_PRECISION, ids=["y_bf16", "y_f16", "x_bf16"])
def test_combine_dtypes(x_dtype, y_dtype, eps, layout):
    """The output has the dtype of y, whatever x was; the error is that of one rounding to y's dtype."""
    num_ranks = 4
    rng = np.random.default_rng([11, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K, x_dtype)
    idx = routing(rng, "random", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout)
    y, _ = _layout_values(rng, ref, y_dtype)

    def body(x, idx, topk_weights, y):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=E, axis_name=AXIS, layout=layout)
        return jax_ep.combine(y, d.handle, weights=d.weights), jax_ep.combine(y, d.handle)

    weighted, ones = to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights, y))
    for out, wts in ((weighted, ref.weights), (ones, None)):
        assert out.dtype == y_dtype
        want = reference.combine(ref, y, wts)
        assert_sum_close(out, want, _magnitude(ref, y, wts), eps, err_msg=str(jnp.dtype(y_dtype)))


@pytest.mark.parametrize(
    ("dtype", "rank0_rows", "rank1_row"),
    [(jnp.bfloat16, (1.0, 2.0**-8), 2.0**-8), (jnp.float16, (40000.0, 40000.0), -30000.0)],
    ids=["bf16_tie", "f16_overflow"],
)
def test_combine_accumulates_in_float32(dtype, rank0_rows, rank1_row):
    """One token, two slots on rank 0 and one on rank 1: the float32 sum rounded once to y's dtype.

    bf16: 1 + 2**-8 + 2**-8 = 1 + 2**-7 is a bfloat16 number, but rank 0's partial sum 1 + 2**-8 rounds
    to 1 (a tie, to even) and 1 + 2**-8 does again. f16: 40000 + 40000 - 30000 = 50000 fits in float16,
    rank 0's partial sum 80000 does not (inf).
    """
    x = np.ones((2, 1, 2), np.float32)
    idx = np.array([[[0, 0, 1]], [[-1, -1, -1]]], np.int32)
    topk_weights = np.ones((2, 1, 3), np.float32)

    def body(x, idx, topk_weights):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=2, axis_name=AXIS, layout="expert")
        rows = jnp.where(jax.lax.axis_index(AXIS) == 0, jnp.array(rank0_rows), rank1_row)  # [C=2]
        return jax_ep.combine((d.x * rows[None, :, None]).astype(dtype), d.handle)

    out = np.asarray(ep_jit(body, 2)(x, idx, topk_weights))
    want = np.float32(sum(np.float32(v).astype(dtype).astype(np.float32) for v in (*rank0_rows, rank1_row)))
    np.testing.assert_array_equal(out[0, 0], np.full(2, want).astype(dtype))


@pytest.mark.parametrize("layout", ["ragged", "expert"])
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


@pytest.mark.parametrize("layout", ["ragged", "expert"])
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


@pytest.mark.parametrize("layout", ["ragged", "expert"])
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
