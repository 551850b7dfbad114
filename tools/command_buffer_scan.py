"""A jitted training step in ``lax.scan`` under XLA command buffers: backend "cuda" against a NumPy reference.

    python -m tools.command_buffer_scan        # JAX_EP_SCAN_RANKS GPUs (default 1) of this process
    JAX_EP_SCAN_SPLIT=1 python -m tools.command_buffer_scan   # with the split ops, a matmul between the halves
    JAX_EP_SCAN_RANKS=2 JAX_EP_SCAN_TRANSPORT=nccl python -m tools.command_buffer_scan   # every pair through NCCL

Each step dispatches this rank's tokens with a routing that changes every step, applies an elementwise expert (a
learned per-rank scale, on the rows of the data), combines, and updates the scale with the gradient of ``sum(c *
out)``. The script sets XLA_FLAGS so that XLA captures custom calls in command buffers (CUDA graphs) and checks
that it did: the FFI handlers run only when XLA records a graph, so they launch the calls fewer times than the
calls run ("captured: ..."). It compares every step's loss and the final scales with ``reference_scan`` (float64
NumPy over tests/reference.py) and, in one process, with backend "xla". tools/multiprocess_worker.py runs the
same scan with two processes sharing one GPU. With JAX_EP_SCAN_SPLIT=1 each step uses the split ops, with a
matmul ``x @ m`` (added to the output) pinned between dispatch_start and dispatch_finish by optimization
barriers. With JAX_EP_SCAN_TRANSPORT=nccl (2+ GPUs) every pair goes through NCCL, whose calls XLA must not
capture: the script then checks that none was captured (one host launch per call) and that the results still match.
"""

from __future__ import annotations

import os

COMMAND_BUFFER_FLAGS = (
    "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL,WHILE,CONDITIONAL --xla_gpu_graph_min_graph_size=1"
)
if __name__ == "__main__":
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {COMMAND_BUFFER_FLAGS}"
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

STEPS, TOKENS, HIDDEN, TOPK, EXPERTS, LR = 200, 64, 256, 4, 16, 1e-3
SPLIT = os.environ.get("JAX_EP_SCAN_SPLIT") == "1"
TRANSPORT = os.environ.get("JAX_EP_SCAN_TRANSPORT", "auto")  # jax_ep.initialize's
CALLS_PER_STEP = 6 if SPLIT else 3  # dispatch, combine, combine's backward pass (each in two halves when split)


