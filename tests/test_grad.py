"""Gradients: finite differences, the NumPy reference of SPEC's Gradients section, and a dense MoE."""

from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P
from jax.test_util import check_grads

import jax_ep
from tests import reference
from tests.conftest import cpu_mesh
from tests.helpers import AXIS, assert_bits_equal, assert_sum_close, ep_jit, random_inputs, routing, slow, to_numpy

T, H, K, E = 6, 4, 3, 8
TOL = dict(rtol=2e-5, atol=2e-5)  # float32 sums of a few O(1) terms in a different order


def _dispatch(x, idx, topk_weights, layout, capacity=None, **kw):
    return jax_ep.dispatch(x, idx, topk_weights, num_experts=E, axis_name=AXIS, layout=layout, capacity=capacity, **kw)


def _experts(d, w_local, layout):
    """Local expert ``j`` applies ``w_local[j] [H, H]`` to its rows."""
    if layout == "ragged":
        return jax.lax.ragged_dot(d.x, w_local, d.group_sizes)
    return jnp.einsum("lch,lhg->lcg", d.x, w_local)


def _moe(layout, capacity=None, **kw):
    """One rank of the MoE: dispatch, per-local-expert matmul, combine with ``d.weights``."""

    def moe(x, idx, topk_weights, w_local):
        d = _dispatch(x, idx, topk_weights, layout, capacity, **kw)
        return jax_ep.combine(_experts(d, w_local, layout), d.handle, weights=d.weights), d.num_dropped

    return moe


def _gate(idx, topk_weights):
    """Dense ``[N, E]`` gate: the sum of a token's weights for each valid expert id (others ignored)."""
    onehot = idx[..., None] == jnp.arange(E)
    return jnp.sum(jnp.where(onehot, topk_weights[..., None], 0.0), axis=1)


def dense_moe(x, idx, topk_weights, w):
    """The same MoE on one device without shard_map: ``x [N, H]``, ``w [E, H, H]``."""
    return jnp.einsum("ne,nh,ehg->ng", _gate(idx, topk_weights), x, w)


def _weights(rng, num_layers=None):
    shape = (E, H, H) if num_layers is None else (num_layers, E, H, H)
    return (rng.standard_normal(shape) / np.sqrt(H)).astype(np.float32)


def _masked(idx, ref):
    """``idx`` with the slots that the reference dropped set to -1 (what a dense MoE then computes)."""
    out = idx.copy()
    for r, t, k in ref.dropped:
        out[r, t, k] = -1
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Finite differences.


