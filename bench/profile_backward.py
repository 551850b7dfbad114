"""The kernels of one gradient of dispatch -> combine (backend "cuda", an EP group of one GPU), for Nsight Compute.

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base \
        -k regex:CombineBackwardKernel --launch-skip 2 --launch-count 1 \
        python bench/profile_backward.py --tokens 4096 [--unused 0.5] [--alignment 8]

Runs ``jax.grad`` of ``sum(combine(d.x * 1.5, weights=d.weights) ** 2)`` w.r.t. ``x`` and ``topk_weights``
three times (H=7168, K=8, E=256, bf16, uniform routing from ``jax_ep.bench.timing.make_inputs``). Each call
launches the forward dispatch's kernels (``RoutingKernel`` unless a decode dispatch routes in its one kernel,
``DispatchKernel``) and ``CombineKernel``, then ``CombineBackwardKernel`` for combine's backward pass and
``CombineKernel`` again for dispatch's; the flags above keep the third call's backward kernel.

``--alignment A`` dispatches with ``expert_alignment=A`` (padding rows inside the data, which the dispatch and the
backward kernel zero). ``--unused F`` sets the slots k >= (1 - F) * K of every token to -1 (unused): the layout
(capacity=None) then has a ragged tail of that fraction of its rows, as an EP group of 1 / (1 - F) GPUs has with
balanced routing.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.bench.timing import EXPERTS, TOPK, make_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--unused", type=float, default=0.0, help="fraction of each token's slots set to -1")
    parser.add_argument("--alignment", type=int, default=1, help="dispatch's expert_alignment")
    args = parser.parse_args()
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("gpu")[:1])
    jax_ep.initialize(mesh, "ep", num_tokens=args.tokens, hidden=args.hidden, topk=TOPK, num_experts=EXPERTS)
    x, idx, w, _ = make_inputs(1, args.tokens, args.hidden)
    used = round((1 - args.unused) * TOPK)
    idx = jnp.where(jnp.arange(TOPK)[None, :] < used, jnp.asarray(idx), -1)

    def loss(x, w):
        def body(x, idx, w):
            d = jax_ep.dispatch(
                x, idx, w, num_experts=EXPERTS, axis_name="ep", expert_alignment=args.alignment, backend="cuda"
            )
            return jax_ep.combine(d.x * 1.5, d.handle, weights=d.weights)

        out = jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.set_mesh(mesh):
        grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
        for _ in range(3):
            jax.block_until_ready(grad(x, w))
    print(f"profile_backward: 3 gradient calls done, {used} of {TOPK} slots used per token")


if __name__ == "__main__":
    main()