def inputs(ranks: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Every rank's tokens, routing, weights, loss cotangent and starting scales, stacked over ranks."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((ranks * TOKENS, HIDDEN)).astype(np.float32)
    idx = rng.integers(0, EXPERTS, (ranks * TOKENS, TOPK)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[:, -1] = idx[:, 0]  # duplicates
    w = (rng.random((ranks * TOKENS, TOPK)) + 0.1).astype(np.float32)
    c = rng.standard_normal((ranks * TOKENS, HIDDEN)).astype(np.float32)
    scale = (1 + 0.1 * rng.standard_normal((ranks, HIDDEN))).astype(np.float32)
    m = (rng.standard_normal((HIDDEN, HIDDEN)) / HIDDEN).astype(np.float32) if SPLIT else np.zeros((1, 1), np.float32)
    return {"x": x, "idx": idx, "w": w, "c": c, "scale": scale, "m": m}


ARGS = ("x", "idx", "w", "c", "scale", "m")


def routing_at(idx, step):
    """Step ``step``'s routing: every valid id moves on by 3 * step (mod E); -1 stays."""
    return (
        np.where(idx < 0, -1, (idx + 3 * step) % EXPERTS)
        if isinstance(idx, np.ndarray)
        else jnp.where(idx < 0, -1, (idx + 3 * step) % EXPERTS)
    )


def scan_fn(backend: str):
    """The per-rank scan: returns (losses [1, STEPS], final scale [1, H]); collectives only through jax_ep."""
    import jax_ep

    def expert(d, scale):
        """The scale on the rows of the data. The ragged tails of d.x and of combine's dy may hold anything, NaN
        included, so a parameter whose gradient sums over the rows must see neither: d.x is masked before the
        product (0 * NaN is NaN) and the product after it (its cotangent is dy)."""
        held = (jnp.arange(d.x.shape[0]) < jnp.sum(d.group_sizes))[:, None]
        return jnp.where(held, jnp.where(held, d.x, 0) * scale, 0).astype(d.x.dtype)

    def rank_loss(scale, x, idx, w, m):
        if not SPLIT:
            d = jax_ep.dispatch(x, idx, w, num_experts=EXPERTS, axis_name="ep", backend=backend)
            return jax_ep.combine(expert(d, scale), d.handle, weights=d.weights)
        pending = jax_ep.dispatch_start(x, idx, w, num_experts=EXPERTS, axis_name="ep", backend=backend)
        x_side, pending = jax.lax.optimization_barrier((x, pending))
        side, pending = jax.lax.optimization_barrier((x_side @ m, pending))
        d = jax_ep.dispatch_finish(pending)
        return jax_ep.combine_finish(jax_ep.combine_start(expert(d, scale), d.handle, weights=d.weights)) + side

    def body(x, idx, w, c, scale, m):
        def step(scale, s):
            xs = x * (1 + s.astype(jnp.float32) / STEPS)
            out, pullback = jax.vjp(lambda sc: rank_loss(sc, xs, routing_at(idx, s), w, m), scale)
            (dscale,) = pullback(c)
            return scale - LR * dscale, jnp.sum(out * c)

        scale, losses = jax.lax.scan(step, scale[0], jnp.arange(STEPS))
        return losses[None], scale[None]

    in_specs = (P("ep"),) * 5 + (P(),)
    return jax.jit(jax.shard_map(body, in_specs=in_specs, out_specs=P("ep")))


def reference_scan(data: dict[str, np.ndarray], ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The same scan in float64 NumPy over tests/reference.py: losses [R, STEPS] and final scales [R, H]."""
    from tests import reference

    stack = lambda a: a.reshape(ranks, TOKENS, -1)  # noqa: E731
    x0, w, c = stack(data["x"]).astype(np.float64), stack(data["w"]), stack(data["c"]).astype(np.float64)
    scale = data["scale"].astype(np.float64)
    losses = np.zeros((ranks, STEPS))
    for s in range(STEPS):
        xs = x0 * (1 + s / STEPS)
        ref = reference.dispatch(xs, stack(routing_at(data["idx"], s)), w, num_experts=EXPERTS)
        y = ref.x * scale[:, None, :]
        out = reference.combine(ref, y, ref.weights) + (xs @ data["m"].astype(np.float64) if SPLIT else 0.0)
        losses[:, s] = np.sum(out * c, axis=(1, 2))
        dy, _ = reference.combine_vjp(ref, y, ref.weights, c)
        scale = scale - LR * np.sum(dy * ref.x, axis=1)
    return losses, scale


def launches_per_call(group, run) -> tuple[int, int]:
    """Host launches of the group's calls while ``run()`` executes, and the calls it makes."""
    before = group.host_launches()
    run()
    return group.host_launches() - before, CALLS_PER_STEP * STEPS


def main() -> None:
    import jax_ep

    ranks = int(os.environ.get("JAX_EP_SCAN_RANKS", "1"))
    devices = jax.devices("gpu")[:ranks]
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    sizes = dict(num_tokens=TOKENS, hidden=HIDDEN, topk=TOPK, num_experts=EXPERTS)
    group = jax_ep.initialize(mesh, "ep", **sizes, transport=TRANSPORT)
    data = inputs(ranks)
    args = [jnp.asarray(data[k]) for k in ARGS]
    with jax.set_mesh(mesh):
        compiled = scan_fn("cuda").lower(*args).compile()
        jax.block_until_ready(compiled(*args))  # the first run records the command buffers
        result = []
        launches, calls = launches_per_call(group, lambda: result.extend(jax.block_until_ready(compiled(*args))))
        print(f"captured: {launches} host launches for {calls} calls per GPU", flush=True)
        losses, scale = (np.asarray(a) for a in result)
        xla_losses, xla_scale = (np.asarray(a) for a in scan_fn("xla")(*args))
    jax_ep.finalize()
    want_losses, want_scale = reference_scan(data, ranks)
    np.testing.assert_allclose(losses, want_losses, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(scale, want_scale, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(losses, xla_losses, rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(scale, xla_scale, rtol=1e-4, atol=1e-5)
    assert len(set(losses[0].round(3).tolist())) > STEPS // 2  # the routing and data changed every step
    if group.uses_nccl():
        assert launches == calls * ranks, f"calls of a group that talks NCCL were captured: {launches} launches"
    else:
        assert launches < calls * ranks, "the calls were not captured in command buffers"
    mode = "split ops, a matmul between the halves" if SPLIT else "whole ops"
    print(
        f"{STEPS} steps on {ranks} GPU(s), {mode}, transport {TRANSPORT}: losses and scales match the reference and "
        "backend xla",
        flush=True,
    )
    print("OK", flush=True)


if __name__ == "__main__":
    main()
