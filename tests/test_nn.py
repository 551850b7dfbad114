"""jax_ep.nn.MoE against a dense single-device MoE with the same parameters."""

import functools
import subprocess
import sys
import warnings
from collections import Counter
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tests.conftest import cpu_mesh
from tests.helpers import collective_operands

nnx = pytest.importorskip("flax.nnx")
from jax_ep.nn import MoE  # noqa: E402

HIDDEN, INTERMEDIATE, EXPERTS, TOPK = 16, 24, 8, 2


def dense_moe(params: dict, x: jax.Array, *, router: str, topk: int) -> tuple[jax.Array, jax.Array]:
    """Every expert on every token, then the top-k picked per token: ``out [N, H]`` and the aux loss."""
    logits = x @ params["router_kernel"]
    if router == "softmax":
        probs = jax.nn.softmax(logits)
        weights, idx = jax.lax.top_k(probs, topk)
    elif router == "softmax_topk":
        top_logits, idx = jax.lax.top_k(logits, topk)
        weights, probs = jax.nn.softmax(top_logits), jax.nn.softmax(logits)
    else:
        scores = jax.nn.sigmoid(logits)
        weights, idx = jax.lax.top_k(scores, topk)
        weights = weights / weights.sum(-1, keepdims=True)
        probs = scores / scores.sum(-1, keepdims=True)

    def mlp(w: dict) -> jax.Array:
        """Stacked MLPs ``[E, H, F]`` / ``[E, F, H]`` on every token: ``[E, N, H]``."""
        up = jnp.einsum("nh,ehf->enf", x, w["w_in"])
        hidden = jax.nn.silu(jnp.einsum("nh,ehf->enf", x, w["w_gate"])) * up if "w_gate" in w else jax.nn.silu(up)
        return jnp.einsum("enf,efh->enh", hidden, w["w_out"])

    every = mlp(params["experts"])
    out = jnp.einsum("nk,nkh->nh", weights, every[idx, jnp.arange(x.shape[0])[:, None]])
    if "shared" in params:
        out = out + mlp(jax.tree.map(lambda w: w[None], params["shared"]))[0]
    chosen = jax.nn.one_hot(idx, EXPERTS).sum(1)  # [N, E]
    aux = EXPERTS * jnp.sum(chosen.mean(0) / topk * probs.mean(0))
    return out, aux


def make_moe(shape: tuple[int, ...], **kwargs) -> MoE:
    """A small MoE on a CPU mesh ``("ep",)`` or ``("data", "ep")``; call under ``jax.set_mesh(model.mesh)``."""
    names = ("data", "ep")[-len(shape) :]
    mesh = cpu_mesh(shape, names)
    return MoE(
        HIDDEN,
        INTERMEDIATE,
        num_experts=EXPERTS,
        topk=TOPK,
        mesh=mesh,
        axis_name="ep",
        data_axes=names[:-1],
        rngs=nnx.Rngs(0),
        **kwargs,
    )


