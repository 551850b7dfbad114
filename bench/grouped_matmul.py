"""Time jax_ep.grouped_matmul (forward, dx, dw) against a dense batched einsum and jax.lax.ragged_dot.

python -m bench.grouped_matmul OUT.json [--shapes M,K,N,G ...] [--iters 20]
python -m bench.grouped_matmul OUT.json --sweep [--budget-s 120]   # tile sweep of the Mosaic kernels

Shapes (default: the three of issue 13): ``x [M, K]`` bf16, ``w [G, K, N]`` bf16, standard normal (w scaled by
1/sqrt(K)). Group sizes (:func:`group_sizes`): ``random``, the expert counts of M tokens routed uniformly at random
to G experts (``sum == M``), ``equal``, M/G rows each, and ``skewed``, ``random`` with a quarter of the rows moved to
group 0; ``--skews`` adds more (default :data:`SKEWS`: one group at about twice the mean, power laws whose largest
group is 2, 4 and 10 times the mean, Dirichlet(4)), each recorded with its largest group over the mean. On the
sizes past ``random`` and ``equal`` only :data:`SKEW_OPS` run: the user's ``fwd``, ``dx`` and ``dw``, the same on
the padded path past its rows too (``*_beyond``, :class:`jax_ep.gmm.grouped_matmul.Plan`'s ``beyond``, where a
padded size exists), and ``fwd_tokamax``, ``tokamax.ragged_dot``'s forward, where tokamax imports.
The dense reference is ``einsum('gmk,gkn->gmn')`` over G groups of M/G rows (same FLOPs); its gradients are
``einsum('gmn,gkn->gmk')`` (dx) and ``einsum('gmk,gmn->gkn')`` (dw). Each op is jitted alone. ``fwd``, ``dx``
and ``dw`` are what the custom VJP computes (``jax_ep.gmm.grouped_matmul.plan_for`` says which path each op
takes: a kernel, or the padded dense path where every group fits, ``random`` and ``equal`` sizes here); ``dx`` sets
rows past ``sum(group_sizes)`` to 0 (in place after its kernel; the padded path's row copy writes them).
``fwd_<kernel>`` and ``dx_<kernel>`` are the custom VJP's ops with one forward kernel alone and its own tiles
(``upstream``, ``tiles``, ``specialized``; :class:`jax_ep.gmm.grouped_matmul.Plan`'s ``rows``), ``dw_kernel`` dw's
kernel alone, and each of its kernels alone (``dw_pipelined``, ``dw_specialized``, where they fit), ``*_padded``
the padded dense path alone (``dw_padded_f32`` with a float32 output rounded after the GEMM), and
``*_padded_step16`` the padded path with its rows a group rounded to 16 instead of 32. The sampled check runs on the
default path, on the kernels alone, and on each other forward kernel. Where the padded path applies, its row copies
of ``x`` are timed too (``row_copies_ms``: ``jax_ep.gmm.row_copies`` against XLA's gathers). ``useful_fraction``: M
over the rows each path multiplies (the kernels' row tiles, the padded groups), the bound that padding puts on a
path's ratio to the einsum.
Time per call: the median over 5 batches of ``k`` back-to-back calls, each
batch ended by ``block_until_ready`` (``k`` = the iterations, fewer when outputs are large), after 2
warm-up calls. TFLOP/s count ``2 * M * K * N`` useful flops. jax.lax.ragged_dot is timed with fewer calls and
recorded as "oom" where XLA runs out of memory. A sampled check against float32 (rows of y and dx, two
groups of dw) runs first.

Writes OUT.json (command, commit from JAX_EP_COMMIT, device, jax version, numbers, ratios) and prints a
table last.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import inspect
import json
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jax_ep
from jax_ep.gmm import grouped_matmul as gm
from jax_ep.gmm import mosaic as mk
from jax_ep.gmm import padded as padded

SHAPES = ((32768, 7168, 2048, 32), (32768, 7168, 2048, 256), (8192, 4096, 1024, 64))
START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f} s] {message}", flush=True)


def provenance() -> dict:
    dev = jax.devices()[0]
    return {
        "command": os.environ.get("JAX_EP_COMMAND") or " ".join(["python", *sys.argv]),
        "commit": os.environ.get("JAX_EP_COMMIT", "unknown"),
        "device": getattr(dev, "device_kind", str(dev)),
        "compute_capability": str(getattr(dev, "compute_capability", "")),
        "jax": jax.__version__,
        "jaxlib": getattr(jax.lib, "__version__", None) or __import__("jaxlib").__version__,
    }


def api_probe() -> dict:
    """Signatures of the Pallas functions this code uses (upstream kernels too), to spot API drift."""
    from jax.experimental.pallas import mosaic_gpu as plgpu

    out = {}
    names = ["kernel", "nd_loop", "planar_snake", "emit_pipeline", "BlockSpec", "ACC", "SMEM", "commit_smem"]
    names += ["copy_smem_to_gmem", "wait_smem_to_gmem", "wgmma", "wgmma_wait", "transpose_ref", "layout_cast"]
    names += ["find_swizzle", "TilingTransform", "SwizzleTransform", "CompilerParams"]
    for name in names:
        try:
            out[f"plgpu.{name}"] = str(inspect.signature(getattr(plgpu, name)))
        except Exception as error:  # noqa: BLE001 - record whatever it is
            out[f"plgpu.{name}"] = f"unavailable: {error!r}"
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu

        out["ragged_dot_mgpu.ragged_dot"] = str(inspect.signature(ragged_dot_mgpu.ragged_dot))
        out["transposed_ragged_dot_mgpu.transposed_ragged_dot"] = str(
            inspect.signature(transposed_ragged_dot_mgpu.transposed_ragged_dot)
        )
    except Exception as error:  # noqa: BLE001
        out["upstream"] = f"unavailable: {error!r}"
    return out


KINDS = ("random", "equal", "skewed")
SKEW_OPS = ("fwd", "dx", "dw", "fwd_beyond", "dx_beyond", "dw_beyond", "fwd_tokamax")  # timed on every kind
# Skewed sizes (issue 50), timed for fwd, dx and dw beside tokamax's forward: one group at about twice the mean
# ("outsized"), a power law whose largest group is R times the mean ("max:R"), and Dirichlet(alpha) expert
# probabilities ("dirichlet:ALPHA").
SKEWS = ("outsized", "max:2", "max:4", "max:10", "dirichlet:4")


def group_sizes(kind: str, m: int, g: int, seed: int = 0) -> np.ndarray:
    """``g`` group sizes summing to ``m``:

    * ``equal``: M/G rows each; ``random``: M rows routed uniformly at random;
    * ``skewed``: ``random`` with a quarter of all rows moved to group 0 (more than the padded path's rows, so the
      kernels run);
    * ``outsized``: ``equal`` with group 0 holding ``2 * M/G + 6`` rows, taken evenly from the others (at M=32768,
      G=256: one group of 262 rows, the rest 127 or 128);
    * ``max:R``: group ``i`` gets a share proportional to ``(i + 1) ** -a``, ``a`` chosen so that the largest
      group is ``R`` times the mean (to within the rounding to whole rows), the others in decreasing order;
    * ``dirichlet:ALPHA``: a multinomial draw of M rows over probabilities drawn from Dirichlet(ALPHA, ..., ALPHA).
    """
    rng = np.random.default_rng(seed)
    name, _, value = kind.partition(":")
    if name == "equal":
        return _whole_rows(np.full(g, m / g), m)
    if name in ("random", "skewed"):
        sizes = np.bincount(rng.integers(0, g, m), minlength=g).astype(np.int32)
        if name == "skewed":
            moved = np.minimum(sizes[1:], -(-(m // 4) // (g - 1))) if g > 1 else sizes[1:]
            sizes[1:] -= moved
            sizes[0] += moved.sum()
        return sizes
    if name == "outsized":
        big = min(m, 2 * (m // g) + 6)
        return np.concatenate([[big], _whole_rows(np.full(g - 1, (m - big) / max(g - 1, 1)), m - big)]).astype(np.int32)
    if name == "max":
        return _whole_rows(m * _power_law(g, float(value)), m)
    if name == "dirichlet":
        return rng.multinomial(m, rng.dirichlet(np.full(g, float(value)))).astype(np.int32)
    raise ValueError(f"unknown group sizes {kind!r}: one of {KINDS + SKEWS}, or max:R, dirichlet:ALPHA")


def _whole_rows(shares: np.ndarray, m: int) -> np.ndarray:
    """``shares`` (summing to ``m``) as whole rows summing to ``m``: floors, and the rows left over one each to the
    largest remainders."""
    sizes = np.floor(shares).astype(np.int64)
    left = m - int(sizes.sum())
    sizes[np.argsort(sizes - shares, kind="stable")[:left]] += 1
    return sizes.astype(np.int32)


def _power_law(g: int, ratio: float) -> np.ndarray:
    """Shares ``p_i`` proportional to ``(i + 1) ** -a`` with ``max(p) / mean(p) = ratio`` (bisection on ``a``; the
    largest ratio there is, ``g``, at ``a`` large)."""
    if not 1 <= ratio <= g:
        raise ValueError(f"max:R needs 1 <= R <= G={g}, got {ratio}")
    rank = np.arange(1, g + 1, dtype=np.float64)

    def shares(a):
        p = rank**-a
        return p / p.sum()

    lo, hi = 0.0, 64.0
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if shares(mid)[0] * g < ratio else (lo, mid)
    return shares(hi)


def sizes_summary(sizes: np.ndarray) -> dict:
    """The largest group over the mean, and the empty groups."""
    mean = sizes.sum() / sizes.size
    return {
        "max": int(sizes.max()),
        "mean": float(mean),
        "max_over_mean": float(sizes.max() / mean),
        "empty": int((sizes == 0).sum()),
    }


def inputs(m: int, k: int, n: int, g: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (g, k, n), jnp.float32) / np.sqrt(k)).astype(jnp.bfloat16)
    dy = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    return x, w, dy


def out_bytes(out) -> int:
    return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(out))


def time_call(fn, args, iters: int, batches: int = 5) -> float:
    """Seconds per call of compiled ``fn``: median over batches of back-to-back calls (see the module doc)."""
    out = fn(*args)
    jax.block_until_ready(out)
    per_batch = max(1, min(iters, int(24e9 // max(out_bytes(out), 1))))
    del out
    for _ in range(2):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(batches):
        start = time.perf_counter()
        outs = [fn(*args) for _ in range(per_batch)]
        jax.block_until_ready(outs)
        times.append((time.perf_counter() - start) / per_batch)
        del outs
    return float(np.median(times))


def is_oom(error: Exception) -> bool:
    text = str(error)
    return "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "Out of memory" in text


def dense_fns():
    return {
        "fwd": jax.jit(lambda x, w: jnp.einsum("gmk,gkn->gmn", x, w)),
        "dx": jax.jit(lambda dy, w: jnp.einsum("gmn,gkn->gmk", dy, w)),
        "dw": jax.jit(lambda x, dy: jnp.einsum("gmk,gmn->gkn", x, dy)),
    }


def dense_args(x, w, dy, g):
    m = x.shape[0]
    xg, dyg = x.reshape(g, m // g, -1), dy.reshape(g, m // g, -1)
    return {"fwd": (xg, w), "dx": (dyg, w), "dw": (xg, dyg)}


def gmm_fns(plan: gm.Plan, x, w):
    """The custom VJP's three ops with ``plan`` (what users get), the forward and dx with each kernel alone and its
    own tiles (``*_upstream``, ``*_tiles``, ``*_specialized``, where they fit), and dw's kernel alone."""
    fns = {
        "fwd": jax.jit(lambda x, w, s: gm.custom_grouped_matmul(x, w, s, plan)),
        "dx": jax.jit(lambda dy, w, s: gm.dx_op(dy, w, s, plan)),
        "dw": jax.jit(lambda x, dy, s: gm.dw_op(x, dy, s, plan)),
        "dw_kernel": jax.jit(lambda x, dy, s: gm.dw_op(x, dy, s, plan._replace(padded=None))),
    }
    k, n = x.shape[1], w.shape[2]
    dw_kernels = {"pipelined": plan._replace(dw=gm._pick("dw", k, n), dw_specialized=False, padded=None)}
    if k % gm.SPECIALIZED.block_m == 0 and n % gm.SPECIALIZED.block_n == 0:
        specialized = gm._fitted(gm.SPECIALIZED, n)
        dw_kernels["specialized"] = plan._replace(dw=specialized, dw_specialized=True, padded=None)
    for kernel, alone in dw_kernels.items():
        if alone.dw is not None:
            fns[f"dw_{kernel}"] = jax.jit(lambda x, dy, s, p=alone: gm.dw_op(x, dy, s, p))
    for kernel in gm.ROWS_KERNELS:
        alone = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype, rows=kernel)
        if alone is not None:
            alone = alone._replace(padded=None)
            fns[f"fwd_{kernel}"] = jax.jit(lambda x, w, s, p=alone: gm.custom_grouped_matmul(x, w, s, p))
            fns[f"dx_{kernel}"] = jax.jit(lambda dy, w, s, p=alone: gm.dx_op(dy, w, s, p))
    if plan.padded is not None:  # the three ops on the padded path, past its rows too (Plan.beyond)
        beyond = plan._replace(padded_ops=("fwd", "dx", "dw"), beyond=True)
        fns["fwd_beyond"] = jax.jit(lambda x, w, s: gm.custom_grouped_matmul(x, w, s, beyond))
        fns["dx_beyond"] = jax.jit(lambda dy, w, s: gm.dx_op(dy, w, s, beyond))
        fns["dw_beyond"] = jax.jit(lambda x, dy, s: gm.dw_op(x, dy, s, beyond))
    return fns


