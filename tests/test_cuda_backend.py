"""backend="cuda" against backend="xla": dispatch bit for bit, combine within rounding, gradients.

Every test runs on three EP groups: 2 GPUs reaching each other by peer stores over NVLink (transport "auto"),
2 GPUs with every pair going through NCCL (transport "nccl", as for peers without P2P), and 1 GPU alone
("one_gpu": every row stays local, so it runs on single-GPU machines too).
"""

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu import gpu_devices, require_cuda
from jax.sharding import PartitionSpec as P

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
    """Every rank's tokens, ids and weights, stacked along the first axis."""
    rng = np.random.default_rng(seed)
    ranks = mesh.devices.size
    x = rng.standard_normal((ranks * tokens, hidden)).astype(np.float32)
    idx = _routing(kind, ranks * tokens, topk, experts, rng)
    w = rng.random((ranks * tokens, topk)).astype(np.float32) + 0.1
    return jnp.asarray(x, dtype), jnp.asarray(idx), jnp.asarray(w)


def _run(mesh, backend, x, idx, w, **kw):
    import jax_ep

    def f(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, axis_name="ep", backend=backend, **kw)
        y = d.x * 2 + 1
        out = jax_ep.combine(y, d.handle, weights=d.weights)
        scalars = jnp.stack([d.num_dropped, d.num_invalid])
        return (
            d.x[None],
            d.weights[None],
            d.group_sizes[None],
            scalars[None],
            jax.tree.map(lambda a: a[None], d.handle),
            out,
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
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("kind,tokens,hidden,topk,experts,layout,capacity,alignment", CASES)
def test_cuda_matches_xla(mesh, dtype, kind, tokens, hidden, topk, experts, layout, capacity, alignment):
    x, idx, w = _inputs(mesh, kind, tokens, hidden, topk, experts, dtype, seed=tokens + hidden)
    kw = dict(num_experts=experts, layout=layout, capacity=capacity, expert_alignment=alignment)
    _assert_same(_run(mesh, "cuda", x, idx, w, **kw), _run(mesh, "xla", x, idx, w, **kw), dtype)


def _assert_same(cuda, xla, dtype):
    """Dispatch outputs and handle bit for bit; combine within float32 rounding (bf16 rounding for bf16)."""
    names = ["x", "weights", "group_sizes", "num_dropped/num_invalid", "handle"]
    for name, got, want in zip(names, cuda[:5], xla[:5], strict=True):
        for g, e in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(e), err_msg=name)
    out_cuda, out_xla = (np.asarray(o.astype(jnp.float32)) for o in (cuda[5], xla[5]))
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(out_cuda, out_xla, rtol=tol, atol=tol)
    assert np.abs(out_xla).sum() > 0


@pytest.mark.parametrize("num_sms", [1, 3])
def test_small_sm_budget_gives_the_same_results(mesh, transport, num_sms):
    """One block (peer list first, then local) and three (both lists from the start) move the same data."""
    import jax_ep

    x, idx, w = _inputs(mesh, "messy", 300, 2048, 8, 32, jnp.bfloat16, seed=num_sms)
    kw = dict(num_experts=32, layout="ragged", expert_alignment=2)
    xla = _run(mesh, "xla", x, idx, w, **kw)
    try:
        assert jax_ep.initialize(mesh, "ep", **SIZES, num_sms=num_sms, transport=transport) == num_sms
        cuda = _run(mesh, "cuda", x, idx, w, **kw)
    finally:
        jax_ep.initialize(mesh, "ep", **SIZES, transport=transport)
    _assert_same(cuda, xla, jnp.bfloat16)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_cuda_gradients_match_xla(mesh, layout):
    import jax_ep

    x, idx, w = _inputs(mesh, "messy", 128, 256, 4, 16, jnp.float32, seed=3)
    scale = jnp.linspace(0.5, 1.5, 256)

    def loss(backend, x, w):
        def f(x, idx, w):
            d = jax_ep.dispatch(x, idx, w, num_experts=16, axis_name="ep", layout=layout, capacity=200, backend=backend)
            out = jax_ep.combine(jnp.tanh(d.x) * scale, d.handle, weights=d.weights * 1.5)
            return out

        out = jax.shard_map(f, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w)
        return jnp.sum(jnp.sin(out))

    with jax.set_mesh(mesh):
        grads = {b: jax.jit(jax.grad(functools.partial(loss, b), argnums=(0, 1)))(x, w) for b in ("cuda", "xla")}
    for got, want in zip(grads["cuda"], grads["xla"], strict=True):
        want = np.asarray(want)
        # Sums of several terms in a different order: float32 rounding relative to the largest values.
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
        assert np.abs(want).sum() > 0


