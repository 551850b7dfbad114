"""SPEC v2: rows of the ragged layout past ``sum(group_sizes)`` are unspecified, and nothing reads them.

Each test fills that tail of ``d.x``, and of ``dy`` (combine's cotangent of ``y``), with NaN inside the per-rank
body (what a backend may leave there) and shows that combine, every gradient, ``jax.lax.ragged_dot`` and
``jax_ep.nn.MoE`` give the same bits as without NaN, all finite.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from tests.conftest import cpu_mesh
from tests.helpers import AXIS, assert_bits_equal, ep_jit, random_inputs, routing, slow, to_numpy

T, H, K, E = 6, 4, 3, 8


def _rows_past(rows: jax.Array, used: jax.Array) -> jax.Array:
    """``rows [N, ...]`` with every row at or past ``used`` set to NaN."""
    past = (jnp.arange(rows.shape[0]) >= used).reshape(-1, *[1] * (rows.ndim - 1))
    return jnp.where(past, jnp.nan, rows).astype(rows.dtype)


def nan_tail(d: jax_ep.Dispatched) -> jax_ep.Dispatched:
    """``d`` with every ragged row past ``sum(group_sizes)`` of ``d.x`` set to NaN (one rank, inside shard_map)."""
    return dataclasses.replace(d, x=_rows_past(d.x, d.group_sizes.sum()))


@jax.custom_vjp
def nan_cotangent_tail(y: jax.Array, used: jax.Array) -> jax.Array:
    """``y`` as is; its cotangent gets NaN on every row at or past ``used``, as a backend may leave combine's
    ``dy`` past the data (the cuda backend does not write it)."""
    return y


nan_cotangent_tail.defvjp(
    lambda y, used: (y, used),
    lambda used, ct: (_rows_past(ct, used), np.zeros((), jax.dtypes.float0)),
)


def _body(poison: bool, capacity, alignment):
    """One rank: dispatch (tail NaN if ``poison``), ragged_dot experts, combine; outputs and pullbacks of each op."""

    def body(x, idx, topk_weights, w_local, ct_y, g):
        def forward(x, topk_weights, w_local):
            d = jax_ep.dispatch(
                x,
                idx,
                topk_weights,
                num_experts=E,
                axis_name=AXIS,
                capacity=capacity,
                expert_alignment=alignment,
            )
            if poison:
                d = nan_tail(d)
            y, y_sin = jax.lax.ragged_dot(d.x, w_local, d.group_sizes), jnp.sin(d.x)  # y_sin: a NaN tail of its own
            if poison:  # and NaN past the data in their cotangents, combine's dy
                used = d.group_sizes.sum()
                y, y_sin = nan_cotangent_tail(y, used), nan_cotangent_tail(y_sin, used)
            outs = (
                jax_ep.combine(y, d.handle, weights=d.weights),
                jax_ep.combine(y, d.handle, weights=d.weights, partial_dtype=jnp.float32),
                jax_ep.combine(y_sin, d.handle),
            )
            return outs, d

        outs, d = forward(x, topk_weights, w_local)

        # Gradients of the whole MoE w.r.t. x, topk_weights and the expert weights (dispatch, ragged_dot, combine).
        def loss(x, topk_weights, w_local):
            o = forward(x, topk_weights, w_local)[0]
            return sum(jnp.sum(jnp.tanh(v) * g) for v in o)

        moe_grads = jax.grad(loss, argnums=(0, 1, 2))(x, topk_weights, w_local)

        # ragged_dot alone: forward and both gradients, with a finite cotangent on every row.
        y, rd_pullback = jax.vjp(lambda a, b: jax.lax.ragged_dot(a, b, d.group_sizes), d.x, w_local)
        d_lhs, d_rhs = rd_pullback(ct_y)

        # combine alone, with the dispatched (NaN-tailed) rows as y: d/dy and d/dweights.
        _, c_pullback = jax.vjp(lambda y, w: jax_ep.combine(y, d.handle, weights=w), d.x, d.weights)
        dy, dweights = c_pullback(g)
        used = d.group_sizes.sum()
        return {
            "outs": outs,
            "moe_grads": moe_grads,
            "ragged_dot": y,
            "ragged_dot_dlhs": d_lhs,
            "ragged_dot_drhs": d_rhs,
            "combine_dy": jnp.where(jnp.arange(d.x.shape[0])[:, None] < used, dy, 0),  # dy's tail is unspecified
            "combine_dweights": dweights,
            "tail_rows": d.x.shape[0] - used,
            "x_has_nan": jnp.isnan(d.x).any(),
        }

    return body


@pytest.mark.parametrize(("capacity", "alignment"), [slow(None, 1), slow(None, 4), (20, 3)])
def test_nan_in_the_ragged_tail_reaches_nothing(capacity, alignment):
    """combine (both partial dtypes), ragged_dot and every gradient give the same bits with a NaN tail."""
    num_ranks = 4
    rng = np.random.default_rng([31, alignment])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)
    w_local = (rng.standard_normal((num_ranks, E // num_ranks, H, H)) / 2).astype(np.float32)
    rows = capacity or jax_ep.default_capacity(
        num_ranks=num_ranks, num_tokens=T, topk=K, num_experts=E, expert_alignment=alignment
    )
    ct_y = rng.standard_normal((num_ranks, rows, H)).astype(np.float32)
    g = rng.standard_normal((num_ranks, T, H)).astype(np.float32)
    args = (x, idx, topk_weights, w_local, ct_y, g)

    clean = to_numpy(ep_jit(_body(False, capacity, alignment), num_ranks)(*args))
    poisoned = to_numpy(ep_jit(_body(True, capacity, alignment), num_ranks)(*args))

    assert np.all(clean["tail_rows"] > 0), "every rank must have a tail for the test to mean anything"
    assert not clean.pop("x_has_nan").any() and poisoned.pop("x_has_nan").all()
    _assert_same_finite(poisoned, clean)


@pytest.mark.parametrize(("capacity", "alignment"), [(None, 1), (None, 4), (20, 3)])
def test_the_handle_marks_the_rows_past_the_data(capacity, alignment):
    """Handle.row_slot: a slot on the rows that hold one, -1 on the alignment padding inside the data, -2 on every
    row past sum(group_sizes), so that combine's backward pass can leave dy there unwritten."""
    num_ranks = 4
    rng = np.random.default_rng([37, alignment])
    x, topk_weights = random_inputs(rng, num_ranks, T, H, K)
    idx = routing(rng, "invalid", num_ranks, T, K, E)

    def body(x, idx, topk_weights):
        kw = dict(num_experts=E, axis_name=AXIS, capacity=capacity, expert_alignment=alignment)
        d = jax_ep.dispatch(x, idx, topk_weights, **kw)
        return d.handle.row_slot, d.group_sizes

    row_slot, sizes = to_numpy(ep_jit(body, num_ranks)(x, idx, topk_weights))
    past = np.arange(row_slot.shape[1])[None, :] >= sizes.sum(axis=1)[:, None]
    assert past.any() and (~past).any()
    np.testing.assert_array_equal(row_slot == -2, past)
    assert np.all(row_slot[~past] >= -1)
    if alignment > 1:
        assert np.any(row_slot[~past] == -1)  # padding inside the data


