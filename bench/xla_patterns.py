"""The xla backend in the patterns consumers use, timed so that a regression shows (docs/performance.md).

    python -m bench.xla_patterns OUT.json [--tokens 128,4096] [--hidden 7168] [--platform gpu|cpu]

In an EP group of one device (mesh axis "ep"), backend "xla", K=8 of E=256, bf16, ragged layout, uniform routing
shifted by the iteration index (``bench.timing``): device µs of one step of each pattern, from jitted
``fori_loop``s (``seconds_per_call``). Each step ends in a float32 scalar that reads the whole result:

* ``dispatch_combine``: dispatch, then combine of the rows with ``weights=d.weights``;
* ``gather_k_rows``: dispatch, then each token's K rows of ``d.x`` gathered through ``handle.recv_rows`` and summed;
* ``segment_sum_rows``: dispatch, then ``d.x`` summed into tokens by ``handle.row_slot // K``;
* ``weights_per_token``: dispatch, then each token's K row weights gathered through ``recv_rows`` and summed.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--platform", default="gpu", choices=("gpu", "cpu"))
    args = parser.parse_args(argv)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax
    import jax.numpy as jnp

    import jax_ep
    from bench import timing
    from bench.record import provenance, write

    E, K = timing.EXPERTS, timing.TOPK
    kw = dict(num_experts=E, axis_name="ep", backend="xla")

    def dispatched(i, x, idx, w):
        return jax_ep.dispatch(x, (idx + i) % E, w, **kw)

    def dispatch_combine(i, x, idx, w):
        d = dispatched(i, x, idx, w)
        return jnp.sum(jax_ep.combine(d.x, d.handle, weights=d.weights).astype(jnp.float32))

    def gather_k_rows(i, x, idx, w):
        d = dispatched(i, x, idx, w)
        rows = d.handle.recv_rows.reshape(-1, K)
        got = jnp.take(d.x, jnp.where(rows < 0, d.x.shape[0], rows), axis=0, mode="fill", fill_value=0)
        return jnp.sum(got.astype(jnp.float32))

    def segment_sum_rows(i, x, idx, w):
        d = dispatched(i, x, idx, w)
        slot = d.handle.row_slot
        tokens = x.shape[0]
        segments = jnp.where(slot < 0, tokens, slot // K)
        return jnp.sum(jax.ops.segment_sum(d.x.astype(jnp.float32), segments, num_segments=tokens))

    def weights_per_token(i, x, idx, w):
        d = dispatched(i, x, idx, w)
        rows = d.handle.recv_rows.reshape(-1, K)
        got = jnp.take(d.weights, jnp.where(rows < 0, d.weights.shape[0], rows), axis=0, mode="fill", fill_value=0)
        return jnp.sum(jnp.sum(got, axis=1) * jnp.arange(rows.shape[0], dtype=jnp.float32))

    patterns = {f.__name__: f for f in (dispatch_combine, gather_k_rows, segment_sum_rows, weights_per_token)}
    device = jax.devices(args.platform)[0]
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=[device])
    payload = {
        **provenance("python -m bench.xla_patterns " + " ".join(argv)),
        "device": str(device),
        "hidden": args.hidden,
        "topk": K,
        "experts": E,
        "dtype": "bfloat16",
        "us": {},
    }
    with jax.set_mesh(mesh):
        for tokens in sorted(int(t) for t in args.tokens.split(",")):
            x, idx, w, _ = timing.make_inputs(1, tokens, args.hidden)
            for name, step in patterns.items():
                us = timing.seconds_per_call(step, (x, jnp.asarray(idx), w), args.iters) * 1e6
                payload["us"].setdefault(name, {})[tokens] = us
                timing.progress(f"{name} T={tokens}: {us:.1f} us")
    write(args.out, payload)
    tokens = sorted(int(t) for t in args.tokens.split(","))
    print(f"{'pattern (xla backend, µs)':>26} " + " ".join(f"{'T=' + str(t):>9}" for t in tokens))
    for name, row in payload["us"].items():
        print(f"{name:>26} " + " ".join(f"{row[t]:9.1f}" for t in tokens))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
