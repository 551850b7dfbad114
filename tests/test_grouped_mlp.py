"""jax_ep.gmm.grouped_mlp: the expert MLP with the padded path taken once, against the MLP of jax.lax.ragged_dot.

The CPU tests run the custom VJP's CUDA branches with XLA's ops in place of the kernels (test_grouped_matmul's
``fake_kernels``); the GPU test runs the kernels and skips without a Hopper GPU.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_ep.gmm import grouped_matmul as gm
from jax_ep.gmm import mlp as gmlp
from jax_ep.gmm import padded
from tests.test_grouped_matmul import fake_kernels, hopper, routed_sizes

# Group sizes: the ladder of padded sizes is (288, 304, 352) at M=2048 and 8 groups. Every group fits its smallest
# size in "fits", only its largest in "fits_largest"; group 0 fits none in "too_large".
SIZES = {
    "fits": [250, 260, 0, 262, 248, 251, 259, 253],
    "fits_largest": [340, 200, 0, 262, 230, 251, 259, 241],
    "too_large": [400, 200, 0, 262, 200, 251, 259, 200],
}
M, H, F = 2048, 128, 64
LADDER = padded.row_ladder(M, 8)


def make(case: str, gated: bool, seed: int = 0):
    """x [M, H] and dy [M, H] with NaN past the groups, the weights, the group sizes (all bfloat16 but the sizes)."""
    sizes = np.asarray(SIZES[case], np.int32)
    rng = np.random.default_rng(seed)
    g, s = len(sizes), int(sizes.sum())
    x, dy = rng.standard_normal((2, M, H)).astype(np.float32)
    x[s:], dy[s:] = np.nan, np.nan
    shapes = {"w_gate": (g, H, F), "w_in": (g, H, F), "w_out": (g, F, H)}
    w = {name: rng.standard_normal(shape) / np.sqrt(shape[1]) for name, shape in shapes.items()}
    if not gated:
        del w["w_gate"]
    as_bf16 = functools.partial(jnp.asarray, dtype=jnp.bfloat16)
    return as_bf16(x), {name: as_bf16(v) for name, v in w.items()}, jnp.asarray(sizes), as_bf16(dy)


def reference(x, w, sizes, dy):
    """y, dx, dw of the MLP of ragged_dot in float32, rows past the groups zeroed first."""
    s = int(np.sum(sizes))
    x32, dy32 = (jnp.asarray(a, jnp.float32).at[s:].set(0) for a in (x, dy))
    w32 = {name: v.astype(jnp.float32) for name, v in w.items()}
    fn = lambda a, b: gmlp.mlp(a, b, lambda u, v: jax.lax.ragged_dot(u, v, sizes), jax.nn.silu)  # noqa: E731
    y, pullback = jax.vjp(fn, x32, w32)
    return y, *pullback(dy32)


def plans():
    """Plans of both matmul shapes with every op on the padded path."""
    g = len(SIZES["fits"])
    return tuple(
        gm.plan_for((M, k), (g, k, n), jnp.bfloat16, jnp.bfloat16)._replace(padded_ops=gmlp.ALL_OPS)
        for k, n in ((H, F), (F, H))
    )


def check(got, want, sizes):
    s = int(np.sum(sizes))
    (y, dx, dw), (y_ref, dx_ref, dw_ref) = got, want
    pairs = [("y", y[:s], y_ref[:s]), ("dx", dx, dx_ref)] + [(n, dw[n], dw_ref[n]) for n in dw_ref]
    assert sorted(dw) == sorted(dw_ref)
    for name, g, r in pairs:
        g, r = np.asarray(g, np.float32), np.asarray(r, np.float32)
        assert g.shape == r.shape and np.all(np.isfinite(g)), f"{name} is not finite"
        np.testing.assert_allclose(g, r, rtol=2e-2, atol=2e-2 * float(np.abs(r).max()), err_msg=name)
    assert np.all(np.asarray(dx[s:], np.float32) == 0), "dx must be 0 past sum(group_sizes)"
    empty = np.asarray(sizes) == 0
    assert all(np.all(np.asarray(dw[n][empty], np.float32) == 0) for n in dw), "an empty group's dw must be 0"


@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
@pytest.mark.parametrize("case", sorted(SIZES))
def test_fused_mlp_takes_one_path_and_matches_ragged_dot(monkeypatch, case, gated):
    """The CUDA branches: with every group fitting a padded size the kernels are poisoned (NaN), so only the padded
    path can give the result (and a size too small would drop rows); with one group too large the padded einsums
    are."""
    fake_kernels(monkeypatch, [])
    if case != "too_large":

        def ragged(lhs, rhs, sizes, blocks, *, transpose_rhs=False, specialized=False, group_starts=None):
            return jnp.full((lhs.shape[0], rhs.shape[1 if transpose_rhs else 2]), jnp.nan, lhs.dtype)

        def transposed(lhs, rhs, sizes, blocks, *, specialized=False, group_starts=None):
            return jnp.full((sizes.shape[0], lhs.shape[1], rhs.shape[1]), jnp.nan, lhs.dtype)

        monkeypatch.setattr(gm._mosaic, "ragged_dot", ragged)
        monkeypatch.setattr(gm._mosaic, "upstream_ragged_dot", ragged)
        monkeypatch.setattr(gm._mosaic, "transposed_ragged_dot", transposed)
    else:
        monkeypatch.setattr(padded, "einsum", lambda spec, a, b: jnp.einsum(spec, a, b) * jnp.nan)
    monkeypatch.setattr(gmlp.lax, "platform_dependent", lambda *args, cuda, default: cuda(*args))
    x, w, sizes, dy = make(case, gated)
    assert LADDER == (288, 304, 352) and (max(SIZES[case]) <= LADDER[0]) == (case == "fits")
    fused = functools.partial(gmlp.fused_mlp, group_sizes=sizes, activation=jax.nn.silu, plans=plans(), ladder=LADDER)

    @jax.jit
    def step(x, w, dy):
        y, pullback = jax.vjp(lambda a, b: fused(a, b), x, w)
        return y, *pullback(dy)

    check(step(x, w, dy), reference(x, w, sizes, dy), sizes)
    jaxpr = str(jax.make_jaxpr(step)(x, w, dy))
    assert jaxpr.count("cond[") == 2, "one conditional forward, one backward"


def test_grouped_mlp_fuses_only_where_every_op_is_padded(monkeypatch):
    monkeypatch.setattr(gm, "hopper_available", lambda: True)
    bf16 = jnp.bfloat16

    def fused(m, h, f, g, gated=True):
        x = jax.ShapeDtypeStruct((m, h), bf16)
        names = ("w_gate", "w_in", "w_out") if gated else ("w_in", "w_out")
        w = {n: jax.ShapeDtypeStruct((g, f, h) if n == "w_out" else (g, h, f), bf16) for n in names}
        return gmlp._fused_plans(x, w, "auto") is not None

    assert fused(32768, 7168, 2048, 256) and fused(32768, 7168, 2048, 256, gated=False)
    assert not fused(32768, 7168, 2048, 32)  # 1024 rows a group: the warp-specialized kernels
    assert not fused(8192, 4096, 1024, 64)  # the forward runs its kernel under 256 groups
    assert not fused(1024, 7168, 2048, 256)  # 4 rows a group: padding would cost too much
    assert padded.row_ladder(32768, 256) == (160, 176, 192) and padded.row_ladder(1024, 256) == ()
    monkeypatch.setattr(gmlp, "FUSED", False)
    assert not fused(32768, 7168, 2048, 256)


def numpy_swiglu_step(x, w, sizes, dy):
    """y, dx and the weights' gradients of the gated SwiGLU MLP, group by group in float32 NumPy."""
    x, dy = np.asarray(x, np.float32), np.asarray(dy, np.float32)
    w = {n: np.asarray(v, np.float32) for n, v in w.items()}
    y, dx = np.zeros_like(x), np.zeros_like(x)
    grads = {n: np.zeros_like(v) for n, v in w.items()}
    start = 0
    for group, size in enumerate(sizes):
        r = slice(start, start + int(size))
        gate, up = x[r] @ w["w_gate"][group], x[r] @ w["w_in"][group]
        sig = 1 / (1 + np.exp(-gate))
        hidden = gate * sig * up
        y[r] = hidden @ w["w_out"][group]
        d_hidden = dy[r] @ w["w_out"][group].T
        d_up, d_gate = d_hidden * gate * sig, d_hidden * up * sig * (1 + gate * (1 - sig))
        dx[r] = d_gate @ w["w_gate"][group].T + d_up @ w["w_in"][group].T
        grads["w_out"][group] = hidden.T @ dy[r]
        grads["w_gate"][group], grads["w_in"][group] = x[r].T @ d_gate, x[r].T @ d_up
        start += int(size)
    return y, dx, grads