def padded_fns(rows: int, suffix: str = ""):
    """The padded dense path alone with ``rows`` rows a group (every group must fit), and its dw with the output
    asked in float32 and rounded after the GEMM, as jax_ep did before, to see what that round trip costs."""

    def dw_f32(x, dy, s):
        xp, dyp = padded.pad(x, s, rows), padded.pad(dy, s, rows)
        return jnp.einsum("gck,gcn->gkn", xp, dyp, preferred_element_type=jnp.float32).astype(x.dtype)

    fns = {
        "fwd_padded": jax.jit(lambda x, w, s: padded.fwd(x, w, s, rows)),
        "dx_padded": jax.jit(lambda dy, w, s: padded.dx(dy, w, s, rows)),
        "dw_padded": jax.jit(lambda x, dy, s: padded.dw(x, dy, s, rows)),
    }
    if not suffix:
        fns["dw_padded_f32"] = jax.jit(dw_f32)
    return {name + suffix: fn for name, fn in fns.items()}


def time_row_copies(x, s, rows: int, iters: int) -> dict:
    """ms of the padded path's row copies of ``x`` (to ``[G, rows, K]`` and back), the kernels of
    ``jax_ep.gmm.row_copies`` against XLA's gathers, and whether both give the same bits."""
    p = padded.pad(x, s, rows)
    fns = {
        "pad": (jax.jit(lambda x, s: padded.pad(x, s, rows)), (x, s)),
        "pad_xla": (jax.jit(lambda x, s: padded._xla_pad(x, s, rows)), (x, s)),
        "unpad": (jax.jit(lambda p, s: padded.unpad(p, s, x.shape[0])), (p, s)),
        "unpad_xla": (jax.jit(lambda p, s: padded._xla_unpad(p, s, x.shape[0])), (p, s)),
    }
    out = {name: time_call(fn, args, iters) * 1e3 for name, (fn, args) in fns.items()}
    for name in ("pad", "unpad"):
        fn, args = fns[name]
        out[f"{name}_same_as_xla"] = bool(jnp.array_equal(fn(*args), fns[f"{name}_xla"][0](*args)))
    return out