@pytest.mark.parametrize(
    "layout, shared, router, gated, shape",
    [
        pytest.param("ragged", None, "softmax", True, (8,), marks=pytest.mark.slow),
        ("ragged", 8, "sigmoid", False, (2, 4)),
        pytest.param("expert", None, "sigmoid", True, (2, 4), marks=pytest.mark.slow),
        ("expert", 8, "softmax", False, (8,)),
        ("ragged", None, "softmax_topk", True, (2, 4)),
    ],
)
def test_matches_dense(layout, shared, router, gated, shape):
    x = jax.random.normal(jax.random.key(1), (4, 8, HIDDEN))
    cotangent = jax.random.normal(jax.random.key(2), x.shape)
    model = make_moe(shape, layout=layout, shared_intermediate=shared, router=router, gated=gated)
    graphdef, state = nnx.split(model)

    def loss(state, x):
        result = nnx.merge(graphdef, state)(x)
        return jnp.sum(result.out * cotangent) + result.aux_loss, result

    with jax.set_mesh(model.mesh):
        (_, result), (dstate, dx) = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x)

    def dense_loss(params, x):
        out, aux = dense_moe(params, x.reshape(-1, HIDDEN), router=router, topk=TOPK)
        return jnp.sum(out.reshape(x.shape) * cotangent) + aux, (out, aux)

    params = jax.device_put(nnx.to_pure_dict(state), jax.devices("cpu")[0])
    (_, (out, aux)), (dparams, dx_dense) = jax.jit(jax.value_and_grad(dense_loss, argnums=(0, 1), has_aux=True))(
        params, x
    )

    assert result.out.shape == x.shape and result.out.dtype == x.dtype
    np.testing.assert_allclose(result.out.reshape(-1, HIDDEN), out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(result.aux_loss, aux, rtol=1e-5)
    assert result.num_dropped == 0
    np.testing.assert_allclose(dx, dx_dense, rtol=1e-5, atol=1e-5)

    def check(path, got, want):
        assert jnp.any(got != 0), path
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=str(path))

    jax.tree_util.tree_map_with_path(check, nnx.to_pure_dict(dstate), dparams)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_num_dropped(layout):
    capacity = 3
    model = make_moe((8,), layout=layout, capacity=capacity)
    x = jax.random.normal(jax.random.key(3), (64, HIDDEN))
    with jax.set_mesh(model.mesh):
        dropped = nnx.jit(lambda model, x: model(x).num_dropped)(model, x)
    idx = jax.lax.top_k(x @ model.router_kernel[...], TOPK)[1]
    per_expert = jnp.sum(jax.nn.one_hot(idx, EXPERTS), axis=(0, 1))  # one expert per rank
    assert dropped == jnp.sum(jnp.maximum(per_expert - capacity, 0))


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_experts must be a multiple"):
        MoE(HIDDEN, INTERMEDIATE, num_experts=6, topk=2, mesh=cpu_mesh((8,), ("ep",)), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="(?s)(?=.*router)(?=.*softmax_topk)(?=.*'relu')"):
        make_moe((8,), router="relu")
    model = make_moe((8,))
    with pytest.raises(ValueError, match="multiple of 8"), jax.set_mesh(model.mesh):
        model(jnp.zeros((12, HIDDEN)))


def test_wrong_hidden_size_is_a_clear_error():
    model = make_moe((8,))
    with pytest.raises(ValueError, match=r"hidden size 16, got input shape \(8, 17\)"), jax.set_mesh(model.mesh):
        model(jnp.zeros((8, HIDDEN + 1)))


