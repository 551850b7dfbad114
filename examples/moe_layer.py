"""An expert-parallel MoE layer with jax_ep, forward and backward, checked against a dense single-device layer.

    python examples/moe_layer.py

Runs on all GPUs when there are some, else on 8 simulated CPU devices. Each
device is one rank of the expert-parallel mesh axis "ep" and holds two experts.
Exits with status 1 if the outputs or gradients differ from the reference.
"""

import functools
import os
import sys

# Eight CPU devices when there is no GPU; the flag only sizes the CPU platform.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import AxisType  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402

TOKENS_PER_RANK, HIDDEN, FFN, TOPK = 64, 64, 128, 2
TOLERANCE = 1e-5  # max abs error relative to the reference's largest magnitude


def route(x: jax.Array, router: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-k softmax routing of ``x [T, H]``: weights ``[T, K]`` float32 and expert ids ``[T, K]`` int32."""
    weights, idx = jax.lax.top_k(jax.nn.softmax(x @ router), TOPK)
    return weights, idx.astype(jnp.int32)


def moe_layer(x: jax.Array, router: jax.Array, w_in: jax.Array, w_out: jax.Array, *, num_experts: int) -> jax.Array:
    """One rank of the layer, inside ``shard_map`` over "ep".

    ``x [T, H]`` this rank's tokens, ``router [H, E]``, ``w_in [L, H, F]`` and
    ``w_out [L, F, H]`` this rank's ``L`` experts; all float32. Returns ``[T, H]``.
    """
    weights, idx = route(x, router)
    d = jax_ep.dispatch(x, idx, weights, num_experts=num_experts, axis_name="ep")
    hidden = jax.nn.gelu(jax.lax.ragged_dot(d.x, w_in, d.group_sizes))  # [C, F]
    y = jax.lax.ragged_dot(hidden, w_out, d.group_sizes)  # [C, H]
    return jax_ep.combine(y, d.handle, weights=d.weights)


def dense_layer(x: jax.Array, router: jax.Array, w_in: jax.Array, w_out: jax.Array) -> jax.Array:
    """The same layer on one device: every expert on every token (``w_in [E, H, F]``, ``w_out [E, F, H]``)."""
    weights, idx = route(x, router)
    every = jnp.einsum("etf,efh->eth", jax.nn.gelu(jnp.einsum("th,ehf->etf", x, w_in)), w_out)  # [E, T, H]
    return jnp.einsum("tk,tkh->th", weights, every[idx, jnp.arange(x.shape[0])[:, None]])


def forward_backward(layer, args: tuple[jax.Array, ...], cotangent: jax.Array) -> tuple[jax.Array, ...]:
    """``layer(*args)`` and its gradients for the output cotangent."""
    out, vjp = jax.vjp(layer, *args)
    return (out, *vjp(cotangent))


def main() -> int:
    jax.config.update("jax_default_matmul_precision", "highest")  # no TF32 on GPUs: compare float32 math
    devices = jax.devices()
    ranks = len(devices)
    num_experts = 2 * ranks
    tokens = ranks * TOKENS_PER_RANK
    keys = jax.random.split(jax.random.key(0), 5)
    args = (
        jax.random.normal(keys[0], (tokens, HIDDEN)),
        jax.random.normal(keys[1], (HIDDEN, num_experts)) / HIDDEN**0.5,
        jax.random.normal(keys[2], (num_experts, HIDDEN, FFN)) / HIDDEN**0.5,
        jax.random.normal(keys[3], (num_experts, FFN, HIDDEN)) / FFN**0.5,
    )
    cotangent = jax.random.normal(keys[4], (tokens, HIDDEN))
    print(
        f"jax_ep MoE layer: {ranks} {devices[0].platform} devices, {num_experts} experts ({num_experts // ranks} "
        f"per rank), top-{TOPK}, {tokens} tokens, hidden {HIDDEN}, ffn {FFN}"
    )

    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(AxisType.Auto,))
    if devices[0].platform == "gpu" and jax_ep.cuda_available():  # backend "auto" then picks "cuda"
        jax_ep.initialize(mesh, "ep", num_tokens=TOKENS_PER_RANK, hidden=HIDDEN, topk=TOPK, num_experts=num_experts)
        print("  backend: cuda (NVLink peer stores)")
    else:
        print("  backend: xla")
    layer = jax.shard_map(
        functools.partial(moe_layer, num_experts=num_experts),
        mesh=mesh,
        in_specs=(P("ep"), P(), P("ep"), P("ep")),
        out_specs=P("ep"),
    )
    with jax.set_mesh(mesh):
        got = jax.jit(forward_backward, static_argnums=0)(layer, args, cotangent)
    single = jax.device_put((args, cotangent), devices[0])
    want = jax.jit(forward_backward, static_argnums=0)(dense_layer, *single)

    ok = True
    for name, a, b in zip(("out", "d x", "d router", "d w_in", "d w_out"), got, want, strict=True):
        a, b = np.asarray(a), np.asarray(b)
        error, scale = np.max(np.abs(a - b)), np.max(np.abs(b))
        ok &= error <= TOLERANCE * scale
        print(f"  {name:9s} max abs error {error:.2e}  (reference max {scale:.2e})")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