def ragged_fns():
    def dx(x, w, s, dy):
        return jax.vjp(lambda a: jax.lax.ragged_dot(a, w, s), x)[1](dy)[0]

    def dw(x, w, s, dy):
        return jax.vjp(lambda b: jax.lax.ragged_dot(x, b, s), w)[1](dy)[0]

    return {"fwd": jax.jit(jax.lax.ragged_dot), "dx": jax.jit(dx), "dw": jax.jit(dw)}


def sampled_check(plan, x, w, dy, sizes) -> dict:
    """Relative max error of the kernels against float32 on 16 rows of y and dx (12 at random and the last 4 of the
    largest group, past the padded path's rows where it is larger) and on two groups of dw (the largest, the last)."""
    s = jnp.asarray(sizes)
    m = x.shape[0]
    total = int(sizes.sum())
    group_of_row = np.repeat(np.arange(len(sizes)), sizes)
    largest_end = int(np.cumsum(sizes)[int(np.argmax(sizes))])
    rows = np.unique(
        np.concatenate(
            [np.random.default_rng(1).choice(total, 12, replace=False), np.arange(largest_end - 4, largest_end)]
        )
    )
    fns = gmm_fns(plan, x, w)
    y = fns["fwd"](x, w, s)
    dx = fns["dx"](dy, w, s)
    dw = fns["dw"](x, dy, s)
    f32 = jnp.float32
    wr = w[group_of_row[rows]].astype(f32)
    y_ref = jnp.einsum("rk,rkn->rn", x[rows].astype(f32), wr)
    dx_ref = jnp.einsum("rn,rkn->rk", dy[rows].astype(f32), wr)
    out = {}
    out["y"] = float(jnp.abs(y[rows].astype(f32) - y_ref).max() / jnp.abs(y_ref).max())
    out["dx"] = float(jnp.abs(dx[rows].astype(f32) - dx_ref).max() / jnp.abs(dx_ref).max())
    starts = np.cumsum(sizes) - sizes
    errors = []
    for g in (int(np.argmax(sizes)), len(sizes) - 1):
        mask = (jnp.arange(m) >= starts[g]) & (jnp.arange(m) < starts[g] + sizes[g])
        xm = jnp.where(mask[:, None], x.astype(f32), 0)
        dym = jnp.where(mask[:, None], dy.astype(f32), 0)
        ref = xm.T @ dym
        errors.append(float(jnp.abs(dw[g].astype(f32) - ref).max() / jnp.abs(ref).max()))
    out["dw"] = max(errors)
    out["ok"] = all(v < 2e-2 for v in (out["y"], out["dx"], out["dw"]))
    return out


