"""jax.checkpoint with the names jax_ep.dispatch gives its outputs: gradients equal those without checkpointing bit
for bit, and the compiled step recomputes only what the policy leaves unsaved (all-to-alls on backend xla; jax_ep
custom calls on backend cuda, on one GPU)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import jax_ep
import jax_ep.nn
from tests.conftest import cpu_mesh
from tests.gpu import gpu_devices, require_cuda
from tests.helpers import ep_jit, to_numpy

T, H, K, E = 16, 128, 2, 8  # per rank
POLICIES = {
    "nothing": jax.checkpoint_policies.nothing_saveable,
    "handle": jax.checkpoint_policies.save_only_these_names("jax_ep_handle"),
    "rows": jax.checkpoint_policies.save_only_these_names("jax_ep_handle", "jax_ep_rows"),
}


def _inputs(ranks: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ranks * T, H)).astype(np.float32)
    idx = np.stack([rng.permutation(E)[:K] for _ in range(ranks * T)]).astype(np.int32)
    w = (rng.random((ranks * T, K)) + 0.25).astype(np.float32)
    m = (rng.standard_normal((H, H)) / np.sqrt(H)).astype(np.float32)
    return jnp.asarray(x), jnp.asarray(idx), jnp.asarray(w), jnp.asarray(m)


def _step(mesh, backend: str, transfer: str, policy: str | None):
    """jit(grad) of a layer (dispatch, an expert matmul, combine) under jax.checkpoint with ``policy`` (None: no
    checkpoint), w.r.t. x, the routing weights and the expert weights; the loss is taken outside the layer, so
    the forward pass runs the layer as training does."""

    def layer(x, idx, w, m):
        d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend=backend, transfer=transfer)
        y = jnp.tanh(d.x @ m)
        return jax_ep.combine(y, d.handle, weights=d.weights)

    if policy is not None:
        layer = jax.checkpoint(layer, policy=POLICIES[policy])
    sharded = jax.shard_map(layer, mesh=mesh, in_specs=(P("ep"), P("ep"), P("ep"), P()), out_specs=P("ep"))
    return jax.jit(jax.grad(lambda *a: jnp.sum(sharded(*a) ** 2), argnums=(0, 2, 3)))


# What names an op in the program JAX hands XLA (StableHLO), and in the compiled HLO.
ALL_TO_ALL = ("stablehlo.all_to_all", "all-to-all(")
DISPATCH = ("@jax_ep_dispatch(", '"jax_ep_dispatch"')
COMBINE_BACKWARD = ("@jax_ep_combine_backward(", '"jax_ep_combine_backward"')


def _compiled(step, args, names: tuple[tuple[str, str], ...]):
    """The step compiled once, and how often each op occurs in the program JAX hands XLA and in the compiled one."""
    lowered = step.lower(*args)
    compiled = lowered.compile()
    texts = (lowered.as_text(), compiled.as_text())
    return compiled, tuple({name: text.count(name[i]) for name in names} for i, text in enumerate(texts))


def _check(mesh, backend: str, names: tuple[tuple[str, str], ...], expected: dict[tuple[str, str], dict]):
    """Each (transfer, policy) recomputes ``expected`` occurrences of each op in the program JAX builds, against
    the same transfer without jax.checkpoint; gradients equal a fused dispatch's without it, bit for bit. XLA
    may share recomputed exchanges with the forward pass, so in the compiled step a recompute that JAX emits
    must leave at least one, and one that it does not emit, none. Each step is compiled once, and run as
    compiled."""
    args = _inputs(mesh.devices.size)
    transfers = dict.fromkeys(transfer for transfer, _ in expected)
    unsaved = {transfer: _compiled(_step(mesh, backend, transfer, None), args, names) for transfer in transfers}
    want = [np.asarray(g) for g in unsaved["fused"][0](*args)]
    for (transfer, policy), extra in expected.items():
        base_lowered, base_compiled = unsaved[transfer][1]
        step, (lowered, compiled) = (
            unsaved[transfer] if policy is None else _compiled(_step(mesh, backend, transfer, policy), args, names)
        )
        for got, ref in zip(step(*args), want, strict=True):
            np.testing.assert_array_equal(np.asarray(got), ref, err_msg=f"{transfer}, {policy}")
        for name in names:
            what = f"transfer={transfer}, policy={policy}, {name[0]}"
            assert lowered[name] - base_lowered[name] == extra[name], f"{what}: {lowered} against {base_lowered}"
            more = compiled[name] - base_compiled[name]
            assert (more >= 1) if extra[name] else (more == 0), f"{what}: {compiled} against {base_compiled}"


def _exchanges_of_a_dispatch(mesh) -> int:
    x, idx, w, _ = _inputs(mesh.devices.size)
    f = jax.shard_map(
        lambda x, idx, w: jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", backend="xla").x,
        mesh=mesh,
        in_specs=P("ep"),
        out_specs=P("ep"),
    )
    return jax.jit(f).lower(x, idx, w).as_text().count(ALL_TO_ALL[0])


@pytest.mark.slow  # about 13 s on 2 cores; gradients under checkpoint are in the default tier (tests/test_grad.py)
def test_xla_recomputes_only_what_the_policy_leaves_unsaved():
    """On xla a dispatch is a routing (count and metadata exchanges) and a transfer (one all-to-all). With the
    handle saved and transfer="separate", the recompute is the transfer alone; with the rows saved too, nothing.
    A fused dispatch cannot recompute its rows apart from its routing."""
    mesh = cpu_mesh((2,), ("ep",))
    whole = _exchanges_of_a_dispatch(mesh)
    assert whole > 1
    a2a = ALL_TO_ALL
    _check(
        mesh,
        "xla",
        (a2a,),
        {
            ("separate", None): {a2a: 0},
            ("fused", "nothing"): {a2a: whole},
            ("fused", "handle"): {a2a: whole},
            ("fused", "rows"): {a2a: 0},
            ("separate", "nothing"): {a2a: whole},
            ("separate", "handle"): {a2a: 1},
            ("separate", "rows"): {a2a: 0},
        },
    )


@require_cuda()
def test_cuda_recomputes_only_what_the_policy_leaves_unsaved():
    """On cuda, transfer="separate" routes with a dispatch that moves no rows and moves the rows with the
    combine-backward kernel along the handle; the recompute with the handle saved runs that kernel alone."""
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpu_devices()[:1])
    jax_ep.initialize(mesh, "ep", num_tokens=T, hidden=H, topk=K, num_experts=E, dtype=jnp.float32)
    try:
        dispatch, transfer = DISPATCH, COMBINE_BACKWARD
        _check(
            mesh,
            "cuda",
            (dispatch, transfer),
            {
                ("separate", None): {dispatch: 0, transfer: 0},
                ("fused", "nothing"): {dispatch: 1, transfer: 0},
                ("fused", "handle"): {dispatch: 1, transfer: 0},
                ("fused", "rows"): {dispatch: 0, transfer: 0},
                ("separate", "nothing"): {dispatch: 1, transfer: 1},
                ("separate", "handle"): {dispatch: 0, transfer: 1},
                ("separate", "rows"): {dispatch: 0, transfer: 0},
            },
        )
    finally:
        jax_ep.finalize()


@pytest.mark.parametrize(
    "layout, wire_dtype",
    # The default tier takes each layout and each wire dtype once; the slow tier the other two pairs.
    [
        ("ragged", None),
        ("expert", jnp.float8_e4m3fn),
        pytest.param("ragged", jnp.float8_e4m3fn, marks=pytest.mark.slow),
        pytest.param("expert", None, marks=pytest.mark.slow),
    ],
    ids=["ragged-x_dtype", "expert-fp8", "ragged-fp8", "expert-x_dtype"],
)
def test_separate_transfer_equals_fused_dispatch(layout, wire_dtype):
    """transfer="separate" gives the fused dispatch's outputs: the rows where slots are held, everything else."""
    x, idx, w, _ = (a.reshape(4, -1, *a.shape[1:]) for a in _inputs(4, seed=1))

    def run(transfer):
        capacity = 24 if layout == "ragged" else 8
        kw = dict(num_experts=E, axis_name="ep", layout=layout, capacity=capacity, wire_dtype=wire_dtype)
        kw.update(transfer=transfer)
        return to_numpy(ep_jit(lambda x, idx, w: jax_ep.dispatch(x, idx, w, **kw), 4)(x, idx, w))

    fused, separate = run("fused"), run("separate")
    assert fused.num_dropped.sum() > 0  # the capacity drops slots: held and dropped rows both show
    held = fused.handle.row_slot.reshape(fused.weights.shape) >= 0
    np.testing.assert_array_equal(np.where(held[..., None], separate.x, 0), np.where(held[..., None], fused.x, 0))
    for name in ("weights", "group_sizes", "num_dropped", "num_invalid"):
        np.testing.assert_array_equal(getattr(separate, name), getattr(fused, name), err_msg=name)
    for a, b in zip(jax.tree.leaves(separate.handle), jax.tree.leaves(fused.handle), strict=True):
        np.testing.assert_array_equal(a, b)


