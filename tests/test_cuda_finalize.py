"""jax_ep.finalize right after 20 training steps that were never waited for (JAX dispatches asynchronously): the
steps finish as they would have (their results match backend "xla"), the same jitted function called after finalize
is traced again and fails with an error that says to initialize, after initialize again it runs for the new group,
and compute-sanitizer's memcheck finds no access of jax_ep's kernels to memory finalize freed.

The case runs in fresh processes: once as a user runs it (XLA's command buffers on), and, where compute-sanitizer
is found, once more under its memcheck with XLA's command buffers and autotuning off (docs/cuda_backend.md, "What
finalize guarantees", tells how memcheck runs went on one H100). XLA compiles slowly under memcheck (one of the
case's programs took more than 150 s on one H100), so a run without memcheck first fills a compilation cache that
the run under memcheck reads. Run it by hand with ``python -m tests.test_cuda_finalize [HANG_S]`` from the checkout.
"""

import faulthandler
import os
import shutil
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from tests.gpu import require_cuda

pytestmark = require_cuda()
STEPS, TOKENS, HIDDEN, TOPK, EXPERTS = 20, 64, 256, 4, 16


def _step(backend: str):
    import jax_ep

    def loss(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=EXPERTS, axis_name="ep", backend=backend)
        held = (jnp.arange(d.x.shape[0]) < jnp.sum(d.group_sizes))[:, None]
        y = jnp.where(held, jnp.tanh(jnp.where(held, d.x, 0)), 0)
        return jnp.sum(jax_ep.combine(y, d.handle, weights=d.weights) ** 2)

    def body(x, idx, w):
        value, (dx, dw) = jax.value_and_grad(loss, argnums=(0, 2))(x, idx, w)
        return value[None], dx, dw

    return jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))


HANG_S = 150  # a case still running after this long prints every thread's stack and exits (argv[1] overrides)


def main() -> None:
    import jax_ep

    faulthandler.enable()  # a crash prints every thread's Python stack
    faulthandler.dump_traceback_later(float(sys.argv[1]) if len(sys.argv) > 1 else HANG_S, exit=True)

    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("gpu")[:1])
    jax_ep.initialize(mesh, "ep", num_tokens=TOKENS, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((TOKENS, HIDDEN)), jnp.float32)
    idx = jnp.asarray(np.stack([rng.permutation(EXPERTS)[:TOPK] for _ in range(TOKENS)]), jnp.int32)
    w = jnp.asarray(rng.random((TOKENS, TOPK)) + 0.1, jnp.float32)
    scales = [1 + i / STEPS for i in range(STEPS)]
    with jax.set_mesh(mesh):
        cuda, xla = _step("cuda"), _step("xla")
        wants = [jax.device_get(xla(x * scale, idx, w)) for scale in scales]  # nothing compiles after finalize
        jax.block_until_ready(cuda(x, idx, w))  # compiled, and the group's first call made
        results = [cuda(x * scale, idx, w) for scale in scales]  # never waited for
        jax_ep.finalize()
        print("finalized after the steps were dispatched", flush=True)
        for got, want in zip(results, wants, strict=True):
            for a, b in zip(got, want, strict=True):
                np.testing.assert_allclose(np.asarray(a), b, rtol=1e-5, atol=1e-5)
        print(f"{STEPS} steps dispatched before finalize match backend xla", flush=True)
        try:
            jax.block_until_ready(cuda(x, idx, w))
        except ValueError as error:  # traced again (finalize cleared JAX's caches), and no group is found
            assert "call jax_ep.initialize" in str(error), error
            print(f"a call after finalize failed as expected: {str(error)[:200]}", flush=True)
        else:
            raise AssertionError("a call after finalize ran")
        jax_ep.initialize(mesh, "ep", num_tokens=TOKENS, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS)
        for i in range(3):  # the same jitted function, traced again for the new group
            for a, b in zip(cuda(x * (2 + i), idx, w), xla(x * (2 + i), idx, w), strict=True):
                np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
        print("the same function after initialize again matches backend xla", flush=True)
        jax_ep.finalize()
    faulthandler.cancel_dump_traceback_later()
    print("OK", flush=True)


def _case(command: list[str], xla_flags: str = "", cache: Path | None = None, hang_s: float = HANG_S) -> str:
    """Runs the case in a fresh process (``command`` before ``python -m``), with JAX's compilation cache in ``cache``
    where given; its output, after checking it passed."""
    from bench.multiprocess import checkout_env, run_session

    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_NVLS_ENABLE": "0"}
    if xla_flags:
        env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
    if cache is not None:  # every program, however fast it compiled
        env.update(
            JAX_COMPILATION_CACHE_DIR=str(cache),
            JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
            JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="0",
        )
    command = [*command, sys.executable, "-m", "tests.test_cuda_finalize", str(hang_s)]
    status, stdout, stderr = run_session(command, hang_s + 60, checkout_env(env))
    output = stdout[-6000:] + stderr[-4000:]
    print(" ".join(command), xla_flags, "\n", output)
    assert status == 0, output
    assert f"{STEPS} steps dispatched before finalize match backend xla" in stdout, output
    assert "a call after finalize failed as expected" in stdout, output
    assert "the same function after initialize again matches backend xla" in stdout, output
    return output


def test_finalize_right_after_steps_that_were_never_waited_for():
    _case([])


def test_finalize_frees_nothing_a_kernel_still_reads_under_memcheck(tmp_path):
    sanitizer = shutil.which("compute-sanitizer")
    if not sanitizer:
        pytest.skip("compute-sanitizer is not on PATH")
    memcheck = [sanitizer, "--tool", "memcheck", "--kernel-name", "kns=jax_ep", "--error-exitcode", "3"]
    flags = "--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"  # no autotuning kernels under memcheck
    _case([], flags, cache=tmp_path)  # compiles every program of the case into the cache, with memcheck's flags
    assert "ERROR SUMMARY: 0 errors" in _case(memcheck, flags, cache=tmp_path, hang_s=300)


if __name__ == "__main__":
    main()