def _explicit_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A plain ``jax.make_mesh`` of CPU devices, with its default axis types: Explicit."""
    mesh = jax.make_mesh(shape, names, devices=jax.devices("cpu")[: np.prod(shape)])
    assert set(mesh.axis_types) == {AxisType.Explicit}
    return mesh


def _run_on(mesh: jax.sharding.Mesh, x: jax.Array, *, jit: bool) -> dict:
    """A MoE with a shared expert on ``mesh`` applied to ``x``: its result, and under ``nnx.jit`` the gradients."""
    model = MoE(
        HIDDEN,
        INTERMEDIATE,
        num_experts=EXPERTS,
        topk=TOPK,
        mesh=mesh,
        data_axes=mesh.axis_names[:-1],
        shared_intermediate=8,
        rngs=nnx.Rngs(0),
    )
    if not jit:
        return {"result": model(x)}

    def loss(model, x):
        result = model(x)
        return jnp.sum(result.out**2) + result.aux_loss, result

    (_, result), (dmodel, dx) = nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True))(model, x)
    return {"result": result, "dx": dx, "dmodel": nnx.to_pure_dict(nnx.state(dmodel))}


def _explicit_input() -> jax.Array:
    return jax.random.normal(jax.random.key(1), (8, 8, HIDDEN))


@functools.cache
def _on_auto_mesh(shape: tuple[int, ...], jit: bool) -> dict:
    """``_run_on`` an Auto-axes mesh, the reference of the Explicit cases; computed once per shape and mode."""
    mesh = cpu_mesh(shape, ("data", "ep")[-len(shape) :])
    with jax.set_mesh(mesh):
        return _run_on(mesh, _explicit_input(), jit=jit)


@pytest.mark.parametrize(
    "shape, placement, jit",
    [
        pytest.param((8,), "unplaced", True, marks=pytest.mark.slow),  # about 13 s each on 2 cores
        ((8,), "reshard", True),
        ((8,), "device_put", True),
        pytest.param((2, 4), "reshard", True, marks=pytest.mark.slow),
        pytest.param((8,), "unplaced", False, marks=pytest.mark.slow),  # eager: about 30 s each
        pytest.param((8,), "device_put", False, marks=pytest.mark.slow),
    ],
)
def test_explicit_mesh_matches_auto(shape, placement, jit):
    """On a mesh of Explicit axes the layer gives the bits it gives on Auto axes; ``out`` (and ``dx``) are
    sharded like ``x``.

    ``x`` is unplaced (on one device), resharded over the token axes under ``jax.set_mesh``, or put there by
    ``jax.device_put`` without a mesh context; its sharded dimension is not the first, so flattening it to tokens
    needs a resharding. Under ``nnx.jit`` the gradients are compared too; eagerly only the result (an eager call
    compiles each op of the layer, about 30 s on CPU).
    """
    mesh = _explicit_mesh(shape, ("data", "ep")[-len(shape) :])
    spec = P(None, mesh.axis_names)
    x = _explicit_input()
    if placement == "device_put":
        x = jax.device_put(x, NamedSharding(mesh, spec))
        got = _run_on(mesh, x, jit=jit)
    else:
        with jax.set_mesh(mesh):
            x = jax.sharding.reshard(x, spec) if placement == "reshard" else x
            got = _run_on(mesh, x, jit=jit)

    assert jax.typeof(got["result"].out).sharding.spec == jax.typeof(x).sharding.spec
    if jit:
        assert jax.typeof(got["dx"]).sharding.spec == jax.typeof(x).sharding.spec
    want, got = (jax.tree_util.tree_flatten_with_path(tree)[0] for tree in (_on_auto_mesh(shape, jit), got))
    assert len(want) == len(got) == (4 + 7 if jit else 3)  # out, aux_loss, num_dropped (dx, 7 parameters)
    for (path, a), (_, b) in zip(want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path))


def test_mixed_axis_types_are_a_clear_error():
    mesh = jax.make_mesh((2, 4), ("data", "ep"), axis_types=(AxisType.Explicit, AxisType.Auto))
    with pytest.raises(ValueError, match=r"all Auto or all Explicit .* axis_types=\(AxisType.Auto,\) \* 2"):
        MoE(HIDDEN, INTERMEDIATE, num_experts=EXPERTS, topk=TOPK, mesh=mesh, data_axes=("data",), rngs=nnx.Rngs(0))


@pytest.mark.slow  # a warning's text, in a layer of float64 parameters
def test_float64_warns_of_float32_accuracy():
    """float64 x runs and gives a float64 output, but with float32 accuracy, and says so; float32 x does not warn."""
    model = make_moe((8,))
    call = nnx.jit(lambda model, x: model(x).out)
    with jax.enable_x64(True):
        x = jax.random.normal(jax.random.key(1), (64, HIDDEN), jnp.float64)
        with jax.set_mesh(model.mesh):
            with pytest.warns(UserWarning, match="float64 output of only float32 accuracy"):
                out = call(model, x)
            with warnings.catch_warnings():
                warnings.simplefilter("error")
                call(model, x.astype(jnp.float32))
        params = jax.tree.map(lambda a: np.asarray(a, np.float64), nnx.to_pure_dict(nnx.state(model)))
        want, _ = jax.jit(dense_moe, static_argnames=("router", "topk"))(params, x, router="softmax", topk=TOPK)
    assert out.dtype == want.dtype == jnp.float64
    error = np.abs(np.asarray(out) - np.asarray(want)).max() / np.abs(np.asarray(want)).max()
    assert 1e-12 < error < 1e-5  # float32's accuracy, not float64's: what the warning says


def test_construction_checks_axes_capacity_and_alignment():
    mesh = cpu_mesh((2, 4), ("data", "ep"))

    def build(**kwargs):
        return MoE(HIDDEN, INTERMEDIATE, num_experts=EXPERTS, topk=TOPK, mesh=mesh, rngs=nnx.Rngs(0), **kwargs)

    with pytest.raises(TypeError, match=r"sequence of mesh axis names, e.g. \('data',\)"):
        build(data_axes="data")  # would otherwise be split into the letters d, a, t, a
    with pytest.raises(ValueError, match="'model' is not one of \\('data',\\)"):
        build(data_axes=("model",))
    with pytest.raises(ValueError, match="other than axis_name"):
        build(data_axes=("ep",))
    with pytest.raises(ValueError, match="twice"):
        build(data_axes=("data", "data"))
    with pytest.raises(ValueError, match="capacity must be a positive int"):
        build(data_axes=("data",), capacity=0)
    with pytest.raises(TypeError, match="capacity must be an int"):
        build(data_axes=("data",), capacity=2.5)
    with pytest.raises(ValueError, match="expert_alignment must be a positive int"):
        build(data_axes=("data",), expert_alignment=0)
    assert build(data_axes=["data"], capacity=4, expert_alignment=2).token_axes == ("data", "ep")


def test_jax_ep_does_not_import_flax():
    code = "import sys, jax_ep; assert 'flax' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[1])


def _loss_and_grads(model, x):
    def loss(model, x):
        res = model(x)
        return jnp.sum(res.out.astype(jnp.float32) ** 2) + res.aux_loss

    with jax.set_mesh(model.mesh):
        return nnx.jit(nnx.value_and_grad(loss, argnums=(0, 1)))(model, x)


@pytest.mark.slow  # the split ops' bits are the whole ops' in the default tier too: tests/test_split_ops.py
def test_overlap_gives_the_same_bits():
    """overlap=True computes the shared expert between the split ops' halves: the same output and gradients."""
    x = jax.random.normal(jax.random.key(1), (16, HIDDEN), jnp.float32)
    (value, grads), (value_o, grads_o) = (
        _loss_and_grads(make_moe((4,), shared_intermediate=8, overlap=overlap), x) for overlap in (False, True)
    )
    assert float(value) == float(value_o)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_o), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow  # FP8 rows' formula is in the default tier: tests/test_wire_fp8.py