def useful_fraction(m: int, g: int, sizes: np.ndarray) -> dict:
    """M over the rows each path multiplies for these group sizes: the forward/dx kernels' row tiles of 64 and 128
    rows (every tile of the tile table is a whole tile of wgmma work), and the padded path's G groups of C rows."""
    out = {}
    for bm in (64, 128):
        *_, rows = mk.tile_table(jnp.asarray(sizes), bm, mk.num_row_tiles(m, g, bm))
        out[f"tiles_{bm}"] = m / (int(np.count_nonzero(np.asarray(rows))) * bm)
    c = padded.padded_rows(m, g)
    out["padded"] = None if c is None else m / (g * c)
    return out


def tokamax_ragged_dot():
    """``tokamax.ragged_dot`` and "", or None and why it is missing."""
    try:
        import tokamax
    except Exception as error:  # ImportError, or one of its own imports failing
        return None, f"tokamax does not import: {type(error).__name__}: {error}"
    return tokamax.ragged_dot, ""


def bench_shape(m, k, n, g, iters: int, ragged: bool, skews: tuple[str, ...] = SKEWS) -> dict:
    tflop = 2 * m * k * n / 1e12
    x, w, dy = inputs(m, k, n, g)
    plan = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype)
    row = {"M": m, "K": k, "N": n, "G": g}
    row["plan"] = {op: (b._asdict() if hasattr(b, "_asdict") else b) for op, b in plan._asdict().items()}
    row["errors"] = {}
    log(f"shape M={m} K={k} N={n} G={g}: plan {plan}")
    row["check"] = sampled_check(plan, x, w, dy, group_sizes("random", m, g))
    row["useful_fraction"] = useful_fraction(m, g, group_sizes("random", m, g))
    log(f"  useful fraction of the rows each path multiplies (random sizes): {row['useful_fraction']}")
    row["check_kernels"] = sampled_check(plan._replace(padded=None), x, w, dy, group_sizes("random", m, g))
    if plan.padded is not None:  # Plan.beyond with a group past the padded rows: the kernels over groups from starts
        beyond = plan._replace(padded_ops=("fwd", "dx", "dw"), beyond=True)
        row["check_beyond_max4"] = sampled_check(beyond, x, w, dy, group_sizes("max:4", m, g))
    for kernel in gm.ROWS_KERNELS:
        alone = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype, rows=kernel)
        if kernel != plan.rows and alone is not None:
            try:
                row[f"check_{kernel}"] = sampled_check(
                    alone._replace(padded=None), x, w, dy, group_sizes("random", m, g)
                )
            except Exception as error:  # noqa: BLE001 - another forward kernel failing is a result
                row["errors"][f"check_{kernel}"] = f"{type(error).__name__}: {str(error)[:400]}"
    log(f"  sampled checks { ({key: v for key, v in row.items() if key.startswith('check')}) } {row['errors']}")
    times = {}
    dargs = dense_args(x, w, dy, g)
    for op, fn in dense_fns().items():
        times[f"einsum_{op}"] = time_call(fn, dargs[op], iters)
    fns = gmm_fns(plan, x, w)
    rows = padded.padded_rows(m, g)
    if rows is not None:
        row["row_copies_ms"] = time_row_copies(x, jnp.asarray(group_sizes("random", m, g)), rows, iters)
        log(f"  row copies {row['row_copies_ms']}")
        fns.update(padded_fns(rows))
        rows16 = padded.padded_rows(m, g, step=16)  # never more than rows, so never None here
        if rows16 != rows and all(group_sizes(kind, m, g).max() <= rows16 for kind in ("random", "equal")):
            fns.update(padded_fns(rows16, "_step16"))
            row["padded_rows_step16"] = rows16
    tokamax_dot, tokamax_missing = tokamax_ragged_dot()
    if tokamax_dot is not None:
        fns["fwd_tokamax"] = jax.jit(lambda x, w, s: tokamax_dot(x, w, s))
    row["tokamax"] = tokamax_missing or "timed: fwd_tokamax"
    row["sizes"] = {}
    for kind in KINDS + tuple(skews):
        sizes = group_sizes(kind, m, g)
        row["sizes"][kind] = sizes_summary(sizes)
        s = jnp.asarray(sizes)
        for op, fn in fns.items():
            if kind not in ("random", "equal") and op not in SKEW_OPS:
                continue  # the kernels alone are timed on the other sizes, and the padded path needs them to fit
            args = (x, w, s) if op.startswith("fwd") else ((x, dy, s) if op.startswith("dw") else (dy, w, s))
            try:
                times[f"gmm_{op}_{kind}"] = time_call(fn, args, iters)
            except Exception as error:  # noqa: BLE001
                if op in ("fwd", "dx", "dw"):
                    raise
                row["errors"][f"gmm_{op}_{kind}"] = f"{type(error).__name__}: {str(error)[:400]}"
    log("  " + ", ".join(f"{name} {t * 1e3:.3f} ms" for name, t in times.items()))
    ragged_status = {}
    if ragged:
        s = jnp.asarray(group_sizes("random", m, g))
        for op, fn in ragged_fns().items():
            a = (x, w, s) if op == "fwd" else (x, w, s, dy)
            try:
                times[f"ragged_dot_{op}"] = time_call(fn, a, 2, batches=3)
                ragged_status[op] = "timed"
            except Exception as error:  # noqa: BLE001 - XLA's OOM comes as several exception types
                if not is_oom(error):
                    raise
                ragged_status[op] = "oom"
                log(f"  jax.lax.ragged_dot {op}: out of memory ({str(error).splitlines()[0][:200]})")
    row["ragged_dot"] = ragged_status
    row["ms"] = {name: t * 1e3 for name, t in times.items()}
    row["tflops"] = {name: tflop / t for name, t in times.items()}
    row["ratio_vs_einsum"] = {}
    for name, t in times.items():
        if name.startswith("einsum_"):
            continue
        op = "dx" if "_dx" in name else ("dw" if "_dw" in name else "fwd")  # gmm_<op>[_<kernel>]_<kind>
        row["ratio_vs_einsum"][name] = times[f"einsum_{op}"] / t
    # The forward pass against tokamax's on the same sizes: above 1, jax_ep is the faster.
    row["fwd_over_tokamax"] = {
        kind: times[f"gmm_fwd_tokamax_{kind}"] / times[f"gmm_fwd_{kind}"]
        for kind in row["sizes"]
        if f"gmm_fwd_tokamax_{kind}" in times
    }
    return row