def conditionals(beyond: bool) -> int:
    """The conditionals of grouped_mlp's forward and backward pass at 256 groups: one switch a pass, whose branch for
    groups that fit no padded size runs each op as its plan says. With Plan.beyond that branch holds a conditional
    on the padded rows in each of the 3 forward, 3 dx and 3 dw ops, and in each dw one more on how many groups are
    larger; without it, the kernels."""
    return 2 + (3 + 3 + 3 * 2 if beyond else 0)


def _grouped_mlp_at_256_groups(monkeypatch, sizes: np.ndarray):
    """grouped_mlp at M = 32772 rows in 256 groups of ``sizes`` (as on a Hopper GPU, the kernels faked): rows padded to
    a multiple of 8 (32776), :func:`conditionals`, and every group's output and gradients its own MLP's."""
    m, h, f, g = 32772, 64, 64, 256
    rng = np.random.default_rng(3)
    x, dy = (jnp.asarray(a, jnp.bfloat16) for a in rng.standard_normal((2, m, h)))
    shapes = {"w_gate": (g, h, f), "w_in": (g, h, f), "w_out": (g, f, h)}
    w = {n: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.bfloat16) for n, shape in shapes.items()}

    @jax.jit
    def step(x, w, sizes, dy):
        y, pullback = jax.vjp(lambda a, b: gmlp.grouped_mlp(a, b, sizes), x, w)
        return y, *pullback(dy)

    jaxpr = str(jax.make_jaxpr(step)(x, w, jnp.asarray(sizes), dy))
    assert jaxpr.count("cond[") == conditionals(gm.BEYOND_BY_DEFAULT) and "32776" in jaxpr
    y, dx, grads = step(x, w, jnp.asarray(sizes), dy)
    s = int(sizes.sum())
    y_ref, dx_ref, grads_ref = numpy_swiglu_step(x, w, sizes, dy)
    for name, got, want in [("y", y[:s], y_ref[:s]), ("dx", dx, dx_ref)] + [(n, grads[n], grads_ref[n]) for n in w]:
        got = np.asarray(got, np.float32)
        np.testing.assert_allclose(got, want, rtol=3e-2, atol=3e-2 * float(np.abs(want).max()), err_msg=name)


