"""Version 3's shapes and dtypes: ``x [*B, H]`` with ``topk_idx``/``topk_weights`` ``[*B, K]``, ids of any integer
dtype (a value outside int32's range is invalid), weights of any float dtype (gradient in that dtype), and
``T = 0`` / ``K = 0``; under jit, shard_map, grad, checkpoint and scan."""

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
    ep_jit,
    random_inputs,
    routing,
    run_dispatch,
    slow,
    specified,
    to_numpy,
)

R, H, K, E = 4, 8, 3, 8
B = (2, 3)  # leading dimensions per rank: T = 6 tokens


def _inputs(seed, batch=B, dtype=np.float32):
    """``x [R, *batch, H]``, ids and weights ``[R, *batch, K]`` (int32, float32), and a cotangent like ``x``."""
    rng = np.random.default_rng(seed)
    tokens = int(np.prod(batch))
    x, w = random_inputs(rng, R, tokens, H, K, dtype)
    idx = routing(rng, "invalid", R, tokens, K, E)
    g = rng.standard_normal((R, tokens, H)).astype(np.float32)
    shape = (R, *batch)
    return x.reshape(*shape, H), idx.reshape(*shape, K), w.reshape(*shape, K), g.reshape(*shape, H)


def _layer(capacity=5, **kw):
    """dispatch, an elementwise expert, combine: the Dispatched and combine's output, and both gradients."""

    def body(x, idx, w, g):
        def forward(x, w):
            d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, capacity=capacity, **kw)
            return d, jax_ep.combine(jnp.tanh(d.x), d.handle, weights=d.weights)

        d, out = forward(x, w)
        grads = jax.grad(lambda x, w: jnp.sum(forward(x, w)[1] * g), argnums=(0, 1))(x, w)
        return d, out, grads

    return body


@pytest.mark.parametrize("batch", [slow((2, 3)), slow((6,)), (1, 2, 1, 3)], ids=str)
def test_leading_dimensions_are_the_flat_tokens(batch):
    """``[R, *B, H]`` gives the dispatch, combine and gradients of its flattened ``[R, T, H]``, bit for bit;
    combine and ``dx`` come back ``[*B, ...]``."""
    x, idx, w, g = _inputs(1, batch)
    tokens = int(np.prod(batch))
    flat = [a.reshape(R, tokens, a.shape[-1]) for a in (x, idx, w, g)]
    got_d, got_out, got_grads = to_numpy(ep_jit(_layer(), R)(x, idx, w, g))
    want_d, want_out, want_grads = to_numpy(ep_jit(_layer(), R)(*flat))
    assert_dispatch_equal(got_d, want_d)
    assert_dispatch_equal(got_d, reference.dispatch(x, idx, w, num_experts=E, capacity=5))
    assert got_out.shape == (R, *batch, H) and got_grads[0].shape == x.shape and got_grads[1].shape == w.shape
    assert_bits_equal(got_out.reshape(R, tokens, H), want_out)
    for got, want in zip(got_grads, want_grads, strict=True):
        assert_bits_equal(got.reshape(want.shape), want)
    assert got_d.num_dropped.sum() > 0


def test_one_token_without_leading_dimensions():
    """``x [H]`` (``B = ()``) is one token: ``topk_idx [K]``; combine returns ``[H]``."""
    x, idx, w, _ = _inputs(2, (2,))
    x, idx, w = x[:, 0], idx[:, 0], w[:, 0]

    def body(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)
        return d, jax_ep.combine(d.x, d.handle)

    d, out = to_numpy(ep_jit(body, R)(x, idx, w))
    assert out.shape == (R, H)
    ref = reference.dispatch(x[:, None], idx[:, None], w[:, None], num_experts=E)
    assert_dispatch_equal(d, ref)
    np.testing.assert_allclose(out, reference.combine(ref, ref.x)[:, 0], rtol=1e-6)


@pytest.mark.parametrize("dtype", [np.int8, slow(np.uint8), slow(np.int16), slow(np.uint16), np.uint32])
def test_ids_of_any_integer_dtype(dtype):
    """Ids of any integer dtype give int32 ids' dispatch; a uint32 value past int32's range is invalid, never an id
    it would wrap around to (2**32 - 1 would be -1, 2**31 + 1 a negative id)."""
    x, idx, w, _ = _inputs(3)
    idx = np.where(idx < 0, -1, idx) if np.iinfo(dtype).min == 0 else idx  # unsigned: no negative ids
    ids = idx.astype(dtype)
    if dtype == np.uint32:
        ids[:, 0, 0, 0] = 2**32 - 1
        ids[:, 0, 1, :2] = 2**31 + 1
    elif np.iinfo(dtype).min == 0:
        ids[:, 0, 0, 0] = np.iinfo(dtype).max  # an invalid id of an unsigned dtype
    got = run_dispatch(x, ids, w, num_experts=E)
    assert_dispatch_equal(got, reference.dispatch(x, ids, w, num_experts=E))
    invalid = (ids.astype(np.int64) != -1) & ((ids.astype(np.int64) < 0) | (ids.astype(np.int64) >= E))
    np.testing.assert_array_equal(got.num_invalid, invalid.sum(axis=(1, 2, 3)))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, slow(jnp.float16), slow(jnp.float8_e4m3fn)])