OPS = ("fwd", "fwd_upstream", "fwd_tiles", "fwd_specialized", "fwd_padded")
OPS += ("dx", "dx_upstream", "dx_tiles", "dx_specialized", "dx_padded", "dw", "fwd_tokamax")
OPS += ("fwd_beyond", "dx_beyond", "dw_beyond")
OPS += (
    "dw_kernel",
    "dw_pipelined",
    "dw_specialized",
    "dw_padded",
    "dw_padded_f32",
    "fwd_padded_step16",
    "dx_padded_step16",
    "dw_padded_step16",
)


# The tile sweep.

SWEEP = {
    "fwd": [(128, 128, 64, 4, 1), (128, 128, 64, 4, 8), (128, 128, 64, 6, 16), (64, 256, 64, 4, 4)]
    + [(64, 128, 64, 5, 8)],
    "dw": [(128, 128, 64, 4, 1), (128, 128, 64, 4, 4), (64, 256, 64, 4, 1), (128, 128, 64, 2, 4)]
    + [(64, 128, 64, 6, 4)],
}
SWEEP["dx"] = SWEEP["fwd"]
ROWS_KERNELS = {"upstream": mk.upstream_ragged_dot, "tiles": mk.ragged_dot}


def sweep(shapes, budget_s: float, iters: int, ops=("fwd", "dx", "dw")) -> list[dict]:
    deadline = time.perf_counter() + budget_s
    jobs = []  # (shape, op, variant, blocks, fn, args)
    data = {}
    for m, k, n, g in shapes:
        x, w, dy = inputs(m, k, n, g)
        s = jnp.asarray(group_sizes("random", m, g))
        data[(m, k, n, g)] = (x, w, dy, s)
        dargs = dense_args(x, w, dy, g)
        for op, fn in dense_fns().items():
            jobs.append(((m, k, n, g), op, "einsum", None, fn, dargs[op]))
        for op, configs in ((op, c) for op, c in SWEEP.items() if op in ops):
            for cfg in configs:
                blocks = mk.Blocks(*cfg)
                if op == "dw":
                    fn = jax.jit(lambda x, dy, s, b=blocks: mk.transposed_ragged_dot(x, dy, s, b))
                    if k % blocks.block_m == 0 and n % blocks.block_n == 0:
                        jobs.append(((m, k, n, g), op, "jax_ep", blocks, fn, (x, dy, s)))
                    continue
                for variant, kernel in ROWS_KERNELS.items():
                    if op == "fwd":
                        fn = jax.jit(lambda x, w, s, b=blocks, f=kernel: f(x, w, s, b))
                        args, fits = (x, w, s), k % blocks.block_k == 0 and n % blocks.block_n == 0
                    else:
                        fn = jax.jit(lambda dy, w, s, b=blocks, f=kernel: f(dy, w, s, b, transpose_rhs=True))
                        args, fits = (dy, w, s), n % blocks.block_k == 0 and k % blocks.block_n == 0
                    if fits:
                        jobs.append(((m, k, n, g), op, variant, blocks, fn, args))
        jobs.extend(upstream_jobs((m, k, n, g), x, w, dy, s))

    def compile_job(job):
        shape, op, variant, blocks, fn, args = job
        if time.perf_counter() > deadline:
            return None, "skipped: budget"
        try:
            return fn.lower(*args).compile(), None
        except Exception as error:  # noqa: BLE001 - a tile that does not fit is a result, not a crash
            return None, f"{type(error).__name__}: {str(error)[:300]}"

    log(f"sweep: compiling {len(jobs)} jobs in 8 threads")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        compiled = list(pool.map(compile_job, jobs))
    log("sweep: compiled")
    results = []
    for job, (exe, error) in zip(jobs, compiled, strict=True):
        shape, op, variant, blocks, _, args = job
        entry = {"shape": shape, "op": op, "variant": variant, "blocks": blocks and list(blocks)}
        if exe is None:
            entry["error"] = error
        elif time.perf_counter() > deadline:
            entry["error"] = "skipped: budget"
        else:
            try:
                t = time_call(exe, args, iters, batches=3)
                entry["ms"] = t * 1e3
                entry["tflops"] = 2 * np.prod(shape[:3]) / t / 1e12
            except Exception as error:  # noqa: BLE001
                entry["error"] = f"{type(error).__name__}: {str(error)[:300]}"
        results.append(entry)
        log(f"  {shape} {op:3} {variant:8} {blocks and tuple(blocks)}: {entry.get('tflops', entry.get('error'))}")
    return results