def test_exchange_rewrites_every_call(mesh):
    """Many exchanges in a row (epoch flags), fresh data each time: no stale or lost rows."""
    import jax_ep

    def step(carry, seed):
        x, idx, w = carry
        d = jax_ep.dispatch(x + seed, idx, w, num_experts=16, axis_name="ep", backend="cuda")
        out = jax_ep.combine(d.x, d.handle)
        return carry, jnp.sum(out) + jnp.sum(d.x)

    def run(backend_x, idx, w):
        return jax.lax.scan(step, (backend_x, idx, w), jnp.arange(50, dtype=jnp.float32))[1][None]

    x, idx, w = _inputs(mesh, "messy", 64, 128, 4, 16, jnp.float32, seed=11)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.shard_map(run, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)

    def reference(x, idx, w):
        def ref_step(carry, seed):
            d = jax_ep.dispatch(x + seed, idx, w, num_experts=16, axis_name="ep", backend="xla")
            return carry, jnp.sum(jax_ep.combine(d.x, d.handle)) + jnp.sum(d.x)

        return jax.lax.scan(ref_step, 0, jnp.arange(50, dtype=jnp.float32))[1][None]

    with jax.set_mesh(mesh):
        want = jax.jit(jax.shard_map(reference, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5)
    assert all(len(set(per_rank.tolist())) == 50 for per_rank in np.asarray(got))  # every step saw new data


def test_too_large_for_buffers_is_a_clear_error(mesh):
    x, idx, w = _inputs(mesh, "uniform", MAX_TOKENS * 4, SIZES["hidden"], 8, 256, jnp.float32, seed=1)
    with pytest.raises(Exception, match="reserved"):
        jax.block_until_ready(_run(mesh, "cuda", x, idx, w, num_experts=256))


def test_a_missing_peer_times_out_and_the_next_call_says_why(mesh, transport):
    """Only rank 0 enters a transfer: it stops waiting after timeout_s (over NCCL: the watchdog aborts the
    communicator), and its next call fails clearly."""
    import jax_ep
    from jax_ep import _cuda

    ranks = mesh.devices.size
    if ranks < 2:
        pytest.skip("a group of one rank has no peer to wait for")
    why = "gave up waiting for rank 1 of its EP group" if transport == "auto" else "did not finish within the timeout_s"
    try:
        jax_ep.initialize(mesh, "ep", **{**SIZES, "timeout_s": 0.5}, transport=transport)
        rank0 = mesh.devices.flat[0]
        buffer = jax.device_put(jnp.ones((ranks, 4, 8), jnp.float32), rank0)
        counts = jax.device_put(jnp.full((ranks,), 4, jnp.int32), rank0)
        alone = jax.jit(lambda b, c: _cuda.exchange(b, c, None))
        start = time.perf_counter()
        jax.block_until_ready(alone(buffer, counts))
        assert time.perf_counter() - start < 30
        with pytest.raises(Exception, match=why):
            jax.block_until_ready(alone(buffer, counts))
    finally:
        jax_ep.initialize(mesh, "ep", **SIZES, transport=transport)
    x, idx, w = _inputs(mesh, "uniform", 64, 128, 4, 16, jnp.float32, seed=5)
    kw = dict(num_experts=16)
    _assert_same(_run(mesh, "cuda", x, idx, w, **kw), _run(mesh, "xla", x, idx, w, **kw), jnp.float32)
