"""backend "cuda" next to a large NCCL all-reduce in the same jitted training step, on 2, 4 or 8 GPUs of one process.

Each step runs, inside ``jax.shard_map``, the forward and backward pass of dispatch -> an elementwise expert ->
combine (backend "cuda": dispatch, combine, combine's backward pass and dispatch's, each an exchange between the
GPUs) and, independent of them, ``jax.lax.psum`` of a 256 MB float32 "gradient" per GPU over the data-parallel
axis "dp" (over "ep", i.e. every GPU, on a 1-D mesh). Nothing orders the two, so XLA may run NCCL's all-reduce
while jax_ep's kernels wait on their peers: the case that could deadlock or corrupt data if the kernels and NCCL
starved each other. Over ``STEPS`` steps (the routing shifts every step), the test asserts that

* every step finishes, under a wall-clock guard: the case runs in a fresh process (the XLA flags below must be set
  before jax starts) that the test kills after ``JAX_EP_CONCURRENCY_TIMEOUT_S`` seconds (default 300), and that
  dumps every thread's Python stack itself (``faulthandler.dump_traceback_later``) 20 s before that;
* the loss, the combined output and the gradients w.r.t. ``x`` and the expert's scale equal backend "xla" run on
  the same inputs in the same program shape (float32: within float32 rounding of the sums' order);
* the psum equals its closed form (integers, exact in float32) on both backends;
* no group timed out (``Group.check``), and the cuda kernels were launched.

XLA flags of the worker (added to XLA_FLAGS): ``--xla_gpu_enable_latency_hiding_scheduler=true``, so that XLA's
scheduler places independent work between the start and the done of an asynchronous collective. Collectives are
asynchronous by default (``--xla_gpu_disable_async_collectives`` empty): the all-reduce runs as
``all-reduce-start``/``all-reduce-done`` on XLA's collective stream while the compute stream runs the other work.
The worker prints how many jax_ep custom calls the compiled schedule puts between the two ("scheduled between
the all-reduce's start and done: N"); the test asserts none of it, since XLA decides (N = 0 still checks that the
two run in one program without a hang). Were the latency-hiding flag unknown to this XLA, the case reruns without
it and says so.

Meshes: ``ep2``, ``ep4``, ``ep8`` (1-D "ep" over the first 2, 4, 8 GPUs; the psum is over all of them) and
``dp2xep2``, ``dp2xep4`` (2-D ("dp", "ep"): two EP groups; the psum over "dp" pairs GPUs of different groups).
Each skips where fewer GPUs are visible. Run one case by hand::

    python -m tests.test_cuda_concurrency dp2xep4 [--steps 20] [--guard-s 280]
"""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from bench.multiprocess import checkout_env, run_session
from tests.gpu import gpu_devices, require_cuda

pytestmark = [*require_cuda(min_gpus=2), pytest.mark.slow]

MESHES = {  # name: (shape, axis names)
    "ep2": ((2,), ("ep",)),
    "ep4": ((4,), ("ep",)),
    "ep8": ((8,), ("ep",)),
    "dp2xep2": ((2, 2), ("dp", "ep")),
    "dp2xep4": ((2, 4), ("dp", "ep")),
}
STEPS = 20
TOKENS, HIDDEN, TOPK, EXPERTS = 256, 2048, 8, 64  # per rank; float32 rows
GRADIENT_MB = 256  # per GPU, float32
LATENCY_HIDING = "--xla_gpu_enable_latency_hiding_scheduler=true"
TIMEOUT_S = float(os.environ.get("JAX_EP_CONCURRENCY_TIMEOUT_S", "300"))
# Relative bounds (times the largest reference value) of cuda against xla: combine sums at most K weighted rows
# per token in another order; the expert-scale gradient sums the same products over every row.
TOLERANCE = {"loss": 1e-5, "out": 1e-5, "dx": 1e-5, "dscale": 1e-4}


# ---------------------------------------------------------------------------------------------------------------------
# The worker: one mesh, one process.


def _step(backend: str, reduce_axis: str):
    """``step(x, idx, w, scale, g, i) -> (loss[1], out, dx, dscale, gsum)``, one GPU's shard of each."""
    import jax_ep

    def body(x, idx, w, scale, g, i):
        def loss(x, scale):
            d = jax_ep.dispatch(x, (idx + i) % EXPERTS, w, num_experts=EXPERTS, axis_name="ep", backend=backend)
            held = (jnp.arange(d.x.shape[0]) < jnp.sum(d.group_sizes))[:, None]  # rows past them hold anything
            h = jnp.where(held, d.x, 0).astype(jnp.float32)  # masked before the product too: 0 * NaN is NaN
            y = jnp.where(held, jnp.tanh(h * scale[0]), 0.0).astype(d.x.dtype)
            out = jax_ep.combine(y, d.handle, weights=d.weights)
            return jnp.sum(out.astype(jnp.float32) ** 2), out

        (value, out), (dx, dscale) = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, scale)
        # Independent of every jax_ep op above: the data-parallel all-reduce of a large gradient.
        gsum = jax.lax.psum(g + i.astype(g.dtype), reduce_axis)
        return value[None], out, dx, dscale, gsum

    return body