def upstream_jobs(shape, x, w, dy, s):
    """JAX's transposed kernel (dw, 0/1 masks by multiplication: not NaN-safe) at one tile, for comparison."""
    try:
        from jax.experimental.pallas.ops.gpu import transposed_ragged_dot_mgpu
    except ImportError:
        return []
    kw = dict(block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1)
    dw = jax.jit(lambda x, dy, s: transposed_ragged_dot_mgpu.transposed_ragged_dot(x, dy, group_sizes=s, **kw))
    return [(shape, "dw", "upstream", mk.Blocks(128, 128, 64, 4, 1), dw, (x, dy, s))]


def best_of_sweep(results):
    best = {}
    for r in results:
        if "tflops" not in r or r["variant"] == "einsum" or (r["op"] == "dw" and r["variant"] == "upstream"):
            continue
        key = (tuple(r["shape"]), r["op"], r["variant"])
        if key not in best or r["tflops"] > best[key]["tflops"]:
            best[key] = r
    return best


def print_skews(rows: list[dict]) -> None:
    """The user's ops, the same past the padded rows (``_b``) and tokamax's forward by group sizes: ratio to the
    einsum, and jax_ep's forward against tokamax's."""
    print("\nratio to the einsum of the same op by group sizes; fwd/tokamax above 1: jax_ep's forward is the faster")
    head = f"{'M x K x N, G':24} {'sizes':12} {'max/mean':>8}"
    print(f"{head} {'fwd':>6} {'dx':>6} {'dw':>6} {'fwd_b':>6} {'dx_b':>6} {'dw_b':>6} {'tkmx':>6} {'fwd/tkmx':>6}")
    for r in rows:
        name = f"{r['M']}x{r['K']}x{r['N']}, {r['G']}"
        for kind, summary in r["sizes"].items():
            ratios = [r["ratio_vs_einsum"].get(f"gmm_{op}_{kind}") for op in SKEW_OPS]
            ratios.append(r["fwd_over_tokamax"].get(kind))
            cells = " ".join(f"{v:6.2f}" if v is not None else f"{'-':>6}" for v in ratios)
            print(f"{name:24} {kind:12} {summary['max_over_mean']:8.2f} {cells}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES])
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--budget-s", type=float, default=120.0)
    parser.add_argument("--sweep-ops", default="fwd,dx,dw", help="the ops the sweep tiles, a comma list")
    parser.add_argument("--no-ragged-dot", action="store_true", help="skip jax.lax.ragged_dot (slow)")
    parser.add_argument(
        "--skews", nargs="*", default=list(SKEWS), help="skewed group sizes timed for fwd, dx, dw and tokamax's fwd"
    )
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    for m, _, _, g in shapes:  # a bad name, or a skew a shape cannot have, fails here, before any timing
        for kind in args.skews:
            group_sizes(kind, m, g)
    payload = {**provenance(), "api": api_probe(), "hopper": gm.hopper_available()}
    log(f"{payload['device']} jax {payload['jax']}; hopper: {payload['hopper']}")
    for name, sig in payload["api"].items():
        print(f"  {name}{sig}")
    if not payload["hopper"]:
        raise SystemExit("needs a Hopper GPU")
    if args.sweep:
        results = sweep(shapes, args.budget_s, args.iters, tuple(args.sweep_ops.split(",")))
        payload["sweep"] = results
        args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        print("\nbest tiles per shape, op and kernel (TFLOP/s; the einsum of the same op for reference):")
        einsum = {(tuple(r["shape"]), r["op"]): r.get("tflops") for r in results if r["variant"] == "einsum"}
        for key, r in sorted(best_of_sweep(results).items()):
            e = einsum.get(key[:2])
            e = e and round(e, 1)
            print(f"  {key[0]} {key[1]:3} {key[2]:8}: {r['tflops']:6.1f} with {r['blocks']}  einsum {e}")
        return
    rows = []
    for shape in shapes:
        rows.append(bench_shape(*shape, iters=args.iters, ragged=not args.no_ragged_dot, skews=tuple(args.skews)))
        payload["results"] = rows
        args.out.write_text(json.dumps(payload, indent=1, default=str) + "\n")
    print(f"\nwrote {args.out}\nTFLOP/s (ratio to the einsum of the same op); group sizes random, equal, skewed:")
    head = f"{'M x K x N, G':24} {'op':12} {'einsum':>7} {'random':>15} {'equal':>15} {'skewed':>15}"
    print(f"{head} {'ragged_dot':>10}")
    for r in rows:
        name = f"{r['M']}x{r['K']}x{r['N']}, {r['G']}"
        tf, ratio = r["tflops"], r["ratio_vs_einsum"]
        for op in OPS:
            base = op.split("_")[0]
            rd = tf.get(f"ragged_dot_{op}")
            rd_text = f"{rd:10.1f}" if rd else f"{r['ragged_dot'].get(op, '-'):>10}"
            if f"gmm_{op}_random" not in tf:
                error = r["errors"].get(f"gmm_{op}_random")
                why = "not run (tokamax does not import)" if op == "fwd_tokamax" else "not run (groups do not fit)"
                print(f"{name:24} {op:12} " + (f"failed: {error[:60]}" if error else why))
                continue
            keys = [f"gmm_{op}_{kind}" for kind in KINDS]
            cells = [f"{tf[key]:7.1f} ({ratio[key]:4.2f})" if key in tf else " " * 15 for key in keys]
            print(f"{name:24} {op:12} {tf[f'einsum_{base}']:7.1f} {' '.join(cells)} {rd_text}")
    print_skews(rows)
    _ = jax_ep  # the package under test


if __name__ == "__main__":
    main()
