"""SPEC v2 determinism: every output and gradient is bit-identical from run to run for the same inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from tests.helpers import AXIS, assert_bits_equal, ep_jit, random_inputs, routing, slow, specified, to_numpy

T, H, K, E = 8, 16, 4, 8


def _body(layout, capacity):
    """One rank: dispatch, combine with both partial dtypes, and the gradients of both ops."""

    def body(x, idx, topk_weights, y, g):
        def forward(x, topk_weights, y):
            d = jax_ep.dispatch(x, idx, topk_weights, num_experts=E, axis_name=AXIS, layout=layout, capacity=capacity)
            outs = (
                jax_ep.combine(y, d.handle, weights=d.weights),
                jax_ep.combine(y, d.handle, weights=d.weights, partial_dtype=jnp.float32),
                jax_ep.combine(d.x * 3, d.handle),
            )
            return outs, d

        outs, d = forward(x, topk_weights, y)

        def loss(x, topk_weights, y):
            return sum(jnp.sum(o.astype(jnp.float32) * g) for o in forward(x, topk_weights, y)[0])

        grads = jax.grad(loss, argnums=(0, 1, 2))(x, topk_weights, y)
        return d, outs, grads

    return body


@pytest.mark.parametrize("layout", ["ragged", slow("expert")])
def test_same_inputs_same_bits(layout):
    """The same jitted call twice, and a second, separately traced and compiled call: the same bits everywhere."""
    num_ranks, capacity = 4, 12  # some slots dropped
    rng = np.random.default_rng([41, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K, jnp.bfloat16)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    layout_shape = (capacity,) if layout == "ragged" else (E // num_ranks, capacity)
    y = rng.standard_normal((num_ranks, *layout_shape, H)).astype(jnp.bfloat16)
    g = rng.standard_normal((num_ranks, T, H)).astype(np.float32)
    args = (x, idx, topk_weights, y, g)

    call = ep_jit(_body(layout, capacity), num_ranks)
    first, second = to_numpy(call(*args)), to_numpy(call(*args))
    third = to_numpy(ep_jit(_body(layout, capacity), num_ranks)(*args))  # a new trace and compilation
    d = first[0]
    assert d.num_dropped.sum() > 0 and d.num_invalid.sum() > 0
    for other in (second, third):
        # The ragged tail of d.x is unspecified: every other output, the handle and every gradient are compared.
        got_leaves = jax.tree_util.tree_leaves_with_path(_defined(other))
        want_leaves = jax.tree_util.tree_leaves(_defined(first))
        assert len(got_leaves) == len(want_leaves) > 10
        for (path, got), want in zip(got_leaves, want_leaves, strict=True):
            assert_bits_equal(got, want, err_msg=jax.tree_util.keystr(path))


def _defined(result):
    """``result`` with the unspecified ragged tail of ``d.x`` zeroed."""
    d, outs, grads = result
    return (
        (specified(d.x, d.group_sizes), d.weights, d.group_sizes, d.num_dropped, d.num_invalid, d.handle),
        outs,
        grads,
    )
