"""backend="cuda" against backend="xla": dispatch bit for bit, combine within rounding, gradients, determinism.

Every test runs on three EP groups: 2 GPUs reaching each other by peer stores over NVLink (transport "auto"),
2 GPUs with every pair going through NCCL (transport "nccl", as for peers without P2P), and 1 GPU alone
("one_gpu": every row stays local, so it runs on single-GPU machines too).
"""

import contextlib
import functools
import os
import re
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from bench.multiprocess import checkout_env
from tests.gpu import gpu_devices, require_cuda
from tests.helpers import assert_bits_equal, quantize_dequantize, ragged_tail, specified

pytestmark = require_cuda()

MAX_TOKENS = 512
SIZES = dict(num_tokens=MAX_TOKENS, hidden=7168, topk=8, num_experts=256, dtype=jnp.float32, timeout_s=20.0)
GROUPS = {"auto": (2, "auto"), "nccl": (2, "nccl"), "one_gpu": (1, "auto")}  # ranks, transport


@pytest.fixture(scope="module", params=list(GROUPS))
def group(request):
    ranks, transport = GROUPS[request.param]
    if len(gpu_devices()) < ranks:
        pytest.skip(f"needs {ranks} GPUs, have {len(gpu_devices())}")
    return ranks, transport


@pytest.fixture(scope="module")
def transport(group):
    return group[1]


@pytest.fixture(scope="module")
def mesh(group):
    import jax_ep

    ranks, transport = group
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpu_devices()[:ranks])
    jax_ep.initialize(mesh, "ep", **SIZES, transport=transport)
    yield mesh
    jax_ep.finalize()


def test_pairs_go_by_the_transport_asked_for(mesh, transport):
    import jax_ep

    devices = list(mesh.devices.flat)
    others = {d: tuple(r for r in range(len(devices)) if r != mine) for mine, d in enumerate(devices)}
    assert jax_ep.nccl_ranks() == ({d: () for d in devices} if transport == "auto" else others)


