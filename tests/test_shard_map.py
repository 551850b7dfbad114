"""shard_map against a single device, meshes with a second axis, and EP axis sizes 1 to 8.

These tests use the form users write: global arrays sharded by ``in_specs`` and a mesh set with
``jax.set_mesh``.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from tests import reference
from tests.conftest import cpu_mesh
from tests.helpers import (
    assert_bits_equal,
    assert_dispatch_equal,
    assert_sum_close,
    random_inputs,
    routing,
    slow,
    to_numpy,
)

T, H, K, E = 6, 4, 3, 8


def _moe_body(layout, axis="ep"):
    """Per rank: dispatch, local expert matmul, combine; every output gets a leading axis for stacking."""

    def body(x, idx, topk_weights, w_local):
        d = jax_ep.dispatch(x, idx, topk_weights, num_experts=E, axis_name=axis, layout=layout)
        if layout == "ragged":
            y = jax.lax.ragged_dot(d.x, w_local, d.group_sizes)
        else:
            y = jnp.einsum("lch,lhg->lcg", d.x, w_local)
        out = jax_ep.combine(y, d.handle, weights=d.weights)
        fields = (d.x, d.weights, d.group_sizes, d.num_dropped, d.num_invalid, d.expert_load, d.row_expert)
        return jax.tree.map(lambda v: v[None], (fields, out))

    return body


def _run(mesh, spec, layout, x, idx, topk_weights, w, axis="ep"):
    """The MoE over ``mesh``: tokens sharded by ``spec``, experts by ``axis``; per-device results stacked."""
    in_specs = (spec, spec, spec, P(axis))
    flat = (x.reshape(-1, H), idx.reshape(-1, K), topk_weights.reshape(-1, K), w)
    with jax.set_mesh(mesh):
        fn = jax.jit(jax.shard_map(_moe_body(layout, axis), in_specs=in_specs, out_specs=spec))
        (fields, out) = to_numpy(fn(*flat))
    *fields, row_expert = fields
    return jax_ep.Dispatched(*fields, handle=None, row_expert=row_expert), out


def _inputs(seed, kind, num_tokens, num_groups=1):
    rng = np.random.default_rng(seed)
    x, topk_weights = random_inputs(rng, num_groups, num_tokens, H, K)
    idx = routing(rng, kind, num_groups, num_tokens, K, E)
    w = (rng.standard_normal((E, H, H)) / 2).astype(np.float32)
    return x, idx, topk_weights, w


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize("num_ranks", [slow(1), slow(2), 4, slow(8)])
def test_ep_equals_single_device(num_ranks, layout):
    """R ranks of T tokens give what one device gives for all R*T tokens, expert by expert."""
    # Distinct ids: nothing is dropped at the default capacities of either side.
    x, idx, topk_weights, w = _inputs([num_ranks, len(layout)], "distinct", num_ranks * T)  # one group of R*T
    single, single_out = _run(cpu_mesh((1,), ("ep",)), P("ep"), layout, x, idx, topk_weights, w)
    ref_single = reference.dispatch(x, idx, topk_weights, num_experts=E, layout=layout)
    assert_dispatch_equal(single, ref_single)

    split = lambda a: a.reshape(num_ranks, T, *a.shape[2:])  # noqa: E731
    ep, ep_out = _run(cpu_mesh((num_ranks,), ("ep",)), P("ep"), layout, split(x), split(idx), split(topk_weights), w)
    ref = reference.dispatch(split(x), split(idx), split(topk_weights), num_experts=E, layout=layout)
    assert_dispatch_equal(ep, ref)

    # Per expert, the same rows in the same order (source rank then token is the global token order).
    local = E // num_ranks
    np.testing.assert_array_equal(ep.group_sizes.reshape(E), single.group_sizes[0])
    np.testing.assert_array_equal(ep.num_invalid.sum(), single.num_invalid[0])
    np.testing.assert_array_equal(ep.num_dropped, 0)
    for e in range(E):
        rank, j = divmod(e, local)
        if layout == "expert":  # capacity R*T on both sides
            assert_bits_equal(ep.x[rank, j], single.x[0, e])
            assert_bits_equal(ep.weights[rank, j], single.weights[0, e])
        else:  # alignment 1: segments are exactly group_sizes long
            n = single.group_sizes[0, e]
            start_ep, start_single = ep.group_sizes[rank, :j].sum(), single.group_sizes[0, :e].sum()
            assert_bits_equal(ep.x[rank, start_ep : start_ep + n], single.x[0, start_single : start_single + n])
            assert_bits_equal(
                ep.weights[rank, start_ep : start_ep + n], single.weights[0, start_single : start_single + n]
            )

    want = reference.dense_moe(x.reshape(-1, H), idx.reshape(-1, K), topk_weights.reshape(-1, K), w)
    magnitude = reference.dense_moe(
        np.abs(x.reshape(-1, H)), idx.reshape(-1, K), topk_weights.reshape(-1, K), np.abs(w)
    )
    assert_sum_close(single_out.reshape(-1, H), want, magnitude, 1e-5, err_msg="single device")
    assert_sum_close(ep_out.reshape(-1, H), want, magnitude, 1e-5, err_msg=f"{num_ranks} ranks")


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize(
    ("shape", "names"), [((2, 4), ("dp", "ep")), slow((4, 2), ("ep", "dp"))], ids=["dp_ep", "ep_dp"]
)
def test_two_axis_mesh(shape, names, layout):
    """Tokens sharded over ("dp", "ep"), experts over "ep": each dp group is its own EP group of 4 ranks."""
    num_ranks, num_groups = shape[names.index("ep")], shape[names.index("dp")]
    x, idx, topk_weights, w = _inputs([9, shape[0], len(layout)], "invalid", T, num_groups * num_ranks)
    d, out = _run(cpu_mesh(shape, names), P(("dp", "ep")), layout, x, idx, topk_weights, w)
    # Device block b of P(("dp", "ep")) is dp group b // R, EP rank b % R.
    for group in range(num_groups):
        ranks = slice(group * num_ranks, (group + 1) * num_ranks)
        ref = reference.dispatch(x[ranks], idx[ranks], topk_weights[ranks], num_experts=E, layout=layout)
        assert_dispatch_equal(jax.tree.map(lambda v: v[ranks], d), ref)  # noqa: B023
        tokens = (x[ranks].reshape(-1, H), idx[ranks].reshape(-1, K), topk_weights[ranks].reshape(-1, K))
        want = reference.dense_moe(*tokens, w)
        magnitude = reference.dense_moe(np.abs(tokens[0]), tokens[1], tokens[2], np.abs(w))
        assert_sum_close(out[ranks].reshape(-1, H), want, magnitude, 1e-5, err_msg=f"dp group {group}")
