"""The MoE layer's training step against its baselines, in one process on one GPU.

python -m bench.moe_layer_baselines OUT.json [--experts 256 32] [--skews 1 2 4 10] [--tokens 4096 --hidden 7168
    --intermediate 2048 --topk 8] [--remat]

Each row times one jitted step, the forward and backward pass w.r.t. x and every weight, in bfloat16 with
gated SwiGLU experts, at one rank's size (T tokens, E experts, top-K, no shared expert):

* ``moe``: ``jax_ep.nn.MoE`` in an EP group of one GPU (backend cuda where the extension loads, else xla),
  ragged layout, ``capacity=None``, softmax router;
* ``dense``: the floor, a batched einsum of the same FLOPs: E experts of ``T*K/E`` rows each (gate, up,
  SwiGLU, down), no routing;
* ``sort_tokamax``: MaxText's sparse-matmul recipe, the same router, then argsort of the ``T*K`` slots by
  expert, a gather, ``tokamax.ragged_dot`` for gate, up and down, and a weighted unsort; skipped with the
  reason where tokamax does not import (``pip install ".[bench]"``);
* ``sort_jax_ep``: the same recipe with ``jax_ep.grouped_matmul``.

Each ``--skews`` value R is a routing whose busiest expert gets about R times the mean load (1: the tokens as drawn,
about uniform): the tokens are shifted along one fixed random direction, which biases each expert's router logit,
by the amount that bisection finds for R (bench/skewed_routing.py); each row records the load it got (largest over
mean, empty experts). Every row but ``dense`` is timed at every skew, with the same compiled step. A skew above
E/K, the most a top-K router can give one expert, is left out for that E and listed under ``skipped``.

With ``--remat`` the ``moe`` row also runs each ``remat`` choice of the layer. With ``--ablate``, ``moe_per_op``
runs it with each of the nine expert matmul ops choosing its own path (``jax_ep.gmm.mlp.FUSED = False``),
``moe_one_size`` with the expert MLP's padded path at its largest padded size only
(``jax_ep.gmm.padded.LADDER_SIZES = 1``), ``moe_no_beyond`` without the padded path past its rows
(``jax_ep.gmm.grouped_matmul.BEYOND_BY_DEFAULT = False``, which matters where an expert fits no padded size),
``moe_past_per_op`` with each op on its own path past every padded size (``jax_ep.gmm.mlp.PAST_ROWS_FUSED =
False``) and ``moe_beyond_64`` with up to 64 experts past the largest padded size on that path
(``jax_ep.gmm.grouped_matmul.BEYOND_GROUPS = 64``); ``--ablate NAME ...`` times only those. Time
per step: the median of 5 batches of back-to-back steps after 2 warm-ups, each batch ended by ``block_until_ready``
(bench/grouped_matmul.py's ``time_call``). The ratios are taken in this run: each row against ``dense``,
``sort_tokamax`` against ``moe``, and ``moe`` against its time at the first skew (``moe_over_first_skew``).
``--rows`` times only the rows named (``dense`` always), and OUT.json records the run's ``XLA_FLAGS``. TFLOP/s
counts the experts' matmul FLOPs of a step (3 matmuls forward, 6 backward, ``2*T*K*H*F`` each). Writes OUT.json
and prints a table last.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import jax_ep  # noqa: E402
import jax_ep.gmm.grouped_matmul  # noqa: E402
import jax_ep.gmm.mlp  # noqa: E402
import jax_ep.gmm.padded  # noqa: E402
import jax_ep.nn  # noqa: E402
from bench.grouped_matmul import time_call, tokamax_ragged_dot  # noqa: E402
from bench.record import provenance, write  # noqa: E402
from bench.skewed_routing import most_skew, router, skewed_tokens  # noqa: E402

ROWS = ("moe", "dense", "sort_jax_ep", "sort_tokamax")
# --ablate's rows: (name, module, attribute, value while timed).
ABLATIONS = (
    ("moe_per_op", jax_ep.gmm.mlp, "FUSED", False),
    ("moe_one_size", jax_ep.gmm.padded, "LADDER_SIZES", 1),
    ("moe_no_beyond", jax_ep.gmm.grouped_matmul, "BEYOND_BY_DEFAULT", False),
    ("moe_past_per_op", jax_ep.gmm.mlp, "PAST_ROWS_FUSED", False),
    ("moe_beyond_64", jax_ep.gmm.grouped_matmul, "BEYOND_GROUPS", 64),
)


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--experts", type=int, nargs="+", default=[256, 32])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument(
        "--skews", type=float, nargs="+", default=[1.0, 2.0, 4.0, 10.0], help="busiest expert's load over the mean"
    )
    parser.add_argument("--iters", type=int, default=10, help="steps per timed batch")
    parser.add_argument("--rows", nargs="+", choices=ROWS, default=list(ROWS), help="the rows to time (dense always)")
    parser.add_argument("--remat", action="store_true", help="also time MoE(remat=...) for each choice")
    parser.add_argument(
        "--ablate",
        nargs="*",
        choices=[name for name, *_ in ABLATIONS],
        default=None,
        help="also time the layer with these ablations (all without a name)",
    )
    return parser.parse_args()


def swiglu(x, w_gate, w_in, w_out, matmul):
    return matmul(jax.nn.silu(matmul(x, w_gate)) * matmul(x, w_in), w_out)


def sorted_recipe(ragged_dot, topk: int):
    """MaxText's sparse recipe: sort the slots by expert, three ragged matmuls, weighted unsort."""

    def layer(x, w_router, w_gate, w_in, w_out):
        weights, idx = router(x, w_router, topk)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat)
        rows = jnp.take(x, order // topk, axis=0)
        sizes = jnp.bincount(flat, length=w_gate.shape[0]).astype(jnp.int32)
        y = swiglu(rows, w_gate, w_in, w_out, lambda a, w: ragged_dot(a, w, sizes))
        unsorted = jnp.zeros_like(y).at[order].set(y).reshape(*idx.shape, -1)
        return jnp.einsum("tkh,tk->th", unsorted, weights.astype(y.dtype))

    return layer


def dense_floor(x, w_gate, w_in, w_out):
    """The experts' matmuls alone on E equal groups: ``x [E, T*K/E, H]``."""
    return swiglu(x, w_gate, w_in, w_out, lambda a, w: jnp.einsum("erh,ehf->erf", a, w))


def training_step(layer):
    """jit(grad) of ``sum(layer(*args) * c)`` w.r.t. every argument but the last (``c``)."""

    def loss(*args):
        *inputs, c = args
        return jnp.sum(layer(*inputs).astype(jnp.float32) * c)

    return jax.jit(lambda *args: jax.grad(loss, argnums=tuple(range(len(args) - 1)))(*args))


def weights(key, experts: int, hidden: int, intermediate: int):
    keys = jax.random.split(key, 4)
    w = lambda k, shape, fan: (jax.random.normal(k, shape) / np.sqrt(fan)).astype(jnp.bfloat16)  # noqa: E731
    return (
        (jax.random.normal(keys[0], (hidden, experts)) / np.sqrt(hidden)).astype(jnp.float32),
        w(keys[1], (experts, hidden, intermediate), hidden),
        w(keys[2], (experts, hidden, intermediate), hidden),
        w(keys[3], (experts, intermediate, hidden), intermediate),
    )


def moe_step(mesh, args, experts: int, remat, arrays):
    """The layer's step, its weights ``arrays`` (router, gate, up, down) shared with the other rows: on a GPU of
    80 GB, E=256's weights and gradients leave no room for a second copy."""
    layer = jax_ep.nn.MoE(
        args.hidden,
        args.intermediate,
        num_experts=experts,
        topk=args.topk,
        mesh=mesh,
        param_dtype=jnp.bfloat16,
        remat=remat,
        rngs=nnx.Rngs(0),
    )
    params = (layer.router_kernel, layer.experts.w_gate, layer.experts.w_in, layer.experts.w_out)
    for param, array in zip(params, arrays, strict=True):
        param.value = array
    graphdef, params = nnx.split(layer)

    def loss(params, x, c):
        out = nnx.merge(graphdef, params)(x)
        return jnp.sum(out.out.astype(jnp.float32) * c) + 0.01 * out.aux_loss

    return jax.jit(jax.grad(loss, argnums=(0, 1))), params


def main() -> None:
    args = parse_args()
    device = jax.devices()[0]
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=[device])
    backend = "cuda" if jax_ep.cuda_available() else "xla"
    tokamax_dot, tokamax_missing = tokamax_ragged_dot()
    t, h, f, k = args.tokens, args.hidden, args.intermediate, args.topk
    key = jax.random.key(0)
    x = jax.random.normal(key, (t, h)).astype(jnp.bfloat16)
    c = jax.random.normal(jax.random.key(1), (t, h))
    flops = 9 * 2 * t * k * h * f
    remats = (None, "full", "handle", "rows") if args.remat else (None,)
    ablations = () if args.ablate is None else [a for a in ABLATIONS if not args.ablate or a[0] in args.ablate]
    if "moe" not in args.rows:
        remats, ablations = (), ()
    rows, skipped = [], []  # skipped: the skews a router of E experts cannot give
    for experts in args.experts:
        arrays = weights(jax.random.key(2), experts, h, f)
        w_router, w_gate, w_in, w_out = arrays
        skews = [target for target in args.skews if target <= most_skew(experts, k)]
        for target in sorted(set(args.skews) - set(skews)):
            skipped.append({"experts": experts, "skew": target, "why": f"above E/K = {most_skew(experts, k):g}"})
        skewed = [skewed_tokens(x, w_router, k, target) for target in skews]
        times = [{} for _ in skewed]  # per skew: row name -> seconds
        if backend == "cuda":
            jax_ep.initialize(mesh, "ep", num_tokens=t, hidden=h, topk=k, num_experts=experts, dtype=jnp.bfloat16)
        try:
            for remat in remats:
                step, params = moe_step(mesh, args, experts, remat, arrays)
                for (xs, _), at in zip(skewed, times, strict=True):
                    at["moe" if remat is None else f"moe_remat_{remat}"] = time_call(step, (params, xs, c), args.iters)
            for name, module, attribute, value in ablations:
                kept = getattr(module, attribute)
                setattr(module, attribute, value)
                try:
                    step, params = moe_step(mesh, args, experts, None, arrays)
                    for (xs, _), at in zip(skewed, times, strict=True):
                        at[name] = time_call(step, (params, xs, c), args.iters)
                finally:
                    setattr(module, attribute, kept)
        finally:
            if backend == "cuda":
                jax_ep.finalize()
        per_expert = t * k // experts
        xd = jax.random.normal(key, (experts, per_expert, h)).astype(jnp.bfloat16)
        cd = jax.random.normal(jax.random.key(1), (experts, per_expert, h))
        dense = time_call(training_step(dense_floor), (xd, w_gate, w_in, w_out, cd), args.iters)
        recipes = {}
        if "sort_jax_ep" in args.rows:
            recipes["sort_jax_ep"] = training_step(sorted_recipe(lambda a, w, s: jax_ep.grouped_matmul(a, w, s), k))
        if tokamax_dot is not None and "sort_tokamax" in args.rows:
            recipes["sort_tokamax"] = training_step(sorted_recipe(tokamax_dot, k))
        for (xs, routing), at, target in zip(skewed, times, skews, strict=True):
            at["dense"] = dense
            for name, step in recipes.items():
                at[name] = time_call(step, (xs, w_router, w_gate, w_in, w_out, c), args.iters)
            row = {
                "experts": experts,
                "skew": target,
                "routing": routing,  # shift, max_over_mean, empty
                "ms": {name: 1e3 * s for name, s in at.items()},
                "expert_tflops": {name: flops / s / 1e12 for name, s in at.items()},
                "over_dense": {name: s / dense for name, s in at.items()},
            }
            if "sort_tokamax" in at and "moe" in at:
                row["tokamax_over_moe"] = at["sort_tokamax"] / at["moe"]
            if "moe" in at and "moe" in times[0]:
                row["moe_over_first_skew"] = at["moe"] / times[0]["moe"]
            rows.append(row)
    payload = {
        **provenance("python -m bench.moe_layer_baselines " + " ".join(sys.argv[1:])),
        "backend": backend,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "shape": {"tokens": t, "hidden": h, "intermediate": f, "topk": k, "dtype": "bfloat16"},
        "tokamax": tokamax_missing or __import__("tokamax").__version__,
        "rows": rows,
        "skipped": skipped,
    }
    write(args.out, payload)
    print(f"\nbackend {backend}, T={t} H={h} F={f} K={k} bf16; tokamax: {payload['tokamax']}")
    print(f"{'E':>4} {'skew':>5} {'row':<18} {'ms':>8} {'TFLOP/s':>8} {'/dense':>7}")
    for row in rows:
        e, routing = row["experts"], row["routing"]
        print(
            f"{e:>4} {row['skew']:5.1f} routing: busiest expert {routing['max_over_mean']:.2f}x the mean, "
            f"{routing['empty']} experts empty (shift {routing['shift']:.3g})"
        )
        for name, ms in row["ms"].items():
            tf, over = row["expert_tflops"][name], row["over_dense"][name]
            print(f"{e:>4} {row['skew']:5.1f} {name:<18} {ms:8.2f} {tf:8.0f} {over:7.2f}")
        for key in ("tokamax_over_moe", "moe_over_first_skew"):
            if key in row:
                print(f"{e:>4} {row['skew']:5.1f} {key} = {row[key]:.2f}")
    for skip in skipped:
        print(f"{skip['experts']:>4} {skip['skew']:5.1f} not timed: {skip['why']}")


if __name__ == "__main__":
    main()