def _routing(kind, tokens, topk, experts, rng):
    if kind == "uniform":
        return np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32)
    if kind == "skewed":
        return np.tile(np.arange(topk, dtype=np.int32), (tokens, 1))
    idx = rng.integers(0, experts, (tokens, topk)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[rng.random(idx.shape) < 0.05] = experts + 2
    idx[rng.random(idx.shape) < 0.05] = -5
    idx[:, -1] = idx[:, 0]  # duplicates
    return idx


def _inputs(mesh, kind, tokens, hidden, topk, experts, dtype, seed):
    """Every rank's tokens, ids and weights, stacked along the first axis (no zeros in x)."""
    rng = np.random.default_rng(seed)
    ranks = mesh.devices.size
    x = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    x = np.where(np.abs(x) < 0.05, 0.5, x)
    idx = _routing(kind, ranks * tokens, topk, experts, rng)
    w = rng.random((ranks * tokens, topk)).astype(np.float32) + 0.1
    return jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(w)


def _run(mesh, backend, x, idx, w, partial_dtype=None, split=False, **kw):
    def f(x, idx, w):
        d = _dispatch(split, x, idx, w, axis_name="ep", backend=backend, **kw)
        y = d.x * 2 + 1
        out = _combine(split, y, d.handle, weights=d.weights, partial_dtype=partial_dtype)
        scalars = jnp.stack([d.num_dropped, d.num_invalid])
        return (
            d.x[None],
            d.weights[None],
            d.group_sizes[None],
            scalars[None],
            jax.tree.map(lambda a: a[None], d.handle),
            out,
            d.expert_load[None],
            jax.tree.map(lambda a: a[None], d.row_expert),  # None in the expert layout
        )

    with jax.set_mesh(mesh):
        return jax.jit(jax.shard_map(f, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)


CASES = [
    # kind, tokens, hidden, topk, experts, layout, capacity, alignment
    ("uniform", 512, 7168, 8, 256, "ragged", None, 1),
    ("uniform", 256, 2048, 8, 64, "expert", None, 1),
    ("messy", 300, 128, 6, 32, "ragged", None, 3),
    ("messy", 300, 2048, 4, 16, "expert", 40, 1),
    ("skewed", 200, 128, 4, 16, "ragged", 250, 8),
    ("skewed", 128, 7168, 8, 16, "expert", 100, 1),
    ("messy", 77, 1001, 16, 64, "ragged", None, 1),  # rows not a multiple of 16 bytes: the unaligned paths
    # routings of at most 1024 slots with K a power of two: the one-block routing kernel
    ("messy", 100, 256, 8, 64, "ragged", None, 1),
    ("messy", 64, 512, 16, 256, "ragged", None, 2),
    ("messy", 45, 512, 2, 8, "expert", 8, 1),  # and a capacity that drops (18 of about 80 slots)
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind,tokens,hidden,topk,experts,layout,capacity,alignment", CASES)
def test_cuda_matches_xla(mesh, dtype, kind, tokens, hidden, topk, experts, layout, capacity, alignment):
    """Where the capacity drops slots, under both drop policies (they differ in the ragged layout only)."""
    x, idx, w = _inputs(mesh, kind, tokens, hidden, topk, experts, dtype, seed=tokens + hidden)
    policies = ("balanced", "expert") if capacity is not None else ("balanced",)
    for policy in policies:
        kw = dict(num_experts=experts, layout=layout, capacity=capacity, expert_alignment=alignment)
        kw["drop_policy"] = policy
        for partial in (None, jnp.float32):
            cuda, xla = (_run(mesh, backend, x, idx, w, partial, **kw) for backend in ("cuda", "xla"))
            _assert_same(cuda, xla, dtype)
        if capacity is not None:
            assert np.asarray(xla[3])[:, 0].sum() > 0, "the capacity drops slots"


def _assert_same(cuda, xla, dtype):
    """Dispatch outputs and handle bit for bit (the ragged tail excepted); combine within the partials' rounding."""
    assert_bits_equal(specified(cuda[0], cuda[2]), specified(xla[0], xla[2]), err_msg="x")
    names = ["weights", "group_sizes", "num_dropped/num_invalid", "handle"]
    for name, got, want in zip(names, cuda[1:5], xla[1:5], strict=True):
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e), err_msg=name)
    for name, got, want in zip(["expert_load", "row_expert"], cuda[6:8], xla[6:8], strict=True):
        assert (got is None) == (want is None), name
        if want is not None:
            assert_bits_equal(np.asarray(got), np.asarray(want), err_msg=name)
    out_cuda, out_xla = (np.asarray(o.astype(jnp.float32)) for o in (cuda[5], xla[5]))
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(out_cuda, out_xla, rtol=tol, atol=tol * np.abs(out_xla).max())
    assert np.abs(out_xla).sum() > 0


@pytest.mark.parametrize("num_sms", [1, 3])
def test_small_sm_budget_gives_the_same_results(mesh, transport, num_sms):
    """One block or three blocks move the same data as the full budget."""
    import jax_ep

    x, idx, w = _inputs(mesh, "messy", 300, 2048, 8, 32, jnp.bfloat16, seed=num_sms)
    kw = dict(num_experts=32, layout="ragged", expert_alignment=2)
    xla = _run(mesh, "xla", x, idx, w, **kw)
    try:
        assert jax_ep.initialize(mesh, "ep", **SIZES, num_sms=num_sms, transport=transport).num_sms == num_sms
        cuda = _run(mesh, "cuda", x, idx, w, **kw)
    finally:
        jax_ep.initialize(mesh, "ep", **SIZES, transport=transport)
    _assert_same(cuda, xla, jnp.bfloat16)


def _dispatch(split, x, idx, w, **kw):
    """jax_ep.dispatch, or its split halves."""
    import jax_ep

    return jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, w, **kw)) if split else jax_ep.dispatch(x, idx, w, **kw)