@pytest.mark.parametrize("layout", ["ragged", slow("expert")])
def test_dispatch_check_grads(layout):
    """d/dx and d/dtopk_weights of a loss on d.x and d.weights, with dropped slots (capacity 4)."""
    num_ranks = 4
    rng = np.random.default_rng([1, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout, capacity=4)
    assert ref.num_dropped.sum() > 0
    cx = rng.standard_normal(ref.x.shape).astype(np.float32)
    cw = rng.standard_normal(ref.weights.shape).astype(np.float32)

    def body(x, idx, topk_weights, cx, cw):
        d = _dispatch(x, idx, topk_weights, layout, capacity=4)
        return jnp.sum(jnp.sin(d.x) * cx) + jnp.sum(d.weights * cw)

    call = ep_jit(body, num_ranks)
    check_grads(
        lambda x, tw: call(x, idx, tw, cx, cw), (x, topk_weights), order=1, modes=("rev",), atol=1e-2, rtol=1e-2
    )


@pytest.mark.parametrize("layout", [slow("ragged"), "expert"])
def test_combine_check_grads(layout):
    """d/dy and d/dweights of combine (given weights), and d/dy with weights=None."""
    num_ranks = 4
    rng = np.random.default_rng([2, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout, capacity=4)
    y = rng.standard_normal(ref.x.shape).astype(np.float32)
    row_weights = rng.standard_normal(ref.weights.shape).astype(np.float32)

    def body(x, idx, topk_weights, y, row_weights):
        d = _dispatch(x, idx, topk_weights, layout, capacity=4)
        return jax_ep.combine(y, d.handle, weights=row_weights), jax_ep.combine(jnp.sin(y), d.handle)

    call = ep_jit(body, num_ranks)
    check_grads(
        lambda y, rw: call(x, idx, topk_weights, y, rw), (y, row_weights), order=1, modes=("rev",), atol=1e-2, rtol=1e-2
    )


# ---------------------------------------------------------------------------------------------------------------------
# SPEC's Gradients section, against the NumPy reference.


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize(("num_ranks", "capacity", "dtype"), [slow(2, 3, jnp.float32), (8, None, jnp.bfloat16)])
def test_dispatch_vjp_matches_reference(num_ranks, capacity, dtype, layout):
    """dx[t] sums the row cotangents of its delivered slots; dtopk_weights[t, k] is its row's, else 0."""
    rng = np.random.default_rng([3, num_ranks, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K, dtype)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout, capacity=capacity)
    ct_x = rng.standard_normal(ref.x.shape).astype(dtype)
    ct_w = (rng.random(ref.weights.shape) + 0.5).astype(np.float32)
    used = np.zeros(ref.weights.shape, bool)
    for d, row in ref.rows.values():
        used.reshape(num_ranks, -1)[d, row] = True
    ct_x[~used], ct_w[~used] = np.nan, np.inf  # cotangents of rows without a slot must not leak

    def body(x, idx, topk_weights, ct_x, ct_w):
        def rows(x, idx, topk_weights):
            d = _dispatch(x, idx, topk_weights, layout, capacity)
            return d.x, d.weights

        _, pullback = jax.vjp(rows, x, idx, topk_weights)
        dx, d_idx, dw = pullback((ct_x, ct_w))
        assert d_idx.dtype == jax.dtypes.float0  # topk_idx has no gradient
        return dx, dw

    dx, dw = to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights, ct_x, ct_w))
    want_dx, want_dw = reference.dispatch_vjp(ref, ct_x, ct_w)
    assert dx.dtype == dtype and np.all(np.isfinite(dx.astype(np.float32))) and np.all(np.isfinite(dw))
    eps = 2.0**-7 if dtype == jnp.bfloat16 else 1e-6
    assert_sum_close(dx, want_dx, reference.dispatch_vjp(ref, np.abs(ct_x.astype(np.float64)), ct_w)[0], eps)
    # SPEC: dx is a combine of the cotangent with the default partial_dtype; no weights, so every bit is fixed.
    assert_bits_equal(dx, reference.combine_ordered(ref, ct_x))
    assert_bits_equal(dw, want_dw)
    for slot in ref.dropped:
        assert dw[slot] == 0
    assert np.all(dw[(idx < 0) | (idx >= E)] == 0)
    if capacity is not None:
        assert ref.dropped


