"""The xla backend's two exchanges: "ragged" (each (token, rank) pair once, ``lax.ragged_all_to_all``) gives the
"dense" exchange's results bit for bit, for every op and gradient.

XLA:CPU does not implement ``ragged_all_to_all``, so these tests run the ragged exchange's code with
``helpers.emulated_ragged_all_to_all`` (the primitive's documented semantics, from ``lax.all_to_all``) in its
place; ``test_the_ragged_exchange_sends_each_pair_once`` traces the real primitive without running it.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.ep import xla as xla_backend
from tests import reference
from tests.conftest import cpu_mesh
from tests.gpu import require_gpu
from tests.helpers import (
    AXIS,
    assert_bits_equal,
    assert_dispatch_equal,
    collective_operands,
    emulated_ragged_all_to_all,
    ep_jit,
    random_inputs,
    routing,
    slow,
    to_numpy,
)

R, T, H, K, E = 8, 6, 4, 3, 16


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setattr(xla_backend, "ragged_all_to_all", emulated_ragged_all_to_all)


def test_emulation_follows_the_docstring_example():
    """The example in ``jax.lax.ragged_all_to_all``'s docstring, on 2 ranks."""
    operand = np.array([[1, 2, 2], [3, 4, 0]], np.float32)
    input_offsets = np.array([[0, 1], [0, 1]], np.int32)
    send_sizes = np.array([[1, 2], [1, 1]], np.int32)
    output_offsets = np.array([[0, 0], [1, 2]], np.int32)
    recv_sizes = np.array([[1, 1], [2, 1]], np.int32)

    def body(operand, input_offsets, send_sizes, output_offsets, recv_sizes):
        output = jnp.zeros(4, operand.dtype)
        return emulated_ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=AXIS
        )

    got = ep_jit(body, 2)(operand, input_offsets, send_sizes, output_offsets, recv_sizes)
    np.testing.assert_array_equal(np.asarray(got), [[1, 3, 0, 0], [2, 2, 4, 0]])


def _everything(exchange, layout, capacity, policy, **kw):
    """Per rank: dispatch (and its gradients through a loss on d.x and d.weights), combine with and without
    weights and in float32 partials, and combine's gradients, with the xla backend's ``exchange``."""

    def body(x, idx, topk_weights, g):
        def forward(x, topk_weights):
            d = jax_ep.dispatch(
                x,
                idx,
                topk_weights,
                num_experts=E,
                axis_name=AXIS,
                layout=layout,
                capacity=capacity,
                expert_alignment=2,
                drop_policy=policy,
                backend="xla",
                xla_exchange=exchange,
                **kw,
            )
            y = jnp.tanh(d.x.astype(jnp.float32)).astype(d.x.dtype)
            outs = (
                jax_ep.combine(y, d.handle, weights=d.weights),
                jax_ep.combine(y, d.handle, weights=d.weights, partial_dtype=jnp.float32),
                jax_ep.combine(d.x, d.handle),
            )
            return d, outs

        d, outs = forward(x, topk_weights)

        def loss(x, w):
            return sum(jnp.sum(o.astype(jnp.float32) * g) for o in forward(x, w)[1])

        return d, outs, jax.grad(loss, argnums=(0, 1))(x, topk_weights)

    return body


CASES = [
    slow("ragged", None, "balanced", jnp.float32),
    ("ragged", 20, "balanced", jnp.bfloat16),
    slow("ragged", 20, "expert", jnp.float32),
    slow("expert", 3, "balanced", jnp.bfloat16),
]


@pytest.mark.parametrize(("layout", "capacity", "policy", "dtype"), CASES)
def test_ragged_exchange_equals_dense(emulated, layout, capacity, policy, dtype):
    """Every output and gradient of both exchanges, bit for bit, on 8 ranks; dispatch also against the NumPy
    reference (drops, invalid ids, repeated experts)."""
    rng = np.random.default_rng([len(layout), capacity or 0, len(policy)])
    x, topk_weights = random_inputs(rng, R, T, H, K, dtype)
    idx = routing(rng, "invalid", R, T, K, E)
    g = rng.standard_normal((R, T, H)).astype(np.float32)
    results = {
        exchange: to_numpy(ep_jit(_everything(exchange, layout, capacity, policy), R)(x, idx, topk_weights, g))
        for exchange in ("dense", "ragged")
    }
    (d_dense, *dense), (d_ragged, *ragged) = results["dense"], results["ragged"]
    ref = reference.dispatch(
        x, idx, topk_weights, num_experts=E, layout=layout, capacity=capacity, expert_alignment=2, drop_policy=policy
    )
    assert_dispatch_equal(d_dense, ref)
    assert_dispatch_equal(d_ragged, ref)
    for name in ("token_dest_pos", "send_counts", "slot_dest", "recv_rows", "recv_counts", "row_slot"):
        assert_bits_equal(getattr(d_ragged.handle, name), getattr(d_dense.handle, name), err_msg=name)
    for i, (got, want) in enumerate(zip(jax.tree.leaves(ragged), jax.tree.leaves(dense), strict=True)):
        assert_bits_equal(got, want, err_msg=f"combine output or gradient {i}")
    if capacity is not None:
        assert d_dense.num_dropped.sum() > 0