def _combine(split, y, handle, **kw):
    """jax_ep.combine, or its split halves."""
    import jax_ep

    return jax_ep.combine_finish(jax_ep.combine_start(y, handle, **kw)) if split else jax_ep.combine(y, handle, **kw)


def _grads(mesh, backend, layout, x, idx, w, partial_dtype=None, split=False, wire_dtype=None):
    scale = jnp.linspace(0.5, 1.5, x.shape[1])

    def loss(x, w):
        def f(x, idx, w):
            kw = dict(num_experts=16, layout=layout, capacity=200, backend=backend, wire_dtype=wire_dtype)
            d = _dispatch(split, x, idx, w, axis_name="ep", **kw)
            y = (jnp.tanh(d.x) * scale).astype(x.dtype)
            return _combine(split, y, d.handle, weights=d.weights * 1.5, partial_dtype=partial_dtype)

        out = jax.shard_map(f, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w)
        return jnp.sum(jnp.sin(out))

    with jax.set_mesh(mesh):
        return jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_cuda_gradients_match_xla(mesh, layout):
    x, idx, w = _inputs(mesh, "messy", 128, 256, 4, 16, jnp.float32, seed=3)
    for got, want in zip(_grads(mesh, "cuda", layout, x, idx, w), _grads(mesh, "xla", layout, x, idx, w), strict=True):
        want = np.asarray(want)
        # Sums of several terms in a different order: float32 rounding relative to the largest values.
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert np.abs(want).sum() > 0