def _expected_psum(mesh_shape, axis_names, columns):
    """``check(gsum, i) -> max |gsum - closed form|`` per GPU: g holds ``k % 1024 + 1024 * r`` at column k of GPU r
    (r: its index over the mesh's flattened axes), so the psum of ``g + i`` is a sum of integers below 2**24."""

    def check(gsum, i):
        k = (jnp.arange(columns, dtype=jnp.int32) % 1024).astype(jnp.float32)  # traced: an iota, not a 256 MB constant
        if len(axis_names) == 1:  # over every GPU
            (count,) = mesh_shape
            rows = count * (count - 1) // 2
        else:  # over "dp": r = a * ep + b for a < dp, this GPU's b
            count, ep = mesh_shape
            rows = ep * count * (count - 1) // 2 + count * jax.lax.axis_index("ep")
        want = count * k + (1024 * rows + count * i).astype(jnp.float32)
        return jnp.max(jnp.abs(gsum - want))

    return check


def _compare(axis_names, spec, mesh, columns, mesh_shape):
    """A jitted ``compare(cuda outputs, xla outputs, i) -> [GPUs, 10]``: per GPU, the psum errors of both backends,
    then (max |cuda - xla|, max |xla|) of the loss, out, dx and dscale. Local reductions only: no collective."""
    check = _expected_psum(mesh_shape, axis_names, columns)

    def body(cuda, xla, i):
        rows = [check(cuda[4], i), check(xla[4], i)]
        for a, b in zip(cuda[:4], xla[:4], strict=True):
            a, b = a.astype(jnp.float32), b.astype(jnp.float32)
            rows += [jnp.max(jnp.abs(a - b)), jnp.max(jnp.abs(b))]
        return jnp.stack(rows)[None]

    specs = (spec, spec, spec, spec, spec)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(specs, specs, P()), out_specs=spec))


def _schedule_report(hlo: str) -> str:
    """How many jax_ep custom calls XLA's schedule (the entry computation, in order) puts between an all-reduce's
    start and its done."""
    entry, inside = [], False
    for line in hlo.splitlines():
        if line.startswith("ENTRY"):
            inside = True
        elif inside and line.startswith("}"):
            break
        elif inside:
            entry.append(line)
    starts = [n for n, line in enumerate(entry) if "all-reduce-start(" in line]
    dones = [n for n, line in enumerate(entry) if "all-reduce-done(" in line]
    calls = [n for n, line in enumerate(entry) if 'custom_call_target="jax_ep_' in line]
    if not starts or not dones:
        synchronous = sum("all-reduce(" in line for line in entry)
        return f"no asynchronous all-reduce in the schedule ({synchronous} synchronous); jax_ep calls: {len(calls)}"
    between = sum(starts[0] < n < dones[-1] for n in calls)
    return (
        f"scheduled between the all-reduce's start and done: {between} of {len(calls)} jax_ep calls "
        f"({len(starts)} all-reduce-start)"
    )