def test_transfer_is_checked():
    mesh = cpu_mesh((2,), ("ep",))
    x, idx, w, _ = _inputs(2)
    call = jax.shard_map(
        lambda x, idx, w: jax_ep.dispatch(x, idx, w, num_experts=E, axis_name="ep", transfer="later").x,
        mesh=mesh,
        in_specs=P("ep"),
        out_specs=P("ep"),
    )
    with pytest.raises(ValueError, match="transfer must be one of"):
        call(x, idx, w)
    start = jax.shard_map(
        lambda x, idx, w: jax_ep.dispatch_start(x, idx, w, num_experts=E, axis_name="ep", transfer="separate"),
        mesh=mesh,
        in_specs=P("ep"),
        out_specs=P("ep"),
    )
    with pytest.raises(ValueError, match="dispatch_start: transfer must be 'fused'"):
        start(x, idx, w)


@functools.cache
def _moe_grads(remat: str | None) -> list[np.ndarray]:
    """Gradients of a loss of jax_ep.nn.MoE w.r.t. its parameters and x, with ``remat`` (None: no checkpoint);
    each computed once for the tests below."""
    mesh = cpu_mesh((2,), ("ep",))
    x = jnp.asarray(np.random.default_rng(2).standard_normal((4 * T, H)).astype(np.float32))
    layer = jax_ep.nn.MoE(H, 64, num_experts=E, topk=K, mesh=mesh, remat=remat, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(layer)

    def loss(params, x):
        out = nnx.merge(graphdef, params)(x)
        return jnp.sum(out.out**2) + out.aux_loss

    return [np.asarray(g) for g in jax.tree.leaves(jax.jit(jax.grad(loss, argnums=(0, 1)))(params, x))]


@pytest.mark.parametrize("remat", ["full", "handle", "rows"])
def test_moe_remat_gives_the_same_gradients(remat):
    for got, want in zip(_moe_grads(remat), _moe_grads(None), strict=True):
        np.testing.assert_array_equal(got, want)


def test_moe_remat_is_checked():
    mesh = cpu_mesh((2,), ("ep",))
    kw = dict(num_experts=E, topk=K, mesh=mesh, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="remat must be one of"):
        jax_ep.nn.MoE(H, 64, remat="some", **kw)
    with pytest.raises(ValueError, match="remat='handle'"):
        jax_ep.nn.MoE(H, 64, remat="handle", overlap=True, shared_intermediate=32, **kw)