@pytest.mark.parametrize("path", ["fused", slow("separate"), slow("split")])
def test_dispatch_partial_dtype_sets_its_backward_sums(path):
    """dispatch(partial_dtype=float32): dx is the float32 sum over the slots' row cotangents, rounded once to x's
    dtype (reference.combine_ordered with float32 partials), on every path of the op; without it, each rank's
    partial is rounded to bfloat16 first, which differs."""
    num_ranks = 4
    rng = np.random.default_rng(17)
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K, jnp.bfloat16)
    idx = routing(rng, "random", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E)
    ct_x = (rng.standard_normal(ref.x.shape) * 3).astype(jnp.bfloat16)

    def body(partial_dtype):
        def run(x, idx, topk_weights, ct_x):
            kw = dict(num_experts=E, axis_name=AXIS, partial_dtype=partial_dtype)

            def rows(x):
                if path == "split":
                    return jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, topk_weights, **kw)).x
                return jax_ep.dispatch(x, idx, topk_weights, transfer=path, **kw).x

            return jax.vjp(rows, x)[1](ct_x)[0]

        return run

    exact, rounded = (to_numpy(ep_jit(body(p), num_ranks)(x, idx, topk_weights, ct_x)) for p in (jnp.float32, None))
    assert_bits_equal(exact, reference.combine_ordered(ref, ct_x, partial_dtype=np.float32))
    assert_bits_equal(rounded, reference.combine_ordered(ref, ct_x))
    assert np.any(exact != rounded)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_combine_vjp_matches_reference(layout):
    """dy[row] = w * g[t]; dweights[row] = <g[t], y[row]>; padding and dropped rows get 0."""
    num_ranks, capacity = 4, 4
    rng = np.random.default_rng([4, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout, capacity=capacity)
    assert ref.dropped
    y = rng.standard_normal(ref.x.shape).astype(np.float32)
    row_weights = (rng.random(ref.weights.shape) + 0.5).astype(np.float32)
    g = rng.standard_normal((num_ranks, T, H)).astype(np.float32)

    def body(x, idx, topk_weights, y, row_weights, g):
        d = _dispatch(x, idx, topk_weights, layout, capacity)
        _, pullback = jax.vjp(lambda y, w: jax_ep.combine(y, d.handle, weights=w), y, row_weights)
        _, pullback_ones = jax.vjp(lambda y: jax_ep.combine(y, d.handle), y)
        return (*pullback(g), *pullback_ones(g))

    dy, dweights, dy_ones = to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights, y, row_weights, g))
    want_dy, want_dweights = reference.combine_vjp(ref, y, row_weights, g)
    want_dy_ones, _ = reference.combine_vjp(ref, y, None, g)
    np.testing.assert_allclose(dy, want_dy, rtol=1e-6, atol=0)
    np.testing.assert_array_equal(dy_ones, want_dy_ones)  # a copy of g
    magnitude = reference.combine_vjp(ref, np.abs(y), None, np.abs(g))[1]
    assert_sum_close(dweights, want_dweights, magnitude, 1e-6)
    used = np.zeros(ref.weights.shape, bool)
    for d, row in ref.rows.values():
        used.reshape(num_ranks, -1)[d, row] = True
    assert not np.any(dy[~used]) and not np.any(dy_ones[~used]) and not np.any(dweights[~used])
    assert np.all(dweights[used] != 0)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_combine_vjp_padding_rows_get_zero_even_if_not_finite(layout):
    """An expert may leave NaN/inf on padding rows (e.g. it normalizes rows, and padding rows are zero)."""
    num_ranks = 2
    rng = np.random.default_rng([14, len(layout)])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout)
    used = np.zeros(ref.weights.shape, bool)
    for d, row in ref.rows.values():
        used.reshape(num_ranks, -1)[d, row] = True
    assert not used.all()
    y = rng.standard_normal(ref.x.shape).astype(np.float32)
    row_weights = (rng.random(ref.weights.shape) + 0.5).astype(np.float32)
    y[~used], row_weights[~used] = np.nan, np.inf
    g = rng.standard_normal((num_ranks, T, H)).astype(np.float32)

    def body(x, idx, topk_weights, y, row_weights, g):
        d = _dispatch(x, idx, topk_weights, layout)
        return jax.vjp(lambda y, w: jax_ep.combine(y, d.handle, weights=w), y, row_weights)[1](g)

    dy, dweights = to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights, y, row_weights, g))
    want_dy, want_dweights = reference.combine_vjp(ref, np.where(used[..., None], y, 0), row_weights, g)
    np.testing.assert_allclose(dy[used], want_dy[used], rtol=1e-6)
    np.testing.assert_allclose(dweights[used], want_dweights[used], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(dy[~used], 0)
    np.testing.assert_array_equal(dweights[~used], 0)


def test_nan_on_padding_rows_does_not_reach_parameter_gradients():
    """Experts that normalize rows give NaN on zero padding rows; a learned scale on the weights must not see it.

    The loss is linear in the scale, so d loss / d scale = loss at scale 1.
    """
    num_ranks = 2
    rng = np.random.default_rng(15)
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "distinct", num_ranks, T, K, E)

    def body(x, idx, topk_weights, scale):
        d = _dispatch(x, idx, topk_weights, "ragged")
        y = d.x / jnp.linalg.norm(d.x, axis=-1, keepdims=True)
        return jax_ep.combine(y, d.handle, weights=d.weights * scale)

    call = ep_jit(body, num_ranks)
    scale = np.ones((num_ranks, 1), np.float32)  # the same scale on every rank
    value, grad = jax.value_and_grad(lambda s: jnp.sum(call(x, idx, topk_weights, s)))(scale)
    assert np.isfinite(value)
    np.testing.assert_allclose(np.sum(grad), value, rtol=1e-5)


def _count_primitives(closed_jaxpr) -> Counter:
    counts = Counter()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            counts[eqn.primitive.name] += 1
            for value in eqn.params.values():
                for sub in value if isinstance(value, (tuple, list)) else [value]:
                    if hasattr(sub, "eqns"):
                        visit(sub)
                    elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                        visit(sub.jaxpr)

    visit(closed_jaxpr.jaxpr)
    return counts