def _assert_same_finite(got, want):
    """Every leaf of ``got`` is finite (floats) and has the bits of the same leaf of ``want``."""
    want_leaves = jax.tree_util.tree_leaves(want)
    got_leaves = jax.tree_util.tree_leaves_with_path(got)
    assert len(got_leaves) == len(want_leaves)
    for (path, got_leaf), want_leaf in zip(got_leaves, want_leaves, strict=True):
        name = jax.tree_util.keystr(path)
        got_leaf, want_leaf = np.asarray(got_leaf), np.asarray(want_leaf)
        if np.issubdtype(got_leaf.dtype, np.floating):
            assert np.all(np.isfinite(got_leaf)), f"{name} is not finite"
        assert_bits_equal(got_leaf, want_leaf, err_msg=name)


def test_nan_in_the_ragged_tail_does_not_reach_the_moe_layer(monkeypatch):
    """jax_ep.nn.MoE (ragged layout, alignment 4), with NaN past the data in d.x and in combine's dy: output, aux
    loss and every gradient are the same bits."""
    nnx = pytest.importorskip("flax.nnx")
    import jax_ep.nn

    real_dispatch, real_combine = jax_ep.nn.dispatch, jax_ep.nn.combine  # the layer without overlap
    poisoned_calls = []

    def dispatch_with_nan_tail(*args, **kwargs):
        d = nan_tail(real_dispatch(*args, **kwargs))
        jax.debug.callback(lambda n: poisoned_calls.append(int(n)), jnp.isnan(d.x).sum())
        return d

    def combine_with_nan_dy_tail(y, handle, **kwargs):
        used = jnp.sum(handle.row_slot != -2)  # the rows of the data (Handle.row_slot)
        return real_combine(nan_cotangent_tail(y, used), handle, **kwargs)

    mesh = cpu_mesh((8,), ("ep",))
    model = jax_ep.nn.MoE(16, 24, num_experts=8, topk=2, mesh=mesh, expert_alignment=4, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    x = jax.random.normal(jax.random.key(1), (32, 16))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)

    def loss(state, x):
        result = nnx.merge(graphdef, state)(x)
        return jnp.sum(result.out * cotangent) + result.aux_loss, result

    def run():
        with jax.set_mesh(mesh):
            return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)

    clean = run()
    monkeypatch.setattr(jax_ep.nn, "dispatch", dispatch_with_nan_tail)
    monkeypatch.setattr(jax_ep.nn, "combine", combine_with_nan_dy_tail)
    poisoned = run()
    jax.effects_barrier()
    assert poisoned_calls and sum(poisoned_calls) > 0, "the tail was never filled with NaN"
    _assert_same_finite(poisoned, clean)
