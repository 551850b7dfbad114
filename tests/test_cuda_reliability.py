"""backend="cuda" on one GPU: two EP groups in one process, finalize with calls in flight, memory over many calls.

Set ``JAX_EP_RELIABILITY_OUT`` to a JSON path to keep the memory figures the memory test measures.
"""

import gc
import json
import os
import subprocess

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.gpu import gpu_devices, require_cuda

pytestmark = require_cuda()

SIZES = dict(num_tokens=256, hidden=1024, topk=4, num_experts=16, dtype=jnp.bfloat16)


def _inputs(seed, tokens=256, hidden=1024, topk=4, experts=16):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32) + 0.5, jnp.bfloat16)
    idx = jnp.asarray(np.stack([rng.permutation(experts)[:topk] for _ in range(tokens)]).astype(np.int32))
    w = jnp.asarray(rng.random((tokens, topk)).astype(np.float32) + 0.1)
    return x, idx, w


def _exchange(axis, backend):
    """dispatch -> tanh expert -> combine over ``axis``, with the gradient w.r.t. x."""
    import jax_ep

    def f(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=16, axis_name=axis, backend=backend)
        return jax_ep.combine(jnp.tanh(d.x), d.handle, weights=d.weights)

    return f


def test_two_ep_groups_in_one_process_used_alternately_in_one_step():
    """One mesh with two axes, a group on each: a jitted step exchanges over "a", then "b", then "a" again."""
    import jax_ep

    mesh = jax.make_mesh((1, 1), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2, devices=gpu_devices()[:1])
    group_a = jax_ep.initialize(mesh, "a", **SIZES)
    group_b = jax_ep.initialize(mesh, "b", **SIZES)
    try:
        assert group_a.id != group_b.id and jax_ep.nccl_ranks("a") == jax_ep.nccl_ranks("b")
        x, idx, w = _inputs(1)

        def step(backend):
            first, second = _exchange("a", backend), _exchange("b", backend)

            def body(x, idx, w):
                y = first(x, idx, w)
                z = second(y * 0.5 + x, jnp.flip(idx, 0), w)
                return first(z, idx, jnp.flip(w, 0))

            spec = P(("a", "b"))
            forward = jax.shard_map(body, in_specs=spec, out_specs=spec)
            return jax.jit(jax.value_and_grad(lambda x: jnp.sum(forward(x, idx, w).astype(jnp.float32) ** 2)))

        with jax.set_mesh(mesh):
            got = step("cuda")(x)
            want = step("xla")(x)
        assert group_a.host_launches() > 0 and group_b.host_launches() > 0
        np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-2)
        a, b = (np.asarray(v, np.float32) for v in (got[1], want[1]))
        np.testing.assert_allclose(a, b, rtol=3e-2, atol=3e-2 * np.abs(b).max())
        assert np.abs(b).sum() > 0
    finally:
        jax_ep.finalize()


def test_finalize_with_calls_in_flight_then_a_call_is_a_clear_error():
    """Calls queued before finalize complete with the right results; the compiled step then refuses to run."""
    import jax_ep

    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpu_devices()[:1])
    jax_ep.initialize(mesh, "ep", **SIZES)
    x, idx, w = _inputs(2)
    with jax.set_mesh(mesh):
        step = jax.jit(jax.shard_map(_exchange("ep", "cuda"), in_specs=P("ep"), out_specs=P("ep")))
        xla = jax.jit(jax.shard_map(_exchange("ep", "xla"), in_specs=P("ep"), out_specs=P("ep")))
        want = np.asarray(xla(x, idx, w))
        compiled = step.lower(x, idx, w).compile()
        queued = [compiled(x + i, idx, w) for i in range(20)]  # not waited for
        jax_ep.finalize()  # waits for the GPU's queued work before freeing the group's memory
        last = np.asarray(queued[0], np.float32)
        np.testing.assert_allclose(last, want.astype(np.float32), rtol=2e-2, atol=2e-2 * np.abs(want).max())
        assert all(np.isfinite(np.asarray(q, np.float32)).all() for q in queued)
        with pytest.raises(Exception, match="finalized"):
            jax.block_until_ready(compiled(x, idx, w))