def _combine_backward(mesh, backend, x, idx, w, layout, weighted):
    """combine's dy, dweights (0 without weights), row_slot and group_sizes, with NaN in y's rows that hold no
    slot."""
    import jax_ep

    def f(x, idx, w):
        kw = dict(num_experts=16, layout=layout, expert_alignment=8, backend=backend)
        d = jax_ep.dispatch(x, idx, w, axis_name="ep", **kw)
        held = (d.handle.row_slot >= 0).reshape(d.weights.shape)[..., None]
        y = jnp.where(held, jnp.tanh(d.x.astype(jnp.float32) * 0.7).astype(x.dtype), jnp.nan)
        g = (jnp.flip(x.astype(jnp.float32), 0) * 0.5 + 0.25).astype(x.dtype)
        if weighted:
            _, vjp = jax.vjp(lambda y, v: jax_ep.combine(y, d.handle, weights=v), y, d.weights)
            dy, dweights = vjp(g)
        else:
            _, vjp = jax.vjp(lambda y: jax_ep.combine(y, d.handle), y)
            (dy,), dweights = vjp(g), jnp.zeros_like(d.weights)
        return dy[None], dweights[None], d.handle.row_slot[None], d.group_sizes[None]

    with jax.set_mesh(mesh):
        return jax.jit(jax.shard_map(f, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)


@pytest.mark.parametrize(
    "dtype,hidden,weighted",
    [(jnp.float32, 256, True), (jnp.bfloat16, 1001, True), (jnp.float16, 2048, False), (jnp.bfloat16, 7168, True)],
)
@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_combine_backward_matches_xla(mesh, layout, dtype, hidden, weighted):
    """jax_ep_combine_backward: dy bit for bit on the specified rows, dweights within float32 rounding, and exactly
    0 in dweights on rows that hold no slot and in dy on those inside the data, where y is NaN (H=1001: the
    unaligned paths). The handle's row_slot is the xla backend's: -1 inside the data, -2 past it (ragged)."""
    x, idx, w = _inputs(mesh, "messy", 96, hidden, 4, 16, dtype, seed=hidden)
    got = (np.asarray(a) for a in _combine_backward(mesh, "cuda", x, idx, w, layout, weighted))
    dy, dweights, row_slot, sizes = got
    want_dy, want_dweights, want_row_slot, _ = (
        np.asarray(a) for a in _combine_backward(mesh, "xla", x, idx, w, layout, weighted)
    )
    np.testing.assert_array_equal(row_slot, want_row_slot)
    assert_bits_equal(specified(dy, sizes), specified(want_dy, sizes), err_msg="dy")
    empty = (row_slot < 0).reshape(dweights.shape)
    assert empty.any() and (~empty).any()
    padding = (row_slot == -1).reshape(dweights.shape)
    assert padding.any()  # alignment 8: padding inside the data in both layouts
    if layout == "ragged":
        np.testing.assert_array_equal(row_slot == -2, ragged_tail(dy, sizes))
    assert not np.any(dy[padding]) and not np.any(dweights[empty])
    np.testing.assert_allclose(dweights, want_dweights, rtol=1e-5, atol=1e-5 * np.abs(want_dweights).max())
    assert np.abs(specified(dy, sizes).astype(np.float32)).sum() > 0
    assert not weighted or np.abs(want_dweights).sum() > 0


def _fp8_case(mesh, layout, hidden):
    """Inputs with an all-zero block and a huge outlier, the dispatch arguments, and the NumPy formula's rows
    dispatched without FP8 (by backend xla)."""
    x, idx, w = _inputs(mesh, "messy", 96, hidden, 8, 32, jnp.bfloat16, seed=hidden + 5)
    x = np.array(x)
    x[2, :128] = 0
    x[3, 5] = 3e4
    kw = dict(num_experts=32, layout=layout, capacity=None if layout == "ragged" else 40, expert_alignment=4)
    return jnp.asarray(x), idx, w, kw, _run(mesh, "xla", jnp.asarray(quantize_dequantize(x)), idx, w, **kw)


@pytest.mark.parametrize("hidden", [256, 7168])
@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_fp8_dispatch_is_the_formula_on_the_gpu(mesh, layout, hidden):
    """wire_dtype=float8_e4m3fn on the GPU: d.x equals the NumPy formula dispatched without FP8, bit for bit,
    on both backends (XLA's GPU division is approximate: jax_ep.ep.division corrects it), with an all-zero
    block and a huge outlier that stay finite; FP8 did change the rows."""
    x, idx, w, kw, formula = _fp8_case(mesh, layout, hidden)
    for backend in ("cuda", "xla"):
        got = _run(mesh, backend, x, idx, w, wire_dtype=jnp.float8_e4m3fn, **kw)
        assert_bits_equal(specified(got[0], got[2]), specified(formula[0], formula[2]), err_msg=f"{backend} x")
        for g, e in zip(jax.tree.leaves(got[1:5]), jax.tree.leaves(formula[1:5]), strict=True):
            assert_bits_equal(g, e, err_msg=f"{backend} weights/counts/handle")
        assert np.isfinite(specified(got[0], got[2]).astype(np.float32)).all()
    exact = _run(mesh, "cuda", x, idx, w, **kw)
    assert not np.array_equal(specified(exact[0], exact[2]), specified(formula[0], formula[2]))


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_every_op_is_deterministic(mesh, layout):
    """Dispatch, combine (both partial dtypes) and the gradients, twice on the same inputs: the same bits."""
    x, idx, w = _inputs(mesh, "messy", 300, 2048, 8, 32, jnp.bfloat16, seed=17)
    kw = dict(num_experts=32, layout=layout, capacity=None if layout == "ragged" else 60)
    for partial in (None, jnp.float32):
        first, second = (_run(mesh, "cuda", x, idx, w, partial, **kw) for _ in range(2))
        assert_bits_equal(specified(first[0], first[2]), specified(second[0], second[2]), err_msg="x")
        for a, b in zip(jax.tree.leaves(first[1:]), jax.tree.leaves(second[1:]), strict=True):
            a, b = np.asarray(a), np.asarray(b)
            np.testing.assert_array_equal(a.view(f"u{a.dtype.itemsize}"), b.view(f"u{b.dtype.itemsize}"))
    xf = x.astype(jnp.float32)
    first, second = (_grads(mesh, "cuda", layout, xf, idx, w) for _ in range(2))
    for a, b in zip(first, second, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


@pytest.mark.parametrize("wire_dtype", [None, jnp.float8_e4m3fn], ids=["rows", "fp8"])
@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_split_ops_equal_the_whole_ops_on_the_gpu(mesh, layout, wire_dtype):
    """dispatch_start/finish and combine_start/finish (separate kernel launches: send, then receive) give the
    bits of dispatch and combine, forward (both partial dtypes) and gradients (their split backward passes)."""
    x, idx, w = _inputs(mesh, "messy", 300, 2048, 8, 32, jnp.bfloat16, seed=23)
    kw = dict(num_experts=32, layout=layout, capacity=None if layout == "ragged" else 60, wire_dtype=wire_dtype)
    for partial in (None, jnp.float32):
        split, whole = (_run(mesh, "cuda", x, idx, w, partial, s, **kw) for s in (True, False))
        assert_bits_equal(specified(split[0], split[2]), specified(whole[0], whole[2]), err_msg="x")
        for a, b in zip(jax.tree.leaves(split[1:]), jax.tree.leaves(whole[1:]), strict=True):
            assert_bits_equal(a, b)
        assert np.abs(np.asarray(whole[5], np.float32)).sum() > 0
    x16 = x[: mesh.devices.size * 128]
    idx16, w16 = jnp.where(idx[: x16.shape[0], :4] < 0, -1, idx[: x16.shape[0], :4] % 16), w[: x16.shape[0], :4]
    for partial in (None, jnp.float32):
        split, whole = (_grads(mesh, "cuda", layout, x16, idx16, w16, partial, s, wire_dtype) for s in (True, False))
        for a, b in zip(split, whole, strict=True):
            assert_bits_equal(a, b)
            assert np.abs(np.asarray(b, np.float32)).sum() > 0


def test_a_call_between_a_start_and_its_finish_is_an_error(mesh, transport):
    """A dispatch_start left open (its finish in a later jit) and a whole dispatch in between: the group fails
    the call with an error that says so, the finish's outputs are NaN, and initialize brings the group back."""
    import jax_ep

    x, idx, w = _inputs(mesh, "uniform", 64, 128, 4, 16, jnp.float32, seed=29)
    kw = dict(num_experts=16, axis_name="ep", backend="cuda")
    spec = P("ep")
    with _fails_with_a_split_op_open(mesh, transport, (x, idx, w)):
        start = jax.jit(jax.shard_map(lambda *a: jax_ep.dispatch_start(*a, **kw), in_specs=spec, out_specs=spec))
        finish = jax.jit(jax.shard_map(lambda p: jax_ep.dispatch_finish(p).x[None], in_specs=spec, out_specs=spec))
        whole = jax.jit(jax.shard_map(lambda *a: jax_ep.dispatch(*a, **kw).x[None], in_specs=spec, out_specs=spec))
        pending = start(x, idx, w)
        jax.block_until_ready(whole(x, idx, w))  # between the start and its finish
        try:
            out = np.asarray(finish(pending))
        except Exception as error:  # the handler may already report the failure
            assert "split op" in str(error), error
        else:
            assert np.all(np.isnan(out))


@contextlib.contextmanager
def _fails_with_a_split_op_open(mesh, transport, inputs):
    """Runs the body in a fresh group under the mesh; the body must leave the group failed with a split op open
    (Group.check says so). Then initialize brings the group back, and a split step on ``inputs`` matches xla."""
    import jax_ep

    try:
        group = jax_ep.initialize(mesh, "ep", **SIZES, transport=transport)
        with jax.set_mesh(mesh):
            yield
        with pytest.raises(RuntimeError, match="split op was open"):
            group.check()
    finally:
        jax_ep.initialize(mesh, "ep", **SIZES, transport=transport)
    x, idx, w = inputs
    kw = dict(num_experts=16)
    _assert_same(_run(mesh, "cuda", x, idx, w, split=True, **kw), _run(mesh, "xla", x, idx, w, **kw), jnp.float32)


def _positions_and_sent(pending):
    started = pending.started
    return started.token_dest_pos, started.slot_dest, started.sent


@pytest.mark.parametrize("tokens", [64, 512], ids=["one_chunk", "two_chunks"])
def test_a_start_while_a_start_is_open_fails_and_poisons_its_positions(mesh, transport, tokens):
    """Two dispatch_starts in a row: the first writes real positions and sent 0 and stays open, the second
    fails (its positions and slot ranks all -1) and the group says a split op was open. One chunk of routing in a
    group of one GPU is the start whose routing kernel checks and opens the call itself; two chunks go through the
    send kernel."""
    import jax_ep

    ranks = mesh.devices.size
    x, idx, w = _inputs(mesh, "uniform", tokens, 128, 8, 16, jnp.float32, seed=37)
    spec = P("ep")
    start = jax.jit(
        jax.shard_map(
            lambda *a: _positions_and_sent(jax_ep.dispatch_start(*a, num_experts=16, axis_name="ep", backend="cuda")),
            in_specs=spec,
            out_specs=spec,
        )
    )
    with _fails_with_a_split_op_open(mesh, transport, (x, idx, w)):
        first_pos, first_slots, first_sent = (np.asarray(a) for a in start(x, idx, w))
        second_pos, second_slots, _ = (np.asarray(a) for a in start(x, idx, w))
        assert first_pos.shape == (tokens * ranks, ranks)
        assert first_pos.max() >= 0 and np.all(first_pos >= -1)
        assert first_slots.max() >= 0 and np.all(first_slots >= -1)
        np.testing.assert_array_equal(first_sent, np.zeros(ranks, np.float32))
        np.testing.assert_array_equal(second_pos, np.full_like(second_pos, -1))
        np.testing.assert_array_equal(second_slots, np.full_like(second_slots, -1))


def test_the_schedule_puts_pinned_compute_between_the_halves(mesh):
    """With optimization barriers (as jax_ep.nn.MoE's overlap uses them), XLA's schedule runs the matmul after
    the start's custom call and before the finish's."""
    import jax_ep

    x, idx, w = _inputs(mesh, "uniform", 64, 256, 4, 16, jnp.bfloat16, seed=31)
    m = jnp.ones((256, 512), jnp.bfloat16)

    def f(x, idx, w):
        pending = jax_ep.dispatch_start(x, idx, w, num_experts=16, axis_name="ep", backend="cuda")
        x_side, pending = jax.lax.optimization_barrier((x, pending))
        side, pending = jax.lax.optimization_barrier((x_side @ m, pending))
        d = jax_ep.dispatch_finish(pending)
        return d.x[None], side

    with jax.set_mesh(mesh):
        text = jax.jit(jax.shard_map(f, in_specs=P("ep"), out_specs=P("ep"))).lower(x, idx, w).compile().as_text()
    markers = {"start": '"jax_ep_dispatch_start"', "gemm": r"cublas|gemm| dot\(", "finish": '"jax_ep_dispatch_finish"'}
    order = _scheduled(text, markers)
    assert order.index("start") < order.index("gemm") < order.index("finish"), order


def _scheduled(hlo: str, markers: dict[str, str]) -> list[str]:
    """The markers (name: regex) in the order an optimized HLO module runs them: the entry computation's
    instructions in schedule order, each called computation (fusions, command buffers) expanded in place."""
    computations, entry, name = {}, None, None
    for line in hlo.splitlines():
        header = re.match(r"^(ENTRY )?%?([^\s(]+) .*\{$", line)
        if header:
            name, entry = header.group(2), header.group(2) if header.group(1) else entry
            computations[name] = []
        elif name is not None and line.startswith("  "):
            computations[name].append(line)
    order: list[str] = []

    def walk(computation: str) -> None:
        for line in computations[computation]:
            order.extend(m for m, pattern in markers.items() if m not in order and re.search(pattern, line))
            for callee in re.findall(r"%([\w.\-]+)", line.split("=", 1)[-1]):
                if callee in computations and callee != computation:
                    walk(callee)

    walk(entry)
    return order


def test_many_calls_in_a_row(mesh):
    """Calls alternate staging halves and flags by parity: 50 in a scan, fresh data each time, nothing stale."""
    import jax_ep

    def run(backend, x, idx, w):
        def step(carry, seed):
            shifted = jnp.where(idx < 0, -1, (idx + seed.astype(jnp.int32)) % 16)
            d = jax_ep.dispatch(x + seed, shifted, w, num_experts=16, axis_name="ep", backend=backend)
            return carry, jnp.sum(jax_ep.combine(d.x, d.handle)) + jnp.sum(d.weights)

        return jax.lax.scan(step, 0, jnp.arange(50, dtype=jnp.float32))[1][None]

    x, idx, w = _inputs(mesh, "uniform", 64, 128, 4, 16, jnp.float32, seed=11)
    results = {}
    for backend in ("cuda", "xla"):
        body = functools.partial(run, backend)
        with jax.set_mesh(mesh):
            results[backend] = np.asarray(jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w))
    np.testing.assert_allclose(results["cuda"], results["xla"], rtol=1e-5)
    assert all(len(set(per_rank.tolist())) == 50 for per_rank in results["cuda"])  # every step saw new data


def test_too_large_for_the_group_is_a_clear_error(mesh):
    x, idx, w = _inputs(mesh, "uniform", MAX_TOKENS * 4, SIZES["hidden"], 8, 256, jnp.float32, seed=1)
    with pytest.raises(Exception, match="reserved"):
        jax.block_until_ready(_run(mesh, "cuda", x, idx, w, num_experts=256))


RESIZED = [("jax_ep_dispatch", "x"), ("jax_ep_dispatch", "recv_rows"), ("jax_ep_combine", "out")]
RESIZED += [("jax_ep_combine", "slot_values"), ("jax_ep_combine_backward", "dy")]


@pytest.mark.parametrize("target,result", RESIZED)
def test_a_result_of_another_size_than_the_kernels_write_fails_the_call(mesh, monkeypatch, target, result):
    """The handlers check each result's size against what the kernels write, so a spec in jax_ep/ep/cuda.py that
    disagreed with ffi/ fails the call instead of letting a kernel write past a buffer. The calls are made as
    cuda.py makes them, below the public ops (whose reshapes would refuse the wrong shapes first)."""
    import jax_ep
    from jax_ep.ep import cuda

    def f(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=16, axis_name="ep", backend="cuda")
        h, config = d.handle, d.handle.config
        rows, weights = d.x.reshape(config.num_rows, -1), d.weights.reshape(-1)
        spec = cuda.TARGETS[target]
        resized = tuple(r._replace(shape=r.shape[:-1]) if r.name == result else r for r in spec.results)
        with monkeypatch.context() as patch:
            patch.setitem(cuda.TARGETS, target, spec._replace(results=resized))
            if target == "jax_ep_dispatch":
                out = cuda._dispatch(target, config, x, idx, w)
            elif target == "jax_ep_combine":
                operands = cuda._combine_operands(h, rows, weights, weights)  # row values: slot_values [T, K]
                out = cuda._combine(target, config, operands, rows.shape[1], rows.dtype, site=1, with_values=True)
            else:
                out = cuda._backward(target, h, cuda._backward_operands(h, x, rows, weights), rows, weights, site=1)
        return jnp.stack([jnp.sum(v.astype(jnp.float32)) for v in out.values()])[None]

    x, idx, w = _inputs(mesh, "uniform", 64, 128, 4, 16, jnp.float32, seed=3)
    with jax.set_mesh(mesh), pytest.raises(Exception, match=f"result {result} (has [0-9]+ bytes|must be)"):
        jax.block_until_ready(jax.jit(jax.shard_map(f, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w))


def test_a_missing_peer_times_out_and_every_later_call_says_why(mesh, transport):
    """Only rank 0 enters a combine: it gives up after timeout_s (over NCCL: the watchdog aborts the
    communicator), its outputs are NaN, and the next call and Group.check fail naming what happened."""
    import jax_ep
    from jax_ep.ep import group as _group

    ranks = mesh.devices.size
    if ranks < 2:
        pytest.skip("a group of one rank has no peer to wait for")
    why = "gave up waiting for rank 1" if transport == "auto" else "did not finish within the timeout_s"
    try:
        group = jax_ep.initialize(mesh, "ep", **{**SIZES, "timeout_s": 0.5}, transport=transport)
        x, idx, w = _inputs(mesh, "uniform", 64, 128, 4, 16, jnp.float32, seed=5)
        _run(mesh, "cuda", x, idx, w, num_experts=16)  # the group's first call waits the set-up timeout
        rank0 = mesh.devices.flat[0]
        t, k, n, h = 4, 2, 8, 16
        args = [
            jnp.ones((n, h), jnp.float32),
            jnp.zeros((0,), jnp.float32),
            jnp.zeros((0,), jnp.float32),
            jnp.full((ranks, t, k), -1, jnp.int32),
            jnp.zeros((ranks,), jnp.int32),
            jnp.full((t, ranks), -1, jnp.int32),
            jnp.full((t, k), -1, jnp.int32),
            jnp.int32(0),
        ]
        args = [jax.device_put(a, rank0) for a in args]
        _group.extension()
        results = (jax.ShapeDtypeStruct((t, h), jnp.float32), jax.ShapeDtypeStruct((0,), jnp.float32))
        call = jax.ffi.ffi_call("jax_ep_combine", results)
        alone = jax.jit(lambda *a: call(*a, group=group.id, partial_f32=False)[0])
        start = time.perf_counter()
        out = np.asarray(alone(*args))
        assert time.perf_counter() - start < 30
        assert np.all(np.isnan(out))  # never stale data
        with pytest.raises(RuntimeError, match=why):
            group.check()
        with pytest.raises(Exception, match=why):
            jax.block_until_ready(alone(*args))
    finally:
        jax_ep.initialize(mesh, "ep", **SIZES, transport=transport)
    x, idx, w = _inputs(mesh, "uniform", 64, 128, 4, 16, jnp.float32, seed=5)
    kw = dict(num_experts=16)
    _assert_same(_run(mesh, "cuda", x, idx, w, **kw), _run(mesh, "xla", x, idx, w, **kw), jnp.float32)


@pytest.mark.parametrize("split", ["0", "1"])
def test_a_training_scan_under_command_buffers_matches_xla(mesh, transport, tmp_path, split):
    """200 jitted training steps in lax.scan with XLA command buffers forced on for custom calls, routing that
    changes every step: the same losses and parameters as backend xla (in a fresh process: XLA_FLAGS); with the
    whole ops, and with the split ops and a matmul between dispatch_start and dispatch_finish. With every pair
    through NCCL, no call may be captured (the script checks one host launch per call)."""
    ranks = mesh.devices.size
    # XLA's preallocated pool (a share this process leaves free) hands out memory that is not zero, as in
    # training: the ragged tails then hold other buffers' bits.
    env = {**os.environ, "JAX_EP_SCAN_RANKS": str(ranks), "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.1"}
    env["JAX_EP_SCAN_SPLIT"] = split
    env["JAX_EP_SCAN_TRANSPORT"] = transport
    command = [sys.executable, "-m", "tools.command_buffer_scan"]
    done = subprocess.run(command, env=checkout_env(env), capture_output=True, text=True, timeout=400, check=False)
    print(done.stdout[-4000:], done.stderr[-4000:])
    assert done.returncode == 0, done.stderr[-4000:]
    assert "captured:" in done.stdout and "OK" in done.stdout