def test_fp8_wire_dtype_trains_close_to_full_precision():
    """wire_dtype=float8_e4m3fn: the output is within FP8 rounding of the layer without it (H a multiple of 128)."""

    def build(**kw):
        return MoE(128, 32, num_experts=EXPERTS, topk=TOPK, mesh=cpu_mesh((2,), ("ep",)), rngs=nnx.Rngs(0), **kw)

    x = jax.random.normal(jax.random.key(2), (8, 128), jnp.float32)
    (value, grads), (value_f, grads_f) = (
        _loss_and_grads(build(**kw), x) for kw in ({}, {"wire_dtype": jnp.float8_e4m3fn})
    )
    assert np.isfinite(float(value_f)) and abs(float(value_f) - float(value)) <= 0.05 * abs(float(value))
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_f), strict=True):
        a, b = np.asarray(a), np.asarray(b)
        assert np.isfinite(b).all()
        np.testing.assert_allclose(b, a, atol=0.1 * (np.abs(a).max() + 1e-6))
    with pytest.raises(ValueError, match="multiple of 128"):
        MoE(
            HIDDEN,
            8,
            num_experts=EXPERTS,
            topk=TOPK,
            mesh=cpu_mesh((2,), ("ep",)),
            rngs=nnx.Rngs(0),
            wire_dtype=jnp.float8_e4m3fn,
        )


def _z_loss_router(logits):
    """A callable router: Mixtral's softmax over the top-k logits, weights in bfloat16 and ids in int16 (as
    dispatch takes them), and a z-loss of its own as aux_loss."""
    top_logits, idx = jax.lax.top_k(logits, TOPK)
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return jax.nn.softmax(top_logits).astype(jnp.bfloat16), idx.astype(jnp.int16), z_loss


def test_callable_router():
    """router=callable: the layer dispatches the callable's top-k and returns the mean of its aux_loss over the
    token shards; gradients reach the router through the bfloat16 weights (the same as softmax_topk's, rounded)."""
    x = jax.random.normal(jax.random.key(4), (4, 8, HIDDEN))
    results = {}
    for router in ("softmax_topk", _z_loss_router):
        model = make_moe((2, 4), router=router)
        with jax.set_mesh(model.mesh):
            results[router] = nnx.jit(lambda m, x: (m(x), nnx.grad(lambda m: jnp.sum(m(x).out ** 2))(m)))(model, x)
    (named, named_grads), (called, called_grads) = results.values()
    np.testing.assert_allclose(called.out, named.out, rtol=2e-2, atol=2e-2)  # the weights rounded to bfloat16
    logits = x.reshape(-1, HIDDEN) @ model.router_kernel[...]
    shards = logits.reshape(8, -1, EXPERTS)  # the token shards of ("data", "ep")
    want = jnp.mean(jnp.mean(jax.nn.logsumexp(shards, axis=-1) ** 2, axis=-1))
    np.testing.assert_allclose(called.aux_loss, want, rtol=1e-6)
    assert called.aux_loss.dtype == jnp.float32 and called.num_dropped == 0
    router_grad = nnx.to_pure_dict(called_grads)["router_kernel"]
    assert np.any(router_grad) and np.all(np.isfinite(router_grad))
    np.testing.assert_allclose(router_grad, nnx.to_pure_dict(named_grads)["router_kernel"], rtol=0.1, atol=0.05)