@pytest.mark.parametrize("exchange", ["dense", "ragged"])
def test_backward_does_not_recompute_routing(exchange):
    """The backward passes reuse the handle: grad adds no routing work to the forward pass.

    The backward pass of dispatch is one more combine (which sorts each token's K rows into row order) and
    that of combine a redispatch; so grad has exactly one combine's worth more sorts than forward, and no
    more count exchanges, prefix sums or axis indices. (The xla backend's ragged exchange computes each trip's
    offsets, a prefix sum of R counts and this rank's index, so there the redispatch adds those.)
    """
    num_ranks = 4
    body = _moe("ragged", xla_exchange=exchange)
    f = jax.shard_map(lambda *a: body(*a)[0], in_specs=P(AXIS), out_specs=P(AXIS))
    only_dispatch = jax.shard_map(
        lambda x, i, w, W: _dispatch(x, i, w, "ragged", xla_exchange=exchange).x, in_specs=P(AXIS), out_specs=P(AXIS)
    )
    args = (
        jnp.ones((num_ranks * T, H)),
        jnp.zeros((num_ranks * T, K), jnp.int32),
        jnp.ones((num_ranks * T, K)),
        jnp.ones((E, H, H)),
    )
    with jax.set_mesh(cpu_mesh((num_ranks,), (AXIS,))):
        forward = _count_primitives(jax.make_jaxpr(f)(*args))
        routing_ops = _count_primitives(jax.make_jaxpr(only_dispatch)(*args))
        grad = jax.grad(lambda x, i, w, W: jnp.sum(f(x, i, w, W)), argnums=(0, 2, 3))
        backward = _count_primitives(jax.make_jaxpr(grad)(*args))
    assert forward["all_to_all"] > 0 and backward["all_to_all"] > forward["all_to_all"]
    assert routing_ops["sort"] > 0 and routing_ops["cumsum"] > 0
    for name in ("sort", "all_gather") + (("cumsum", "axis_index") if exchange == "dense" else ()):
        one_combine = forward[name] - routing_ops[name]
        assert backward[name] == forward[name] + one_combine, name


# ---------------------------------------------------------------------------------------------------------------------
# A dense single-device MoE.


def _dense_check(num_ranks, layout, capacity, kind, wrap=lambda f: f):
    rng = np.random.default_rng([5, num_ranks, len(layout), capacity or 0])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, kind, num_ranks, T, K, E)
    w = _weights(rng)
    c = rng.standard_normal((num_ranks, T, H)).astype(np.float32)
    ref = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout, capacity=capacity)
    dense_idx = _masked(idx, ref).reshape(-1, K)
    local = E // num_ranks

    call = ep_jit(wrap(_moe(layout, capacity)), num_ranks)

    def ep_loss(x, topk_weights, w):
        out, dropped = call(x, idx, topk_weights, w.reshape(num_ranks, local, H, H))
        return jnp.sum(out * c), (out, dropped)

    def dense_loss(x, topk_weights, w):
        out = dense_moe(x.reshape(-1, H), dense_idx, topk_weights.reshape(-1, K), w)
        return jnp.sum(out.reshape(c.shape) * c), out

    grads, (out, dropped) = jax.grad(ep_loss, argnums=(0, 1, 2), has_aux=True)(x, topk_weights, w)
    dense_grads, dense_out = jax.grad(dense_loss, argnums=(0, 1, 2), has_aux=True)(x, topk_weights, w)

    np.testing.assert_array_equal(dropped, ref.num_dropped)
    np.testing.assert_allclose(out.reshape(-1, H), dense_out, **TOL)
    np.testing.assert_allclose(
        out.reshape(-1, H), reference.dense_moe(x.reshape(-1, H), dense_idx, topk_weights.reshape(-1, K), w), **TOL
    )
    for name, got, want in zip(("x", "topk_weights", "W"), grads, dense_grads, strict=True):
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, err_msg=name, **TOL)
    dw = np.asarray(grads[1])
    for slot in ref.dropped:
        assert dw[slot] == 0, f"dropped slot {slot} has a topk_weights gradient"
    assert np.all(dw[(idx < 0) | (idx >= E)] == 0)
    return ref


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize("num_ranks", [1, slow(2), slow(4), slow(8)])
def test_moe_matches_dense(num_ranks, layout):
    """Forward and d/d(x, topk_weights, W) equal a dense MoE; distinct ids, nothing dropped."""
    ref = _dense_check(num_ranks, layout, None, "distinct")
    assert not ref.dropped


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_moe_with_dropped_slots_matches_dense(layout):
    """With drops, repeats and invalid ids the MoE equals a dense MoE without the dropped slots."""
    ref = _dense_check(4, layout, 5, "invalid")
    assert ref.dropped


@pytest.mark.parametrize(("num_ranks", "layout"), [slow(4, "ragged"), (2, "expert")])
def test_moe_under_checkpoint(num_ranks, layout):
    """The same results when each rank's MoE is rematerialized (jax.checkpoint)."""
    _dense_check(num_ranks, layout, None, "distinct", wrap=jax.checkpoint)


def _chain(h, w_layers):
    for w in w_layers:
        h = jnp.tanh(h @ w)
    return h