def test_weights_of_any_float_dtype(dtype):
    """The weight used is the float32 value of a ``dtype`` weight, and its gradient has ``dtype``: the float32
    weights' gradient rounded to it."""
    x, idx, w, g = _inputs(4)
    w = np.asarray(jnp.asarray(w, dtype))
    w32 = w.astype(np.float32)
    got_d, got_out, (got_dx, got_dw) = to_numpy(ep_jit(_layer(), R)(x, idx, w, g))
    want_d, want_out, (want_dx, want_dw) = to_numpy(ep_jit(_layer(), R)(x, idx, w32, g))
    assert_dispatch_equal(got_d, want_d)
    assert_bits_equal(got_out, want_out)
    assert_bits_equal(got_dx, want_dx)
    assert got_dw.dtype == jnp.dtype(dtype)
    assert_bits_equal(got_dw, np.asarray(jnp.asarray(want_dw).astype(dtype)))
    assert np.any(want_dw)


def _empty_step(num_tokens, topk, layout, split, capacity=None):
    """A layer on ``T`` tokens with ``K`` slots each, under checkpoint, scan and grad: outputs and gradients."""

    def layer(x, w, idx):
        kw = dict(num_experts=E, axis_name=AXIS, layout=layout, capacity=capacity)
        if split:
            d = jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, w, **kw))
            out = jax_ep.combine_finish(jax_ep.combine_start(d.x * 2, d.handle, weights=d.weights))
        else:
            d = jax_ep.dispatch(x, idx, w, **kw)
            out = jax_ep.combine(d.x * 2, d.handle, weights=d.weights)
        return out, d

    def body(x, idx, w):
        def loss(x, w):
            def step(carry, _):
                out, _ = jax.checkpoint(layer)(carry, w, idx)
                return out, None

            return jnp.sum(jax.lax.scan(step, x, None, length=2)[0])

        return layer(x, w, idx), jax.grad(loss, argnums=(0, 1))(x, w)

    x = np.ones((R, 2, num_tokens, H), np.float32)
    idx = np.zeros((R, 2, num_tokens, topk), np.int32)
    w = np.ones((R, 2, num_tokens, topk), np.float32)
    return to_numpy(ep_jit(body, R)(x, idx, w))


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize(
    ("num_tokens", "topk", "split"), [(0, 2, False), (3, 0, False), slow(0, 0, True), (3, 0, True)]
)
def test_no_tokens_or_no_slots(num_tokens, topk, layout, split):
    """``T = 0`` or ``K = 0``: every output has its stated shape, nothing is delivered, combine returns zeros, the
    gradients are zeros of the inputs' shapes; under jit, shard_map, grad, checkpoint and scan, split ops too."""
    (out, d), (dx, dw) = _empty_step(num_tokens, topk, layout, split)
    local, tokens = E // R, 2 * num_tokens
    capacity = jax_ep.default_capacity(num_ranks=R, num_tokens=tokens, topk=topk, num_experts=E, layout=layout)
    rows = (capacity,) if layout == "ragged" else (local, capacity)
    assert d.x.shape == (R, *rows, H) and d.weights.shape == (R, *rows)
    assert out.shape == (R, 2, num_tokens, H) and not np.any(out)
    assert dx.shape == (R, 2, num_tokens, H) and not np.any(dx)
    assert dw.shape == (R, 2, num_tokens, topk) and not np.any(dw)
    for field in ("group_sizes", "expert_load"):
        assert getattr(d, field).shape == (R, local) and not np.any(getattr(d, field))
    assert not np.any(d.num_dropped) and not np.any(d.num_invalid) and not np.any(d.weights)
    assert not np.any(specified(d.x, d.group_sizes))
    if layout == "ragged":
        np.testing.assert_array_equal(d.row_expert, -1)
    else:
        assert d.row_expert is None
    # With rows (a capacity given), none holds a slot: ragged rows are past the data, expert rows hold no slot.
    (_, d), _ = _empty_step(num_tokens, topk, layout, split, capacity=4)
    h = d.handle
    np.testing.assert_array_equal(
        h.row_slot, np.full((R, 4 * (1 if layout == "ragged" else local)), -2 if layout == "ragged" else -1)
    )
    sent = (("token_dest_pos", (tokens, R)), ("slot_dest", (tokens, topk)), ("recv_rows", (R, tokens, topk)))
    for field, shape in sent:
        np.testing.assert_array_equal(getattr(h, field), np.full((R, *shape), -1), err_msg=field)
    for field in ("send_counts", "recv_counts"):
        np.testing.assert_array_equal(getattr(h, field), np.zeros((R, R)), err_msg=field)