@require_gpu("needs an NVIDIA GPU, whose XLA implements ragged_all_to_all")
@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_the_real_ragged_all_to_all_on_one_gpu(layout):
    """On a GPU the ragged exchange runs ``lax.ragged_all_to_all`` itself (no emulation); in an EP group of one
    GPU it gives the dense exchange's outputs and gradients, bit for bit."""
    rng = np.random.default_rng(len(layout))
    x, topk_weights = random_inputs(rng, 1, 64, 128, K, jnp.bfloat16)
    idx = routing(rng, "invalid", 1, 64, K, E)
    g = rng.standard_normal((1, 64, 128)).astype(np.float32)
    ragged, dense = (
        to_numpy(ep_jit(_everything(e, layout, 40, "balanced"), 1, platform="gpu")(x, idx, topk_weights, g))
        for e in ("ragged", "dense")
    )
    assert_dispatch_equal(ragged[0], dense[0])
    for i, (got, want) in enumerate(zip(jax.tree.leaves(ragged[1:]), jax.tree.leaves(dense[1:]), strict=True)):
        assert_bits_equal(got, want, err_msg=f"combine output or gradient {i}")


@pytest.mark.parametrize("kind", [slow("separate"), "split", slow("fp8")])
def test_ragged_exchange_other_paths(emulated, kind):
    """transfer="separate", the split ops and FP8 rows on the ragged exchange: the dense exchange's outputs and
    gradients, bit for bit."""
    rng = np.random.default_rng([5, len(kind)])
    hidden = 128  # FP8 rows need a multiple of 128
    x, topk_weights = random_inputs(rng, R, T, hidden, K, jnp.bfloat16)
    idx = routing(rng, "random", R, T, K, E)
    g = rng.standard_normal((R, T, hidden)).astype(jnp.bfloat16)

    def body(exchange):
        kw = dict(num_experts=E, axis_name=AXIS, capacity=24, backend="xla", xla_exchange=exchange)

        def layer(x, i, w):
            if kind == "split":
                d = jax_ep.dispatch_finish(jax_ep.dispatch_start(x, i, w, **kw))
                return jax_ep.combine_finish(jax_ep.combine_start(d.x * 2, d.handle, weights=d.weights))
            extra = {"transfer": "separate"} if kind == "separate" else {"wire_dtype": jnp.float8_e4m3fn}
            d = jax_ep.dispatch(x, i, w, **kw, **extra)
            return jax_ep.combine(d.x * 2, d.handle, weights=d.weights)

        def run(x, i, w, g):
            out, vjp = jax.vjp(lambda x, w: layer(x, i, w), x, w)
            return out, vjp(g)

        return run

    ragged, dense = (to_numpy(ep_jit(body(e), R)(x, idx, topk_weights, g)) for e in ("ragged", "dense"))
    for i, (got, want) in enumerate(zip(jax.tree.leaves(ragged), jax.tree.leaves(dense), strict=True)):
        assert_bits_equal(got, want, err_msg=f"output or gradient {i}")
    assert np.any(np.asarray(dense[0], np.float32))


def _collectives(exchange):
    """The (primitive, operand shape) of every all-to-all in a traced dispatch, combine and their gradients."""

    def body(x, idx, w):
        def loss(x, w):
            kw = dict(num_experts=E, axis_name=AXIS, backend="xla", xla_exchange=exchange)
            d = jax_ep.dispatch(x, idx, w, **kw)
            return jnp.sum(jax_ep.combine(d.x, d.handle, weights=d.weights))

        return jax.grad(loss, argnums=(0, 1))(x, w)

    args = (
        jax.ShapeDtypeStruct((R * T, H), jnp.float32),
        jax.ShapeDtypeStruct((R * T, K), jnp.int32),
        jax.ShapeDtypeStruct((R * T, K), jnp.float32),
    )
    with jax.set_mesh(cpu_mesh((R,), (AXIS,))):
        closed = jax.make_jaxpr(jax.shard_map(body, in_specs=P(AXIS), out_specs=P(AXIS)))(*args)
    return [(name, shape) for name, _, shape in collective_operands(closed.jaxpr)]


def test_the_ragged_exchange_sends_each_pair_once():
    """Traced with the real ``lax.ragged_all_to_all`` (not run: XLA:CPU lacks it): every trip of token rows is a
    ragged all-to-all whose send buffer has ``T * min(R, K)`` rows, one per (token, rank) pair at most; what
    remains dense is counts (``[R, E]`` and ``[R]``). The dense exchange sends ``[R, T, ...]`` buffers instead."""
    ragged = _collectives("ragged")
    pairs = T * min(R, K)
    # dispatch: routing and rows; its backward pass (a combine): partial sums and the weights' cotangents;
    # combine: partial sums; its backward pass (a dispatch of the cotangent): rows
    sends = sorted(shape for name, shape in ragged if name == "ragged_all_to_all" and shape[0] == pairs)
    assert sends == sorted([(pairs, 2 * K), (pairs, H), (pairs, H)]), ragged
    returns = sorted(shape for name, shape in ragged if name == "ragged_all_to_all" and shape[0] == R * T)
    assert returns == sorted([(R * T, H), (R * T, K), (R * T, H)]), ragged
    dense_sizes = {shape for name, shape in ragged if name == "all_to_all"}
    assert dense_sizes <= {(R, E), (R,)}, ragged
    dense = _collectives("dense")
    assert {name for name, _ in dense} == {"all_to_all"}
    assert {(R, T, H), (R, T, 2 * K)} <= {shape for _, shape in dense}