def test_moe_layers_in_scan():
    """Two MoE layers in lax.scan (dispatch and combine in the scan body) equal two dense layers."""
    num_ranks, layers, layout = 4, 2, "ragged"
    local = E // num_ranks
    rng = np.random.default_rng(6)
    x, _ = random_inputs(rng, num_ranks, T, H, K)
    idx = np.stack([routing(rng, "distinct", num_ranks, T, K, E) for _ in range(layers)], axis=1)  # [R, layers, T, K]
    topk_weights = (rng.random(idx.shape) + 0.25).astype(np.float32)
    w = _weights(rng, layers)  # [layers, E, H, H]
    c = rng.standard_normal((num_ranks, T, H)).astype(np.float32)
    moe = _moe(layout)

    def body(x, idx, topk_weights, w_local):
        def layer(h, inputs):
            return h + moe(h, *inputs)[0], None

        return jax.lax.scan(layer, x, (idx, topk_weights, w_local))[0]

    call = ep_jit(body, num_ranks)

    def ep_loss(x, tw, w):
        w_local = w.reshape(layers, num_ranks, local, H, H).transpose(1, 0, 2, 3, 4)
        return jnp.sum(call(x, idx, tw, w_local) * c)

    def dense_loss(x, tw, w):
        h = x.reshape(-1, H)
        for layer in range(layers):
            h = h + dense_moe(h, idx[:, layer].reshape(-1, K), tw[:, layer].reshape(-1, K), w[layer])
        return jnp.sum(h.reshape(c.shape) * c)

    value, grads = jax.value_and_grad(ep_loss, argnums=(0, 1, 2))(x, topk_weights, w)
    dense_value, dense_grads = jax.value_and_grad(dense_loss, argnums=(0, 1, 2))(x, topk_weights, w)
    np.testing.assert_allclose(value, dense_value, rtol=1e-5)
    for name, got, want in zip(("x", "topk_weights", "W"), grads, dense_grads, strict=True):
        np.testing.assert_allclose(got, want, err_msg=name, **TOL)


@pytest.mark.slow  # dispatch and combine in lax.scan are in the default tier: test_moe_layers_in_scan
def test_handle_and_weights_carried_through_scan():
    """The handle and d.weights ride in a scan carry through two expert layers; combine in and after the scan."""
    num_ranks, layers, layout = 4, 2, "expert"
    local = E // num_ranks
    rng = np.random.default_rng(8)
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "distinct", num_ranks, T, K, E)
    w = _weights(rng, layers)
    c = rng.standard_normal((num_ranks, layers + 1, T, H)).astype(np.float32)

    def body(x, idx, topk_weights, w_local):
        d = _dispatch(x, idx, topk_weights, layout)

        def layer(carry, w_l):
            h, handle, weights = carry
            h = jnp.tanh(jnp.einsum("lch,lhg->lcg", h, w_l))
            return (h, handle, weights), jax_ep.combine(h, handle, weights=weights)

        (h, handle, weights), per_layer = jax.lax.scan(layer, (d.x, d.handle, d.weights), w_local)
        assert isinstance(handle, jax_ep.Handle)
        return jnp.concatenate([per_layer, jax_ep.combine(2 * h, handle, weights=weights)[None]])

    call = ep_jit(body, num_ranks)

    def ep_loss(x, tw, w):
        w_local = w.reshape(layers, num_ranks, local, H, H).transpose(1, 0, 2, 3, 4)
        return jnp.sum(call(x, idx, tw, w_local) * c)

    def dense_loss(x, tw, w):
        gate = _gate(idx.reshape(-1, K), tw.reshape(-1, K))  # [N, E]
        h = jnp.broadcast_to(x.reshape(-1, H), (E, num_ranks * T, H))
        outs = []
        for layer in range(layers):
            h = jnp.tanh(jnp.einsum("enh,ehg->eng", h, w[layer]))
            outs.append(jnp.einsum("ne,eng->ng", gate, h))
        outs.append(2 * outs[-1])
        return sum(jnp.sum(o.reshape(num_ranks, T, H) * c[:, i]) for i, o in enumerate(outs))

    value, grads = jax.value_and_grad(ep_loss, argnums=(0, 1, 2))(x, topk_weights, w)
    dense_value, dense_grads = jax.value_and_grad(dense_loss, argnums=(0, 1, 2))(x, topk_weights, w)
    np.testing.assert_allclose(value, dense_value, rtol=1e-5)
    for name, got, want in zip(("x", "topk_weights", "W"), grads, dense_grads, strict=True):
        np.testing.assert_allclose(got, want, err_msg=name, **TOL)