def _sizes_at_256_groups(skew: bool) -> np.ndarray:
    """Routed sizes of 32672 rows in 256 groups, the largest 164 rows; with ``skew`` group 0 takes rows from the
    others until it has more than 300 (routed_sizes)."""
    assert padded.row_ladder(32772, 256) == (160, 176, 192)
    sizes = routed_sizes(np.random.default_rng(3), 32772 - 100, 256, 290 if skew else 176, skew)
    assert sizes.max() > 300 if skew else sizes.max() == 164
    return sizes


def test_grouped_mlp_pads_rows_to_a_multiple_of_8_and_picks_a_size(monkeypatch):
    """The ladder is (160, 176, 192) and the largest group has 164 rows (a size that dropped rows would show)."""
    fake_kernels(monkeypatch, [])
    monkeypatch.setattr(gm, "hopper_available", lambda: True)
    _grouped_mlp_at_256_groups(monkeypatch, _sizes_at_256_groups(skew=False))


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per_op"])
def test_grouped_mlp_past_every_size_keeps_the_padded_path(monkeypatch, fused):
    """With Plan.beyond on, a group of more than 300 rows fits no size of the ladder: the MLP then stays padded once at
    the largest size with the rows past it through the kernels (PAST_ROWS_FUSED), or each op takes the padded path
    past its rows. The kernels over every row give NaN, and so do the per-op branch's ops where the MLP is fused, so
    only the path asked for gives the right result."""
    fake_kernels(monkeypatch, [])
    monkeypatch.setattr(gm, "hopper_available", lambda: True)
    monkeypatch.setattr(gm, "BEYOND_BY_DEFAULT", True)
    monkeypatch.setattr(gmlp, "PAST_ROWS_FUSED", fused)
    if fused:
        for name in ("fwd_op", "dx_op", "dw_op"):
            op = getattr(gm, name)
            monkeypatch.setattr(gm, name, lambda *args, op=op: op(*args) * jnp.nan)

    def whole_rows_nan(kernel):
        def run(*args, group_starts=None, **kwargs):
            out = kernel(*args, group_starts=group_starts, **kwargs)
            return out if group_starts is not None else out * jnp.nan

        return run

    for name in ("ragged_dot", "transposed_ragged_dot", "upstream_ragged_dot"):
        monkeypatch.setattr(gm._mosaic, name, whole_rows_nan(getattr(gm._mosaic, name)))
    _grouped_mlp_at_256_groups(monkeypatch, _sizes_at_256_groups(skew=True))