def work(mesh_name: str, steps: int) -> None:
    import jax_ep

    shape, axis_names = MESHES[mesh_name]
    count = math.prod(shape)
    devices = jax.devices("gpu")
    assert len(devices) >= count, f"{mesh_name} needs {count} GPUs, have {len(devices)}"
    mesh = jax.make_mesh(
        shape, axis_names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=devices[:count]
    )
    spec = P(axis_names if len(axis_names) > 1 else axis_names[0])
    reduce_axis = "dp" if "dp" in axis_names else "ep"
    print(
        f"{mesh_name}: mesh {dict(zip(axis_names, shape, strict=True))} over {[d.id for d in mesh.devices.flat]}, "
        f"psum over {reduce_axis!r}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}",
        flush=True,
    )
    group = jax_ep.initialize(
        mesh, "ep", num_tokens=TOKENS, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS, dtype=jnp.float32, timeout_s=30.0
    )
    print(f"NCCL ranks (pairs not by peer stores): {jax_ep.nccl_ranks('ep')}", flush=True)

    rng = np.random.default_rng(0)
    rows = count * TOKENS
    sharded = NamedSharding(mesh, spec)
    x = jax.device_put(rng.standard_normal((rows, HIDDEN)).astype(np.float32), sharded)
    idx = jax.device_put(rng.random((rows, EXPERTS)).argsort(axis=1)[:, :TOPK].astype(np.int32), sharded)
    w = jax.device_put((rng.random((rows, TOPK)) + 0.1).astype(np.float32), sharded)
    scale = jax.device_put((1 + 0.1 * rng.standard_normal((count, HIDDEN))).astype(np.float32), sharded)
    columns = GRADIENT_MB * 2**20 // 4

    def gradient():
        k = jnp.arange(columns, dtype=jnp.int32) % 1024
        return (k[None, :] + 1024 * jnp.arange(count, dtype=jnp.int32)[:, None]).astype(jnp.float32)

    g = jax.jit(gradient, out_shardings=sharded)()
    in_specs = (spec, spec, spec, spec, spec, P())
    out_specs = (spec, spec, spec, spec, spec)
    cuda_step, xla_step = (
        jax.jit(jax.shard_map(_step(b, reduce_axis), mesh=mesh, in_specs=in_specs, out_specs=out_specs))
        for b in ("cuda", "xla")
    )
    args = (x, idx, w, scale, g, jnp.int32(0))
    start = time.perf_counter()
    cuda_step = cuda_step.lower(*args).compile()
    print(_schedule_report(cuda_step.as_text()), flush=True)
    xla_step = xla_step.lower(*args).compile()
    compare = _compare(axis_names, spec, mesh, columns, shape)
    print(f"compiled both steps in {time.perf_counter() - start:.1f} s", flush=True)

    launches = group.host_launches()
    worst = dict.fromkeys(("psum cuda", "psum xla", *TOLERANCE), 0.0)
    start = time.perf_counter()
    times = []
    for n in range(steps):
        began = time.perf_counter()
        i = jnp.int32(n)
        cuda = cuda_step(x, idx, w, scale, g, i)
        xla = xla_step(x, idx, w, scale, g, i)
        errors = np.asarray(compare(cuda, xla, i))  # [GPUs, 10]
        psum_cuda, psum_xla = errors[:, 0].max(), errors[:, 1].max()
        assert psum_cuda == 0 and psum_xla == 0, f"step {n}: psum off by {psum_cuda} (cuda step), {psum_xla} (xla)"
        for m, name in enumerate(TOLERANCE):
            diff, ref = errors[:, 2 + 2 * m].max(), errors[:, 3 + 2 * m].max()
            assert ref > 0, f"step {n}: {name} of backend xla is all zero"
            assert diff <= TOLERANCE[name] * ref, f"step {n}: {name}: max |cuda - xla| = {diff}, max |xla| = {ref}"
            worst[name] = max(worst[name], float(diff / ref))
        times.append(time.perf_counter() - began)
    seconds = time.perf_counter() - start
    group.check()  # raises if a rank gave up waiting for a peer
    assert group.host_launches() > launches, "the cuda step launched no jax_ep kernel"
    later = f", then {1e3 * np.median(times[1:]):.1f} ms (median)" if len(times) > 1 else ""
    print(
        f"{steps} steps of both backends and their check in {seconds:.1f} s (the first {times[0]:.2f} s{later}); "
        f"worst relative differences: {worst}",
        flush=True,
    )
    jax_ep.finalize()
    print("OK", flush=True)


# ---------------------------------------------------------------------------------------------------------------------
# The test: one fresh process per mesh, under a wall-clock limit.


def _run_worker(mesh_name: str, log: Path, flags: str) -> tuple[int | None, str]:
    """The worker's exit code (None when it outran TIMEOUT_S and was killed) and its output."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_NVLS_ENABLE": "0"}
    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    command = [
        sys.executable,
        "-m",
        "tests.test_cuda_concurrency",
        mesh_name,
        "--steps",
        str(STEPS),
        "--guard-s",
        str(max(10.0, TIMEOUT_S - 20)),
    ]
    code, stdout, stderr = run_session(command, TIMEOUT_S, checkout_env(env))
    output = stderr + stdout  # stdout, which ends with "OK", last
    log.write_text(output)
    lines = [line for line in output.splitlines() if not line.lstrip().startswith("@ 0x")]
    return code, "\n".join(lines)


@pytest.mark.parametrize("mesh_name", list(MESHES))
def test_moe_exchange_next_to_a_large_all_reduce(mesh_name, tmp_path):
    """dispatch + combine (cuda) and a 256 MB psum in one jitted step, STEPS times: no hang, cuda == xla, right sums."""
    shape, _ = MESHES[mesh_name]
    have = len(gpu_devices())
    if have < math.prod(shape):
        pytest.skip(f"{mesh_name} needs {math.prod(shape)} GPUs, have {have}")
    code, out = _run_worker(mesh_name, tmp_path / f"{mesh_name}.log", LATENCY_HIDING)
    if code not in (0, None) and "Unknown flag" in out:
        print(f"this XLA does not know {LATENCY_HIDING}; again without it:\n{out[-2000:]}")
        code, out = _run_worker(mesh_name, tmp_path / f"{mesh_name}_plain.log", "")
    print(out[-6000:])
    assert code is not None, f"{mesh_name}: no result within {TIMEOUT_S} s (a hang?):\n{out[-6000:]}"
    assert code == 0 and out.rstrip().endswith("OK"), f"{mesh_name}: exit {code}:\n{out[-6000:]}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mesh", choices=list(MESHES))
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--guard-s", type=float, default=TIMEOUT_S - 20, help="dump every stack and exit after this")
    args = parser.parse_args()
    faulthandler.dump_traceback_later(args.guard_s, exit=True)
    work(args.mesh, args.steps)


if __name__ == "__main__":
    main()
