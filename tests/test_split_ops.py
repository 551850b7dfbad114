"""dispatch_start/dispatch_finish and combine_start/combine_finish equal dispatch and combine, gradients included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from tests.helpers import AXIS, assert_bits_equal, ep_jit, random_inputs, routing, slow, specified, to_numpy

R, T, H, K, E = 2, 8, 16, 3, 8


def _step(split: bool, layout: str):
    """dispatch -> expert -> combine (with a matmul that depends on neither between start and finish)."""

    def body(x, idx, w, a):
        kw = dict(num_experts=E, axis_name=AXIS, layout=layout, expert_alignment=2)
        if split:
            pending = jax_ep.dispatch_start(x, idx, w, **kw)
            side = jnp.tanh(x @ a)  # independent work XLA may place between the halves
            d = jax_ep.dispatch_finish(pending)
        else:
            d = jax_ep.dispatch(x, idx, w, **kw)
            side = jnp.tanh(x @ a)
        y = jnp.sin(d.x) * 1.5
        if split:
            out = jax_ep.combine_finish(jax_ep.combine_start(y, d.handle, weights=d.weights))
        else:
            out = jax_ep.combine(y, d.handle, weights=d.weights)
        return out + side, d

    return body


@pytest.mark.parametrize("layout", ["ragged", slow("expert")])
def test_split_ops_equal_the_whole_ops_bit_for_bit(layout):
    rng = np.random.default_rng(0)
    x, w = random_inputs(rng, R, T, H, K)
    idx = routing(rng, "random", R, T, K, E)
    a = rng.standard_normal((R, H, H)).astype(np.float32)
    (got, got_d), (want, want_d) = (to_numpy(ep_jit(_step(s, layout), R)(x, idx, w, a)) for s in (True, False))
    assert_bits_equal(got, want)
    assert_bits_equal(specified(got_d.x, got_d.group_sizes), specified(want_d.x, want_d.group_sizes))
    assert_bits_equal(got_d.weights, want_d.weights)

    def grads(split):
        def loss(x, idx, w, a):
            return jnp.sum(_step(split, layout)(x, idx, w, a)[0] ** 2)

        return to_numpy(ep_jit(jax.grad(loss, argnums=(0, 2, 3)), R)(x, idx, w, a))

    for g, h in zip(grads(True), grads(False), strict=True):
        assert_bits_equal(g, h)
        assert np.abs(h).sum() > 0


def test_finish_wants_what_start_returned():
    with pytest.raises(TypeError, match="dispatch_start"):
        jax_ep.dispatch_finish(jnp.zeros(3))
    with pytest.raises(TypeError, match="combine_start"):
        jax_ep.combine_finish(jnp.zeros(3))


def test_the_pending_values_are_pytrees():
    """A jitted function can return what a start op made, and a later one finish it."""
    rng = np.random.default_rng(1)
    x, w = random_inputs(rng, R, T, H, K)
    idx = routing(rng, "distinct", R, T, K, E)

    def start(x, idx, w):
        return jax_ep.dispatch_start(x, idx, w, num_experts=E, axis_name=AXIS)

    pending = ep_jit(start, R)(x, idx, w)
    assert isinstance(pending, jax_ep.PendingDispatch)
    d = to_numpy(ep_jit(lambda p: jax_ep.dispatch_finish(p).weights, R)(pending))
    want = to_numpy(
        ep_jit(lambda a, b, c: jax_ep.dispatch(a, b, c, num_experts=E, axis_name=AXIS).weights, R)(x, idx, w)
    )
    assert_bits_equal(d, want)


@pytest.mark.slow  # FP8 rows of the whole dispatch are in the default tier: tests/test_wire_fp8.py
def test_fp8_split_ops_equal_fp8_dispatch_gradients_included():
    """wire_dtype=float8_e4m3fn through the split ops: the same dequantized rows and straight-through gradients."""
    rng = np.random.default_rng(2)
    hidden = 128
    x, w = random_inputs(rng, R, T, hidden, K)
    idx = routing(rng, "random", R, T, K, E)
    kw = dict(num_experts=E, axis_name=AXIS, wire_dtype=jnp.float8_e4m3fn)
    assert not np.array_equal(jnp.asarray(x).astype(jnp.float8_e4m3fn).astype(jnp.float32), x)  # FP8 rounds x

    def value_and_grads(split):
        def loss(x, idx, w):
            if split:
                d = jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, w, **kw))
            else:
                d = jax_ep.dispatch(x, idx, w, **kw)
            return jnp.sum(jnp.sin(jax_ep.combine(d.x * 1.5, d.handle, weights=d.weights)) ** 2)

        return to_numpy(ep_jit(jax.value_and_grad(loss, argnums=(0, 2)), R)(x, idx, w))

    for got, want in zip(jax.tree.leaves(value_and_grads(True)), jax.tree.leaves(value_and_grads(False)), strict=True):
        assert_bits_equal(got, want)
        assert np.abs(want).sum() > 0


def test_dispatch_start_takes_dispatch_keywords():
    x, idx, w = jnp.zeros((4, 8)), jnp.zeros((4, 2), jnp.int32), jnp.zeros((4, 2))
    with pytest.raises(TypeError, match="num_experts"):
        jax_ep.dispatch_start(x, idx, w, axis_name=AXIS)
    with pytest.raises(TypeError, match="capacityy"):
        jax_ep.dispatch_start(x, idx, w, num_experts=E, axis_name=AXIS, capacityy=3)