def test_grouped_mlp_without_hopper_is_the_mlp_of_ragged_dot():
    if gm.hopper_available():
        pytest.skip("on a Hopper GPU grouped_mlp runs the kernels (tested below)")
    x, w, sizes, dy = make("fits", gated=True)
    s = int(np.sum(sizes))

    def run(fn):
        y, pullback = jax.vjp(fn, x, w)
        return [np.asarray(v, np.float32) for v in (y[:s], *jax.tree.leaves(pullback(dy)))]

    got = run(lambda a, b: gmlp.grouped_mlp(a, b, sizes))
    want = run(lambda a, b: gmlp.mlp(a, b, lambda u, v: jax.lax.ragged_dot(u, v, sizes), jax.nn.silu))
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)


def _unvarying(kernel):
    """``kernel`` whose output varies over no mesh axis, as a Pallas call's: the mean over ("data", "ep") of its
    output, which is its own where every shard computes the same (in float32, exactly)."""

    def run(*args, **kwargs):
        out = kernel(*args, **kwargs)
        return (jax.lax.psum(out.astype(jnp.float32), ("data", "ep")) / 8).astype(out.dtype)

    return run


@pytest.mark.parametrize("case", ["fits", "too_large"])
def test_fused_mlp_sums_weight_grads_over_the_data_axis(monkeypatch, case):
    """Inside shard_map, tokens over ("data", "ep") and weights over "ep": the weights' cotangents are summed over
    "data" as autodiff of ragged_dot's MLP gives; with a group too large (Plan.beyond) the MLP padded once past its
    rows, whose kernels' outputs vary over no mesh axis until it marks them."""
    from jax.sharding import AxisType
    from jax.sharding import PartitionSpec as P

    cpus = jax.devices("cpu")
    if len(cpus) < 8:
        pytest.skip("needs 8 CPU devices")
    fake_kernels(monkeypatch, [])
    for name in ("ragged_dot", "upstream_ragged_dot", "transposed_ragged_dot"):
        monkeypatch.setattr(gm._mosaic, name, _unvarying(getattr(gm._mosaic, name)))
    monkeypatch.setattr(gmlp.lax, "platform_dependent", lambda *args, cuda, default: cuda(*args))
    mesh = jax.make_mesh((2, 4), ("data", "ep"), axis_types=(AxisType.Auto,) * 2, devices=cpus[:8])
    x, w, sizes, _ = make(case, gated=True)
    x = jnp.nan_to_num(jnp.concatenate([x] * 8))  # every shard holds the same M rows, zeros past the groups
    w = {n: jnp.concatenate([v] * 4) for n, v in w.items()}
    s = jnp.tile(sizes, 8)
    step_plans = tuple(p._replace(beyond=case == "too_large") for p in plans())
    valid = sum(SIZES[case])

    def loss(fn):
        def body(x, w, s):
            return jnp.sum(fn(x, w, s).astype(jnp.float32)[:valid] ** 2)[None]

        specs = (P(("data", "ep")), P("ep"), P(("data", "ep")))
        mapped = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=P(("data", "ep")))
        return jax.jit(jax.grad(lambda x, w: jnp.sum(mapped(x, w, s)), argnums=(0, 1)))

    got = loss(lambda a, b, c: gmlp.fused_mlp(a, b, c, jax.nn.silu, step_plans, LADDER))(x, w)
    want = loss(lambda a, b, c: gmlp.mlp(a, b, lambda u, v: jax.lax.ragged_dot(u, v, c), jax.nn.silu))(x, w)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2 * float(np.abs(b).max()))