def test_callable_router_outputs_are_checked():
    model = make_moe((8,), router=lambda logits: (logits[:, :1], jnp.zeros((logits.shape[0], 1), jnp.int32), 0.0))
    with pytest.raises(ValueError, match=r"(?s)(?=.*router)(?=.*topk_weights)(?=.*\(8, 2\))(?=.*\(8, 1\))"):
        with jax.set_mesh(model.mesh):
            model(jnp.zeros((64, HIDDEN)))
    model = make_moe((8,), router=lambda logits: (*jax.lax.top_k(logits, TOPK), jnp.zeros(2)))
    with pytest.raises(ValueError, match="(?s)(?=.*router)(?=.*scalar aux_loss)(?=.*\\(2,\\))"):
        with jax.set_mesh(model.mesh):
            model(jnp.zeros((64, HIDDEN)))


@pytest.mark.parametrize(
    ("layout", "factor", "alignment"), [("ragged", 0.6, 2), pytest.param("expert", 1.3, 1, marks=pytest.mark.slow)]
)
def test_capacity_factor(layout, factor, alignment):
    """capacity_factor=f is the capacity of its formula (ragged ceil(f*T*K) + L*(alignment-1), expert
    ceil(f*T*K/L), T tokens per rank), bit for bit; here it drops slots."""
    x = jax.random.normal(jax.random.key(5), (64, HIDDEN))
    tokens, local = 64 // 4, EXPERTS // 4
    if layout == "ragged":
        capacity = int(np.ceil(factor * tokens * TOPK)) + local * (alignment - 1)
    else:
        capacity = int(np.ceil(factor * tokens * TOPK / local))
    got, want = (
        _loss_and_grads(make_moe((4,), layout=layout, expert_alignment=alignment, **kw), x)
        for kw in ({"capacity_factor": factor}, {"capacity": capacity})
    )
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    model = make_moe((4,), layout=layout, capacity_factor=factor, expert_alignment=alignment)
    with jax.set_mesh(model.mesh):
        assert nnx.jit(lambda m, x: m(x).num_dropped)(model, x) > 0


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        (dict(capacity=4, capacity_factor=1.0), ValueError, "(?s)(?=.*capacity_factor)(?=.*capacity=4)"),
        (dict(capacity_factor=0.0), ValueError, "(?s)(?=.*capacity_factor)(?=.*positive)(?=.*0.0)"),
        (dict(capacity_factor=float("nan")), ValueError, "(?s)(?=.*capacity_factor)(?=.*positive)(?=.*nan)"),
        (dict(capacity_factor="2"), TypeError, "(?s)(?=.*capacity_factor)(?=.*number)(?=.*'2')"),
        (dict(partial_dtype=jnp.int32), TypeError, "(?s)(?=.*partial_dtype)(?=.*float)(?=.*int32)"),
    ],
)
def test_capacity_factor_and_partial_dtype_are_checked(kwargs, error, match):
    with pytest.raises(error, match=match):
        make_moe((8,), **kwargs)


def test_partial_dtype_reaches_both_ops():
    """partial_dtype=float32 with bfloat16 tokens: the partial sums of combine and of dispatch's backward pass (a
    combine) travel as float32 [R, T, H] buffers; without it they travel in bfloat16."""

    def exchanged(partial_dtype):
        model = make_moe((4,), partial_dtype=partial_dtype, param_dtype=jnp.bfloat16)
        graphdef, state = nnx.split(model)

        def loss(state, x):
            return jnp.sum(nnx.merge(graphdef, state)(x).out.astype(jnp.float32))

        with jax.set_mesh(model.mesh):
            closed = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(state, jnp.zeros((32, HIDDEN), jnp.bfloat16))
        return Counter(collective_operands(closed.jaxpr))

    tokens = (4, 8, HIDDEN)  # [R, T, H]
    f32, default = exchanged(jnp.float32), exchanged(None)
    assert f32[("all_to_all", "float32", tokens)] == 2 and default[("all_to_all", "float32", tokens)] == 0
    assert default[("all_to_all", "bfloat16", tokens)] == f32[("all_to_all", "bfloat16", tokens)] + 2