def _gpu_used_mib() -> int:
    """Memory in use on GPU 0 by every process, as nvidia-smi sees it (MiB)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout.split()[0])


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _xla_bytes_in_use() -> int:
    return int(gpu_devices()[0].memory_stats().get("bytes_in_use", 0))


def test_memory_is_flat_over_1000_calls_and_20_initialize_cycles():
    """Device memory (nvidia-smi: the group's own allocations; XLA's bytes_in_use) and host RSS do not grow
    over 1,000 forward + backward steps, nor over 20 initialize/finalize cycles; initialize takes the bytes
    buffer_size_hint names (plus routing scratch and signals, at the driver's granularity)."""
    import jax_ep

    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=gpu_devices()[:1])
    x, idx, w = _inputs(3)
    figures = {"sizes": {k: str(v) for k, v in SIZES.items()}}

    def make_step():
        forward = jax.shard_map(_exchange("ep", "cuda"), in_specs=P("ep"), out_specs=P("ep"))
        loss = lambda x, idx, w: jnp.sum(forward(x, idx, w).astype(jnp.float32) ** 2)  # noqa: E731
        return jax.jit(jax.value_and_grad(loss))

    reserve = dict(SIZES, num_tokens=4096, hidden=7168)  # so that the staging, not the driver's pages, dominates
    before = _gpu_used_mib()
    jax_ep.initialize(mesh, "ep", **reserve)
    hint = jax_ep.buffer_size_hint(num_ranks=1, **reserve)
    figures["initialize_mib"] = _gpu_used_mib() - before
    figures["buffer_size_hint_mib"] = hint / 2**20
    # The staging is one allocation of exactly the hint; the scratch, signals and peer table take a driver page
    # (2 MiB) each at most.
    assert hint / 2**20 <= figures["initialize_mib"] <= hint / 2**20 + 8, figures

    with jax.set_mesh(mesh):
        step = make_step()
        jax.block_until_ready(step(x, idx, w))
        samples = []
        for i in range(1000):
            out = step(x + (i % 7), idx, w)
            if i % 100 == 99:
                jax.block_until_ready(out)
                samples.append((_gpu_used_mib(), _xla_bytes_in_use(), _rss_mib()))
    figures["calls"] = {
        "gpu_mib": [s[0] for s in samples],
        "xla_bytes": [s[1] for s in samples],
        "rss_mib": [round(s[2], 1) for s in samples],
    }
    jax_ep.finalize()

    cycles = []
    for _ in range(20):
        jax_ep.initialize(mesh, "ep", **SIZES)
        with jax.set_mesh(mesh):
            jax.block_until_ready(make_step()(x, idx, w))  # a new trace: a finalized group's programs must not run
        jax_ep.finalize()  # clears JAX's caches, the cycle's executable with them
        gc.collect()
        cycles.append((_gpu_used_mib(), _xla_bytes_in_use(), _rss_mib()))
    figures["cycles"] = {
        "gpu_mib": [c[0] for c in cycles],
        "xla_bytes": [c[1] for c in cycles],
        "rss_mib": [round(c[2], 1) for c in cycles],
    }
    if os.environ.get("JAX_EP_RELIABILITY_OUT"):
        with open(os.environ["JAX_EP_RELIABILITY_OUT"], "w") as f:
            json.dump(figures, f, indent=1)
    print(json.dumps(figures))
    for name, series in (("calls", samples), ("cycles", cycles[2:])):  # cycles: after the first compiles
        gpu, xla, rss = (np.array([s[k] for s in series], np.float64) for k in range(3))
        assert gpu.max() - gpu.min() <= 2, (name, figures)  # MiB
        assert xla.max() - xla.min() <= 1 << 20, (name, figures)
        assert rss[-1] - rss[0] <= 32, (name, figures)  # MiB of host memory