def test_bad_arguments():
    x, w, sizes, _ = make("fits", gated=True)
    with pytest.raises(ValueError, match="w_in, w_out and optionally w_gate"):
        gmlp.grouped_mlp(x, {"w_in": w["w_in"]}, sizes)
    with pytest.raises(ValueError, match="w_out \\[G, F, H\\]"):
        gmlp.grouped_mlp(x, {**w, "w_out": w["w_in"]}, sizes)
    with pytest.raises(TypeError, match="group_sizes must have dtype int32"):
        gmlp.grouped_mlp(x, w, sizes.astype(jnp.int16))
    with pytest.raises(ValueError, match="impl"):
        gmlp.grouped_mlp(x, w, sizes, impl="triton")


@hopper
@pytest.mark.whole_gpu  # its float32 reference: XLA's autotuner asked for 8 GiB beside three shards on an H100
@pytest.mark.parametrize("beyond", [False, True], ids=["kernels_past_it", "beyond"])
@pytest.mark.parametrize("skew", [False, True], ids=["fits", "too_large"])
def test_mosaic_grouped_mlp_at_256_groups(monkeypatch, skew, beyond):
    """The real kernels and row copies: :func:`conditionals`, and the output and gradients match the float32 MLP of
    ragged_dot, whichever branch runs (with a group too large: each op's kernel, or with BEYOND_BY_DEFAULT the MLP
    padded once with the rows past it through the kernels)."""
    monkeypatch.setattr(gm, "BEYOND_BY_DEFAULT", beyond)
    m, h, f, g = 32768, 256, 128, 256
    rng = np.random.default_rng(3)
    sizes = routed_sizes(rng, m - 100, g, padded.padded_rows(m, g), skew)
    x, dy = rng.standard_normal((2, m, h)).astype(np.float32)
    x[-100:], dy[-100:] = np.nan, np.nan
    shapes = {"w_gate": (g, h, f), "w_in": (g, h, f), "w_out": (g, f, h)}
    wb = {n: jnp.asarray(rng.standard_normal(shape) / np.sqrt(shape[1]), jnp.bfloat16) for n, shape in shapes.items()}
    xb, dyb = (jnp.asarray(a, jnp.bfloat16) for a in (x, dy))

    @jax.jit
    def step(x, w, sizes, dy):  # sizes an argument: constant sizes would fold the conditionals away
        y, pullback = jax.vjp(lambda a, b: gmlp.grouped_mlp(a, b, sizes, impl="mosaic"), x, w)
        return y, *pullback(dy)

    args = (xb, wb, jnp.asarray(sizes), dyb)
    assert step.lower(*args).compile().as_text().count("conditional(") == conditionals(beyond)
    got = step(*args)
    check(got, reference(xb, wb, jnp.asarray(sizes), dyb), sizes)
