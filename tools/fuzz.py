"""Fuzz jax_ep's dispatch and combine against the NumPy reference of the contract (tests/reference.py).

Run from the checkout's root::

    python -m tools.fuzz [--cases N] [--seed S] [--ranks 1,2,4,8] [--buckets B] [--out results.json] [--backend xla]
    python -m tools.fuzz --replay SEED             # rerun one case, print its config and every mismatch
    python -m tools.fuzz --merge a.json b.json --out all.json   # one report from several runs
    python -m tools.fuzz --platform gpu --backend cuda --ranks 1 --cases N --out r.json  # on GPUs (R <= GPUs)
    python -m tools.fuzz --platform gpu --backend cuda --processes 2 --cases N --out r.json  # R=2, both on GPU 0
    python -m tools.fuzz --platform gpu --backend cuda --ranks 2 --transport nccl ...  # every pair through NCCL

Every case is named by one integer seed that fixes everything about it (see :func:`encode_seed`):
the campaign seed, ``R``, the shape bucket and the case's index. Shapes come from a few fixed buckets per
``R`` (``T, H, H', K, E, layout, capacity, alignment, dtypes, partial_dtype, drop_policy``, drawn from the campaign
seed), so each bucket compiles once; each case draws its own data and routing. Per case it checks, on the
8-device simulated CPU mesh (``--platform gpu``: on the first R GPUs, where backend "cuda" gets one
``jax_ep.initialize`` sized for every bucket):

* dispatch: ``group_sizes``, ``num_dropped``, ``num_invalid``, ``expert_load`` and ``weights`` bit for bit, and
  ``x`` bit for bit on the specified rows (the ragged layout's rows past ``sum(group_sizes)`` are unspecified);
* combine, with given weights and with none: within the rounding of the contract's summation order
  against the float64 sum, and bit for bit against ``reference.combine_ordered`` when every product is
  exact in float32 (half the cases);
* dispatch's VJP (``dx`` bit for bit against ``combine_ordered``, as the contract defines it, and within
  rounding of the float64 sum; ``dtopk_weights`` bit for bit) and combine's VJP (``dy`` and ``dweights``
  within rounding of the float64 values on the specified rows; ``dy`` without weights bit for bit);
* for a tenth of the cases, that a second run gives the same bits.

Rows that hold no slot are filled with NaN/inf in ``y``, the row weights and the cotangents in half the
cases (nothing may read them). The exit status is 1 if any case mismatched.
"""

from __future__ import annotations

import os
import sys

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}".strip()
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import collections  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import jax_ep  # noqa: E402
from bench.record import SOURCES, sources  # noqa: E402
from tests import reference  # noqa: E402
from tests.conftest import cpu_mesh  # noqa: E402
from tests.helpers import (  # noqa: E402
    AXIS,
    INVALID_IDS,
    assert_sum_close,
    ep_jit,
    gpu_mesh,
    specified,
    to_numpy,
)

DTYPES = ("float32", "bfloat16", "float16")
DROP_POLICIES = reference.DROP_POLICIES
UNIT = {"float32": 2.0**-24, "bfloat16": 2.0**-8, "float16": 2.0**-11}  # unit roundoff
F32 = UNIT["float32"]
ROUTINGS = {  # kind: probability
    "distinct": 0.18,  # distinct uniform experts per token, a few -1
    "mixed": 0.18,  # each token of one of the kinds below
    "invalid": 0.14,  # ids in [-1, E) with E, E+7, -5 and extreme ints mixed in
    "repeat": 0.12,  # distinct, then the same expert twice in half the tokens
    "rank": 0.10,  # every token on the experts of one rank (K > L gives -1 padding)
    "hot": 0.08,  # every slot on one expert
    "hot_slot": 0.07,  # slot 0 of every token on one expert, the rest distinct
    "random": 0.07,  # ids in [-1, E) with repeats
    "unused": 0.06,  # every slot -1
}
PLATFORMS = ("cpu", "gpu")
# The largest bucket sizes draw_bucket can give (T, H and H', K, E): what a cuda group must hold.
MAX_BUCKET = dict(num_tokens=64, hidden=300, topk=16, num_experts=512)
ROWS_BUDGET = 2**21  # R * N * max(H, H') elements of a layout-shaped array, to keep cases cheap on 2 cores
SEED_BASE = (10**10, 10**8, 10**6)  # seed = campaign * 1e10 + R * 1e8 + bucket * 1e6 + index
SEED_FORMAT = (
    "case seed = campaign * 10**10 + R * 10**8 + bucket * 10**6 + index; a bucket's seeds are listed, or given as "
    "first..last (every integer between); replay one case with: python -m tools.fuzz --replay SEED"
)


# ---------------------------------------------------------------------------------------------------------------------
# Seeds, buckets and cases.


def encode_seed(campaign: int, num_ranks: int, bucket: int, index: int) -> int:
    """The seed of case ``index`` of ``bucket`` for ``R = num_ranks`` in campaign ``campaign``.

    Readable in decimal: ``campaign | RR | BB | IIIIII`` (``1_08_03_000017`` is campaign 1, R=8, bucket 3,
    case 17).
    """
    assert campaign >= 0 and 0 < num_ranks < 100 and 0 <= bucket < 100 and 0 <= index < SEED_BASE[2]
    return campaign * SEED_BASE[0] + num_ranks * SEED_BASE[1] + bucket * SEED_BASE[2] + index


def decode_seed(seed: int) -> tuple[int, int, int, int]:
    """``(campaign, R, bucket, index)`` of a case seed."""
    return (
        seed // SEED_BASE[0],
        seed % SEED_BASE[0] // SEED_BASE[1],
        seed % SEED_BASE[1] // SEED_BASE[2],
        (seed % SEED_BASE[2]),
    )


@dataclasses.dataclass(frozen=True)
class Bucket:
    """The static configuration of a case: one compiled program serves every case of a bucket."""

    num_ranks: int
    num_tokens: int  # T
    hidden: int  # H of x
    y_hidden: int  # H' of y
    topk: int  # K
    num_experts: int  # E
    layout: str
    capacity: int | None
    expert_alignment: int
    x_dtype: str
    y_dtype: str
    partial_dtype: str | None  # None (y's dtype) or "float32"
    weights_dtype: str = "float32"  # of the row weights given to combine
    backend: str = "xla"
    drop_policy: str = "balanced"

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.num_ranks

    @property
    def default_capacity(self) -> int:
        return reference.default_capacity(
            num_ranks=self.num_ranks,
            num_tokens=self.num_tokens,
            topk=self.topk,
            num_experts=self.num_experts,
            layout=self.layout,
            alignment=self.expert_alignment,
        )

    @property
    def rows(self) -> int:
        """N: rows of the flattened layout."""
        cap = self.default_capacity if self.capacity is None else self.capacity
        return cap if self.layout == "ragged" else self.local_experts * cap

    def describe(self) -> str:
        cap = "None" if self.capacity is None else self.capacity
        return (
            f"R={self.num_ranks} T={self.num_tokens} H={self.hidden} H'={self.y_hidden} K={self.topk} "
            f"E={self.num_experts} (L={self.local_experts}) layout={self.layout} capacity={cap} "
            f"(default {self.default_capacity}) alignment={self.expert_alignment} x={self.x_dtype} "
            f"y={self.y_dtype} partial_dtype={self.partial_dtype} weights={self.weights_dtype} backend={self.backend} "
            f"drop_policy={self.drop_policy}"
        )


def draw_bucket(campaign: int, num_ranks: int, bucket: int, backend: str = "xla") -> Bucket:
    """Bucket ``bucket`` of ``R = num_ranks`` in campaign ``campaign`` (a pure function of those three).

    Buckets 0..5 of each ``R`` cover both layouts, the three dtypes of ``x`` and both drop policies (offset by
    ``log2 R``, so two buckets per ``R`` over R = 1, 2, 4, 8 still see every dtype and policy); everything else
    is drawn.
    """
    rng = np.random.default_rng([campaign, num_ranks, bucket, 0xB0C])
    layout = reference.LAYOUTS[bucket % 2]
    x_dtype = DTYPES[(bucket // 2 + int(np.log2(num_ranks))) % 3] if bucket < 6 else str(rng.choice(DTYPES))
    max_local = max(1, 512 // num_ranks)
    while True:
        u = rng.random()
        num_tokens = int(rng.integers(1, 9) if u < 0.65 else rng.integers(9, 25) if u < 0.88 else rng.integers(25, 65))
        u = rng.random()
        hidden = int(rng.integers(1, 17) if u < 0.35 else rng.integers(17, 129) if u < 0.8 else rng.integers(129, 301))
        y_hidden = hidden if rng.random() < 0.5 else int(rng.integers(1, 301))
        topk = int(rng.integers(1, 5) if rng.random() < 0.4 else rng.integers(1, 17))
        u = rng.random()
        if u < 0.4:
            local = int(rng.integers(1, min(4, max_local) + 1))
        elif u < 0.45:  # E = 512
            local = max_local
        else:  # log-uniform up to 512 / R
            local = int(np.exp(rng.uniform(0, np.log(max_local + 1))))
        local = min(max(local, 1), max_local)
        alignment = int(rng.integers(1, 9))
        shape = Bucket(
            num_ranks,
            num_tokens,
            hidden,
            y_hidden,
            topk,
            num_ranks * local,
            layout,
            None,
            alignment,
            x_dtype,
            str(rng.choice(DTYPES)),
            None if rng.random() < 0.5 else "float32",
            "float32" if rng.random() < 0.7 else str(rng.choice(DTYPES[1:])),
            backend,
        )
        default = shape.default_capacity
        u = rng.random()
        if u < 0.4:
            capacity = None
        elif u < 0.85:  # small: drops slots under most routings
            capacity = int(rng.integers(1, max(2, default // 2 + 1)))
        else:  # larger than needed
            capacity = default + int(rng.integers(1, 9))
        # Buckets 0..5 alternate the drop policy with log2 R (so each layout sees both over R = 1, 2, 4, 8); the
        # others draw it from a stream of its own, so that the other draws stay those of earlier campaigns.
        if bucket < 6:
            policy = DROP_POLICIES[(bucket // 2 + int(np.log2(num_ranks))) % 2]
        else:
            policy = str(np.random.default_rng([campaign, num_ranks, bucket, 0xD20]).choice(DROP_POLICIES))
        shape = dataclasses.replace(shape, capacity=capacity, drop_policy=policy)
        if num_ranks * shape.rows * max(hidden, y_hidden) <= ROWS_BUDGET:
            return shape


@dataclasses.dataclass
class Case:
    """One case: its seed, bucket, routing, flags, inputs (stacked over ranks) and the reference dispatch."""

    seed: int
    bucket: Bucket
    routing: str
    exact: bool  # weights and y rounded to bfloat16: every product exact, so combine's bits are fixed
    poison: bool  # rows that hold no slot get NaN / inf in y, row weights and cotangents
    specials: bool  # NaN, inf, +-0 and subnormals in x and topk_weights (dispatch must move their bits)
    rerun: bool  # run twice and compare bits (determinism)
    inputs: dict[str, np.ndarray]
    ref: reference.RefDispatch

    def describe(self) -> str:
        return (
            f"seed={self.seed} {self.bucket.describe()} routing={self.routing} exact={self.exact} "
            f"poison={self.poison} specials={self.specials} rerun={self.rerun}"
        )


def _distinct(rng: np.random.Generator, rows: int, topk: int, choices: np.ndarray) -> np.ndarray:
    """``[rows, topk]``: distinct entries of ``choices`` per row, -1 where ``topk > len(choices)``."""
    count = min(topk, choices.size)
    picks = choices[np.argsort(rng.random((rows, choices.size)), axis=1)[:, :count]]
    return np.concatenate([picks, np.full((rows, topk - count), -1, picks.dtype)], axis=1)


def draw_routing(rng: np.random.Generator, kind: str, num_ranks: int, num_tokens: int, topk: int, experts: int):
    """``topk_idx [R, T, K]`` int32 of one routing kind (see ROUTINGS)."""
    rows = num_ranks * num_tokens
    shape = (num_ranks, num_tokens, topk)
    every = np.arange(experts, dtype=np.int64)
    if kind == "distinct":
        ids = _distinct(rng, rows, topk, every)
        ids[rng.random(ids.shape) < 0.1] = -1
    elif kind == "repeat":
        ids = _distinct(rng, rows, topk, every)
        if topk > 1:
            tokens = np.flatnonzero(rng.random(rows) < 0.5)
            src = rng.integers(0, topk, tokens.size)
            dst = (src + rng.integers(1, topk, tokens.size)) % topk
            ids[tokens, dst] = ids[tokens, src]
    elif kind == "rank":
        local = experts // num_ranks
        dest = int(rng.integers(0, num_ranks))
        ids = _distinct(rng, rows, topk, every[dest * local : (dest + 1) * local])
    elif kind == "hot":
        ids = np.full((rows, topk), rng.integers(0, experts))
    elif kind == "hot_slot":
        ids = _distinct(rng, rows, topk, every)
        ids[:, 0] = rng.integers(0, experts)
    elif kind == "random":
        ids = rng.integers(-1, experts, (rows, topk))
    elif kind == "invalid":
        ids = rng.integers(-1, experts, (rows, topk))
        bad = np.array([experts, experts + 7, -5, *INVALID_IDS], np.int64)
        mask = rng.random(ids.shape) < 0.3
        ids = np.where(mask, rng.choice(bad, ids.shape), ids)
    elif kind == "unused":
        ids = np.full((rows, topk), -1)
    elif kind == "mixed":
        kinds = [k for k in ROUTINGS if k != "mixed"]
        parts = np.stack(
            [draw_routing(rng, k, num_ranks, num_tokens, topk, experts).reshape(rows, topk) for k in kinds]
        )
        ids = parts[rng.integers(0, len(kinds), rows), np.arange(rows)]
    else:
        raise ValueError(kind)
    return np.asarray(ids).reshape(shape).astype(np.int32)


def _nonzero_normal(rng: np.random.Generator, shape: tuple[int, ...], scale: float = 1.0) -> np.ndarray:
    """float32 normal values away from 0 (so zero rows show, and products stay normal numbers)."""
    v = rng.standard_normal(shape).astype(np.float32)
    return (np.where(np.abs(v) < 0.05, np.float32(0.5), v) * np.float32(scale)).astype(np.float32)


def _signed_weights(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """float32 in +-[0.25, 1.25)."""
    return ((rng.random(shape) + 0.25) * np.where(rng.random(shape) < 0.2, -1, 1)).astype(np.float32)


def _sprinkle(rng: np.random.Generator, values: np.ndarray, fraction: float) -> np.ndarray:
    """``values`` with a ``fraction`` of its entries replaced by NaN, +-inf, +-0 and +-smallest subnormal."""
    tiny = float(jnp.finfo(values.dtype).smallest_subnormal)
    specials = np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, tiny, -tiny], np.float64).astype(values.dtype)
    mask = rng.random(values.shape) < fraction
    return np.where(mask, rng.choice(specials, values.shape), values)


def _as_bf16_values(values: np.ndarray) -> np.ndarray:
    """``values`` rounded to bfloat16 (at most 8 significant bits), in their own dtype."""
    return np.asarray(values).astype(jnp.bfloat16).astype(values.dtype)


def used_rows(ref: reference.RefDispatch) -> np.ndarray:
    """``[R, *layout]`` bool: the layout rows that hold a delivered slot."""
    used = np.zeros(ref.weights.shape, bool)
    flat = used.reshape(ref.num_ranks, -1)
    for d, row in ref.rows.values():
        flat[d, row] = True
    return used


def make_case(
    seed: int, backend: str = "xla", bucket: Bucket | None = None, routing: str | None = None, **flags: bool
) -> Case:
    """The case of ``seed``: its bucket, routing, flags and data; ``bucket``, ``routing`` and ``flags`` (``exact``,
    ``poison``, ``specials``, ``rerun``) override what the seed draws."""
    campaign, num_ranks, bucket_index, _ = decode_seed(seed)
    if bucket is None:
        bucket = draw_bucket(campaign, num_ranks, bucket_index, backend)
    b = bucket
    rng = np.random.default_rng([seed, 0xCA5E])
    kinds = list(ROUTINGS)
    kind = routing or str(rng.choice(kinds, p=np.array([ROUTINGS[k] for k in kinds]) / sum(ROUTINGS.values())))
    drawn = dict(
        zip(
            ("exact", "poison", "specials", "rerun"),
            (bool(v) for v in rng.random(4) < (0.5, 0.5, 0.2, 0.1)),
            strict=True,
        )
    )
    drawn.update(flags)
    exact, poison, specials, rerun = drawn["exact"], drawn["poison"], drawn["specials"], drawn["rerun"]
    R, T, K = b.num_ranks, b.num_tokens, b.topk
    xd, yd = jnp.dtype(b.x_dtype), jnp.dtype(b.y_dtype)

    x = _nonzero_normal(rng, (R, T, b.hidden)).astype(xd)
    topk_weights = _signed_weights(rng, (R, T, K))
    if specials:
        x = _sprinkle(rng, x, 0.05)
        topk_weights = _sprinkle(rng, topk_weights, 0.1)
    topk_idx = draw_routing(rng, kind, R, T, K, b.num_experts)
    ref = reference.dispatch(
        x,
        topk_idx,
        topk_weights,
        num_experts=b.num_experts,
        layout=b.layout,
        capacity=b.capacity,
        expert_alignment=b.expert_alignment,
        drop_policy=b.drop_policy,
    )

    layout_shape = ref.weights.shape  # [R, C] or [R, L, C]
    scale = 2.0 ** int(rng.integers(-3, 4))
    y = _nonzero_normal(rng, (*layout_shape, b.y_hidden), scale)
    row_weights = _signed_weights(rng, layout_shape)
    if exact:
        y, row_weights = _as_bf16_values(y), _as_bf16_values(row_weights)
    y, row_weights = y.astype(yd), row_weights.astype(jnp.dtype(b.weights_dtype))
    ct_x = _nonzero_normal(rng, (*layout_shape, b.hidden)).astype(xd)
    ct_w = _nonzero_normal(rng, layout_shape)
    g = _nonzero_normal(rng, (R, T, b.y_hidden)).astype(yd)
    if poison:
        free = ~used_rows(ref)
        y[free], ct_x[free] = np.nan, np.nan
        row_weights[free], ct_w[free] = np.inf, -np.inf
    inputs = dict(x=x, topk_idx=topk_idx, topk_weights=topk_weights, y=y, row_weights=row_weights)
    inputs.update(ct_x=ct_x, ct_w=ct_w, g=g)
    return Case(seed, b, kind, exact, poison, specials, rerun, inputs, ref)


# ---------------------------------------------------------------------------------------------------------------------
# The program under test: one jitted shard_map per bucket.

INPUTS = ("x", "topk_idx", "topk_weights", "y", "row_weights", "ct_x", "ct_w", "g")


@functools.cache
def program(bucket: Bucket, platform: str = "cpu"):
    """The jitted per-rank program of a bucket: dispatch, two combines and the three VJPs, over ``R`` devices."""
    b = bucket
    partial = None if b.partial_dtype is None else jnp.dtype(b.partial_dtype)
    kwargs = dict(
        num_experts=b.num_experts,
        axis_name=AXIS,
        layout=b.layout,
        capacity=b.capacity,
        expert_alignment=b.expert_alignment,
        drop_policy=b.drop_policy,
        backend=b.backend,
    )

    def body(x, topk_idx, topk_weights, y, row_weights, ct_x, ct_w, g):
        def rows(x, topk_weights):
            d = jax_ep.dispatch(x, topk_idx, topk_weights, **kwargs)
            return (d.x, d.weights), d

        _, pull_dispatch, d = jax.vjp(rows, x, topk_weights, has_aux=True)
        dx, dtopk_weights = pull_dispatch((ct_x, ct_w))
        out_w, pull_w = jax.vjp(
            lambda y, w: jax_ep.combine(y, d.handle, weights=w, partial_dtype=partial), y, row_weights
        )
        dy, dweights = pull_w(g)
        out_1, pull_1 = jax.vjp(lambda y: jax_ep.combine(y, d.handle, partial_dtype=partial), y)
        (dy_1,) = pull_1(g)
        return dict(
            x=d.x,
            weights=d.weights,
            group_sizes=d.group_sizes,
            num_dropped=d.num_dropped,
            num_invalid=d.num_invalid,
            expert_load=d.expert_load,
            out_w=out_w,
            out_1=out_1,
            dx=dx,
            dtopk_weights=dtopk_weights,
            dy=dy,
            dweights=dweights,
            dy_1=dy_1,
        )

    return ep_jit(body, b.num_ranks, platform, ep_mesh(b.num_ranks, platform))


# (this process's index, processes) when the ranks are spread over processes (--shared-gpu), else None.
PROCESS: tuple[int, int] | None = None


def ep_mesh(num_ranks: int, platform: str) -> jax.sharding.Mesh:
    """The ranks' devices: the first ``num_ranks`` of the platform, or over several processes the first of each."""
    if PROCESS is None:
        return cpu_mesh((num_ranks,), (AXIS,)) if platform == "cpu" else gpu_mesh(num_ranks)
    devices = jax.devices(platform)
    firsts = [next(d for d in devices if d.process_index == p) for p in range(PROCESS[1])]
    return jax.make_mesh((num_ranks,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=firsts)


def run_case(case: Case, platform: str = "cpu") -> dict[str, np.ndarray]:
    """The outputs of the bucket's program on the case's inputs, as NumPy arrays stacked over ranks; over
    several processes, this process's rank only (``[1, ...]``)."""
    run = program(case.bucket, platform)
    inputs = [case.inputs[name] for name in INPUTS]
    if PROCESS is None:
        return to_numpy(run(*inputs))
    sharding = jax.sharding.NamedSharding(ep_mesh(case.bucket.num_ranks, platform), P(AXIS))
    inputs = [jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index]) for a in inputs]
    return {name: np.asarray(value.addressable_shards[0].data) for name, value in run(*inputs).items()}


# ---------------------------------------------------------------------------------------------------------------------
# Checks.


def _fmt(value: Any) -> str:
    """One element, with its bits when it is a float."""
    value = np.asarray(value)
    if value.dtype.kind == "f" or value.dtype == jnp.bfloat16:
        bits = int(value.view(np.dtype(f"uint{8 * value.dtype.itemsize}")))
        return f"{float(value.astype(np.float64))!r} ({value.dtype}, bits 0x{bits:0{2 * value.dtype.itemsize}x})"
    return f"{value.item()!r} ({value.dtype})"


def bits_mismatch(name: str, got: np.ndarray, want: np.ndarray) -> str | None:
    """None if ``got`` and ``want`` have the same dtype, shape and bits; else the first difference."""
    got, want = np.asarray(got), np.asarray(want)
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: {got.dtype}{list(got.shape)} where {want.dtype}{list(want.shape)} was expected"
    as_uint = np.dtype(f"uint{8 * got.dtype.itemsize}")
    diff = got.view(as_uint) != want.view(as_uint)
    if not diff.any():
        return None
    first = tuple(int(i) for i in np.argwhere(diff)[0])
    return (
        f"{name}: {int(diff.sum())} of {diff.size} differ in bits; first at {first}: "
        f"got {_fmt(got[first])}, want {_fmt(want[first])}"
    )


def close_mismatch(
    name: str, got: np.ndarray, want: np.ndarray, magnitude: np.ndarray, eps: float, dtype: Any
) -> str | None:
    """None if ``got`` has ``dtype`` and ``|got - want| <= eps * magnitude`` (``helpers.assert_sum_close``)."""
    got = np.asarray(got)
    if got.dtype != np.dtype(dtype) or got.shape != want.shape:
        return f"{name}: dtype/shape {got.dtype}{got.shape}, want {np.dtype(dtype)}{want.shape}"
    try:
        assert_sum_close(got, want, magnitude, eps, err_msg=name)
    except AssertionError as err:
        excess = np.abs(got.astype(np.float64) - want) - (eps * magnitude + 1e-30)
        bad = ~(excess <= 0)
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        return (
            f"{name}: {int(bad.sum())} of {bad.size} outside eps={eps:.3g} x magnitude; first at {first}: "
            f"got {_fmt(got[first])}, want {want[first]!r}, magnitude {magnitude[first]!r}; {str(err).strip()}"
        )
    return None


def tolerances(bucket: Bucket) -> dict[str, float]:
    """Relative bounds (times the sum of the terms' magnitudes) from the contract's rounding steps.

    float32 accumulation of ``n`` terms costs at most ``(n - 1) * u32`` (first order), a float32 product
    ``u32``; each rounding to a dtype costs that dtype's unit roundoff (``dweights`` are returned in the row
    weights' dtype). A 1% margin covers second-order terms. combine sums at most ``K`` products per rank and
    ``R`` partials: ``(K + R + 1) * u32`` in all.
    """
    b = bucket
    accumulate = (b.topk + b.num_ranks + 1) * F32
    partial = b.y_dtype if b.partial_dtype is None else b.partial_dtype
    partial_rounding = 0.0 if partial == "float32" else UNIT[partial]
    dx_partial = 0.0 if b.x_dtype == "float32" else UNIT[b.x_dtype]
    return dict(
        combine=1.01 * (UNIT[b.y_dtype] + partial_rounding + accumulate),
        dx=1.01 * (UNIT[b.x_dtype] + dx_partial + accumulate),
        dy=1.01 * (UNIT[b.y_dtype] + F32),
        dweights=1.01 * ((b.y_hidden + 1) * F32 + UNIT[b.weights_dtype]),
    )


def _rank_of(rank: int | None):
    """Reference arrays (stacked over ranks) cut to one rank's ``[1, ...]``, or whole for ``rank=None``."""
    return (lambda a: a) if rank is None else (lambda a: np.asarray(a)[rank : rank + 1])


def check_case(case: Case, got: dict[str, np.ndarray], rank: int | None = None) -> list[str]:
    """Every mismatch of ``got`` (the program's outputs) against the reference; empty when the case passes.

    With ``rank``, ``got`` holds that rank's outputs only (``[1, ...]``: one process of several)."""
    b, ref, inp = case.bucket, case.ref, case.inputs
    xd, yd = jnp.dtype(b.x_dtype), jnp.dtype(b.y_dtype)
    partial = None if b.partial_dtype is None else np.dtype(b.partial_dtype)
    eps = tolerances(b)
    pick = _rank_of(rank)
    ragged_specified = functools.partial(specified, group_sizes=pick(ref.group_sizes))
    problems: list[str | None] = []
    report = problems.append

    # dispatch: every specified field bit for bit.
    for field in ("group_sizes", "num_dropped", "num_invalid", "expert_load", "weights"):
        report(bits_mismatch(f"dispatch.{field}", got[field], pick(getattr(ref, field))))
    if got["x"].shape == pick(ref.x).shape:
        report(bits_mismatch("dispatch.x (specified rows)", ragged_specified(got["x"]), ragged_specified(pick(ref.x))))
    else:
        report(f"dispatch.x: shape {got['x'].shape}, want {pick(ref.x).shape}")

    # combine, with the given row weights and with none.
    y, row_weights = inp["y"], inp["row_weights"]
    abs_y = np.abs(y.astype(np.float64))
    for name, weights in (("combine(weights=row_weights)", row_weights), ("combine(weights=None)", None)):
        out = got["out_w" if weights is not None else "out_1"]
        want = pick(reference.combine(ref, y, weights))
        magnitude = pick(reference.combine(ref, abs_y, None if weights is None else np.abs(weights.astype(np.float64))))
        report(close_mismatch(name, out, want, magnitude, eps["combine"], yd))
        if case.exact:
            ordered = pick(reference.combine_ordered(ref, y, weights, partial))
            report(bits_mismatch(f"{name} vs combine_ordered", out, ordered))

    # dispatch VJP: dx is a combine of d(Dispatched.x) with the default partial dtype; dtopk_weights a gather.
    ct_x, ct_w = inp["ct_x"], inp["ct_w"]
    want_dx, want_dtw = (pick(a) for a in reference.dispatch_vjp(ref, ct_x, ct_w))
    magnitude_dx = pick(reference.dispatch_vjp(ref, np.abs(ct_x.astype(np.float64)), ct_w)[0])
    report(close_mismatch("dispatch vjp dx", got["dx"], want_dx, magnitude_dx, eps["dx"], xd))
    report(bits_mismatch("dispatch vjp dx vs combine_ordered", got["dx"], pick(reference.combine_ordered(ref, ct_x))))
    report(bits_mismatch("dispatch vjp dtopk_weights", got["dtopk_weights"], want_dtw))

    # combine VJP: dy = w * g[t] (specified rows), dweights = <g[t], y[row]> (every row), dy without weights = g[t].
    g = inp["g"]
    want_dy, want_dweights = (pick(a) for a in reference.combine_vjp(ref, y, row_weights, g))
    magnitude_dw = pick(reference.combine_vjp(ref, abs_y, None, np.abs(g.astype(np.float64)))[1])
    dy = got["dy"]
    if dy.shape == want_dy.shape:
        dy, want_dy = ragged_specified(dy), ragged_specified(want_dy)
    report(close_mismatch("combine vjp dy (specified rows)", dy, want_dy, np.abs(want_dy), eps["dy"], yd))
    dweights_dtype = jnp.dtype(b.weights_dtype)
    report(
        close_mismatch(
            "combine vjp dweights", got["dweights"], want_dweights, magnitude_dw, eps["dweights"], dweights_dtype
        )
    )
    want_dy_1 = pick(reference.combine_vjp(ref, y, None, g)[0].astype(yd))
    dy_1 = got["dy_1"]
    if dy_1.shape == want_dy_1.shape:
        dy_1, want_dy_1 = ragged_specified(dy_1), ragged_specified(want_dy_1)
    report(bits_mismatch("combine vjp dy, weights=None (specified rows)", dy_1, want_dy_1))
    return [p for p in problems if p is not None]


def _specified_outputs(case: Case, got: dict[str, np.ndarray], rank: int | None = None) -> dict[str, np.ndarray]:
    """``got`` with the ragged tails (unspecified rows) of ``x``, ``dy`` and ``dy_1`` zeroed."""
    out = dict(got)
    if case.bucket.layout == "ragged":
        for name in ("x", "dy", "dy_1"):
            out[name] = specified(got[name], _rank_of(rank)(case.ref.group_sizes))
    return out


def determinism_mismatch(
    case: Case, first: dict[str, np.ndarray], second: dict[str, np.ndarray], rank: int | None = None
) -> list[str]:
    """Fields whose specified values differ in bits between two runs of the same case."""
    a, b = _specified_outputs(case, first, rank), _specified_outputs(case, second, rank)
    found = (bits_mismatch(f"determinism: {name}", b[name], a[name]) for name in a)
    return [p for p in found if p is not None]


# ---------------------------------------------------------------------------------------------------------------------
# Campaigns.


def schedule(campaign: int, cases: int, ranks: list[int], buckets: int) -> list[int]:
    """The seeds of a campaign: case ``i`` runs on ``ranks[i % len(ranks)]``, buckets taken in turn.

    The seed of a given ``(R, bucket, index)`` does not depend on ``ranks``, so a campaign split by ``R``
    over several runs (same seed, ``--cases`` scaled) runs the same cases.
    """
    seeds = []
    for i in range(cases):
        turn = i // len(ranks)
        seeds.append(encode_seed(campaign, ranks[i % len(ranks)], turn % buckets, turn // buckets))
    return seeds


def run_one(case: Case, platform: str = "cpu") -> tuple[list[str], dict[str, float]]:
    """Run and check one case: its mismatches and the seconds spent in jax_ep, the reference checks and reruns."""
    start = time.perf_counter()
    got = run_case(case, platform)
    ran = time.perf_counter()
    rank = None if PROCESS is None else PROCESS[0]
    problems = check_case(case, got, rank)
    checked = time.perf_counter()
    if case.rerun:
        problems += determinism_mismatch(case, got, run_case(case, platform), rank)
    return problems, dict(jax_s=ran - start, check_s=checked - ran, rerun_s=time.perf_counter() - checked)


def _counts_of(case: Case) -> dict[str, str]:
    """The categories a case is counted in."""
    b, ref = case.bucket, case.ref
    idx = case.inputs["topk_idx"]
    cap = "default" if b.capacity is None else "small" if b.capacity < b.default_capacity else "large"
    repeats = any(len(set(row[row >= 0].tolist())) < int((row >= 0).sum()) for row in idx.reshape(-1, b.topk))
    return dict(
        by_ranks=str(b.num_ranks),
        by_layout=b.layout,
        by_x_dtype=b.x_dtype,
        by_y_dtype=b.y_dtype,
        by_partial_dtype=str(b.partial_dtype),
        by_weights_dtype=b.weights_dtype,
        by_routing=case.routing,
        by_capacity=cap,
        by_drop_policy=b.drop_policy,
        by_alignment=str(b.expert_alignment),
        k_gt_l=str(b.topk > b.local_experts),
        h_multiple_of_8=str(b.hidden % 8 == 0),
        dropped_slots=str(int(ref.num_dropped.sum()) > 0),
        invalid_slots=str(int(ref.num_invalid.sum()) > 0),
        repeated_expert=str(repeats),
        exact_products=str(case.exact),
        poisoned_free_rows=str(case.poison),
        special_values=str(case.specials),
        rerun=str(case.rerun),
    )


def _git(*args: str) -> str | None:
    """The output of a git command in this checkout, None if it failed."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    except OSError:
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def source_version() -> dict[str, Any]:
    """The commit, the git tree of jax_ep/ at it, whether the library's sources (jax_ep/, ffi/ and the build
    files) differ from it, and their hash (`sources`, record.source_hash), which names the code under test even
    where git cannot.

    JAX_EP_COMMIT, where set (the device scripts set it: a copied tree's git may name another commit), is the
    commit."""
    status = _git("status", "--porcelain", "--", *SOURCES)
    return dict(
        commit=os.environ.get("JAX_EP_COMMIT") or _git("rev-parse", "--short", "HEAD") or "unknown",
        jax_ep_tree=_git("rev-parse", "--short", "HEAD:jax_ep") or "unknown",
        jax_ep_uncommitted=None if status is None else bool(status),
        sources=sources(Path(__file__)),
    )


def _all_go_on(n: int, mine: bool) -> bool:
    """Whether to start case ``n``: this process's answer, or over several processes process 0's (each case is
    a collective, so every process must run the same cases)."""
    if PROCESS is None:
        return mine
    from jax._src import distributed  # its key-value client; jax has no public one

    key = f"jax_ep_fuzz/case/{n}"
    if PROCESS[0] == 0:
        distributed.global_state.client.key_value_set(key, "1" if mine else "0")
        return mine
    return distributed.global_state.client.blocking_key_value_get(key, 600_000) == "1"


def campaign(
    seed: int,
    cases: int,
    ranks: list[int],
    buckets: int = 6,
    backend: str = "xla",
    log=print,
    progress_s: float = 30.0,
    platform: str = "cpu",
    budget_s: float | None = None,
    transport: str = "auto",
) -> dict[str, Any]:
    """Run a campaign; the report (a JSON-able dict) counts cases and lists every mismatch.

    With ``budget_s``, cases stop being started once that many seconds have passed (``cases`` in the report
    is then the number run, ``cases_planned`` the number asked for)."""
    version = source_version()  # jax_ep was imported just before: the code under test
    seeds = schedule(seed, cases, ranks, buckets)
    if platform == "gpu" and backend != "xla":
        if len(ranks) != 1:
            raise ValueError("--platform gpu with backend cuda runs one R per campaign (one jax_ep group)")
        jax_ep.initialize(ep_mesh(ranks[0], platform), AXIS, **MAX_BUCKET, dtype=jnp.float32, transport=transport)
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    mismatches = []
    bucket_seeds: dict[tuple[int, int], list[int]] = collections.defaultdict(list)
    bucket_configs: dict[tuple[int, int], Bucket] = {}
    first_call_s = 0.0
    times = collections.Counter()
    start = last = time.perf_counter()
    run = 0
    for n, case_seed in enumerate(seeds, 1):
        if not _all_go_on(n, budget_s is None or time.perf_counter() - start <= budget_s):
            log(f"[fuzz] time budget of {budget_s} s spent after {n - 1} of {len(seeds)} cases")
            break
        run = n
        _, num_ranks, bucket_index, _ = decode_seed(case_seed)
        case_start = time.perf_counter()
        case = make_case(case_seed, backend)
        made = time.perf_counter()
        key = (num_ranks, bucket_index)
        fresh = key not in bucket_configs
        bucket_configs[key] = case.bucket
        problems, spent = run_one(case, platform)
        times.update(spent, make_s=made - case_start)
        if fresh:
            first_call_s += spent["jax_s"]
        bucket_seeds[key].append(case_seed)
        for category, value in _counts_of(case).items():
            counts[category][value] += 1
        if problems:
            mismatches.append(dict(seed=case_seed, case=case.describe(), mismatches=problems))
            log(f"MISMATCH seed={case_seed}: {case.describe()}\n  first: {problems[0]}")
        now = time.perf_counter()
        if now - last >= progress_s or n == len(seeds):
            last = now
            log(
                f"[fuzz] {n}/{len(seeds)} cases, {len(mismatches)} mismatching, {now - start:.1f} s, "
                f"{n / (now - start):.1f} cases/s ({len(bucket_configs)} buckets compiled)"
            )
    wall = time.perf_counter() - start
    steady = wall - first_call_s
    report = dict(
        tool="tools/fuzz.py",
        backend=backend,
        transport=transport,
        platform=(
            f"cpu, {len(jax.devices('cpu'))} simulated CPU devices"
            if platform == "cpu"
            else f"gpu: {', '.join(sorted({d.device_kind for d in jax.devices('gpu')}))}"
        ),
        jax_version=jax.__version__,
        **version,
        campaign_seed=seed,
        ranks=ranks,
        buckets_per_rank=buckets,
        cases=run,
        cases_planned=len(seeds),
        mismatching_cases=len(mismatches),
        counts={k: dict(sorted(v.items())) for k, v in sorted(counts.items())},
        time=dict(
            wall_s=round(wall, 2),
            cases_per_s=round(run / wall, 2),
            first_call_per_bucket_s=round(first_call_s, 2),
            cases_per_s_after_compile=round((run - len(bucket_configs)) / max(steady, 1e-9), 2),
            **{k: round(v, 2) for k, v in sorted(times.items())},
        ),
        mismatches=mismatches,
        buckets=[
            dict(R=k[0], bucket=k[1], config=dataclasses.asdict(bucket_configs[k]), seeds=bucket_seeds[k])
            for k in sorted(bucket_seeds)
        ],
    )
    return report


def _each(reports: list[dict[str, Any]], key: str, default: Any = None) -> list[Any]:
    """Every report's ``key``, a merged report's list taken apart."""
    values = [r.get(key, default) for r in reports]
    return [v for value in values for v in (value if isinstance(value, list) else [value])]


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report from several runs (e.g. a campaign split by R, or reports merged before): counts and times
    added, lists joined."""
    counts: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for r in reports:
        for category, values in r["counts"].items():
            counts[category].update(values)
    wall = sum(r["time"]["wall_s"] for r in reports)
    cases = sum(r["cases"] for r in reports)
    return dict(
        tool="tools/fuzz.py",
        backend=sorted(set(_each(reports, "backend"))),
        platform=reports[0]["platform"],
        jax_version=reports[0]["jax_version"],
        commit=sorted(set(_each(reports, "commit"))),
        jax_ep_tree=sorted(set(_each(reports, "jax_ep_tree", "unknown"))),
        jax_ep_uncommitted=sorted({str(v) for v in _each(reports, "jax_ep_uncommitted")}),
        sources=sorted(set(_each(reports, "sources", "unknown"))),
        commands=[c for r in reports for c in r.get("commands", [r.get("command")])],
        campaign_seed=sorted(set(_each(reports, "campaign_seed"))),
        ranks=sorted({x for r in reports for x in r["ranks"]}),
        cases=cases,
        mismatching_cases=sum(r["mismatching_cases"] for r in reports),
        counts={k: dict(sorted(v.items())) for k, v in sorted(counts.items())},
        time=dict(
            runs=[run for r in reports for run in r["time"].get("runs", [dict(command=r.get("command"), **r["time"])])],
            wall_s=round(wall, 2),
            cases_per_s=round(cases / wall, 2),
        ),
        mismatches=[m for r in reports for m in r["mismatches"]],
        buckets=[b for r in reports for b in r["buckets"]],
        notes=[n for n in _each(reports, "notes", []) + [r["note"] for r in reports if "note" in r]],
    )


def _seed_range(seeds: Any) -> Any:
    """Consecutive seeds as ``{"first", "last", "count"}`` (every integer from first to last); others as they are."""
    if isinstance(seeds, list) and seeds and seeds == list(range(seeds[0], seeds[0] + len(seeds))):
        return dict(first=seeds[0], last=seeds[-1], count=len(seeds))
    return seeds


def dumps(report: dict[str, Any]) -> str:
    """``report`` as indented JSON, each bucket (its config and case seeds, consecutive ones as a range) on one line."""
    report = dict(report, seed_format=SEED_FORMAT)
    text = json.dumps({k: v for k, v in report.items() if k != "buckets"}, indent=1)
    buckets = ",\n".join("  " + json.dumps(dict(b, seeds=_seed_range(b["seeds"]))) for b in report["buckets"])
    return text[: -len("\n}")] + ',\n "buckets": [\n' + buckets + "\n ]\n}\n"


def replay(case_seed: int, backend: str, platform: str = "cpu", transport: str = "auto") -> int:
    """Run one case, print its configuration and every mismatch; 1 if it mismatched."""
    case = make_case(case_seed, backend)
    print(f"[fuzz] replay {case.describe()}")
    if platform == "gpu" and backend != "xla":
        mesh = gpu_mesh(case.bucket.num_ranks)
        jax_ep.initialize(mesh, AXIS, **MAX_BUCKET, dtype=jnp.float32, transport=transport)
    problems, spent = run_one(case, platform)
    seconds = ", ".join(f"{k} {v:.3f}" for k, v in spent.items())
    print(f"[fuzz] dropped={case.ref.num_dropped.tolist()} invalid={case.ref.num_invalid.tolist()} ({seconds})")
    for p in problems:
        print(f"MISMATCH {p}")
    print(f"[fuzz] seed {case_seed}: {'MISMATCH' if problems else 'ok'}")
    return 1 if problems else 0


def in_processes(args: argparse.Namespace, command: str) -> dict[str, Any]:
    """--processes N: R = N ranks as N processes (jax.distributed on localhost), one rank each: on the GPU all
    on GPU 0, storing into each other's buffers through CUDA IPC; on the CPU one device each (gloo). Each runs
    the same campaign and checks its own rank's outputs. One report: the cases, and every mismatch with the
    process that saw it."""
    import tempfile

    from bench.multiprocess import run_workers

    folder = Path(tempfile.mkdtemp(prefix="jax_ep_fuzz_"))
    worker = [sys.executable, "-m", "tools.fuzz", "--cases", str(args.cases), "--seed", str(args.seed)]
    count = args.processes
    worker += ["--ranks", str(count), "--buckets", str(args.buckets), "--backend", args.backend]
    worker += ["--platform", args.platform, "--progress", str(args.progress), "--processes", str(count)]
    worker += ["--transport", args.transport]
    worker += [] if args.budget_s is None else ["--budget-s", str(args.budget_s)]
    logs = [folder / f"process_{i}.log" for i in range(count)]
    timeout = 3600.0 if args.budget_s is None else args.budget_s + 600.0
    codes = run_workers(
        lambda port, i: [*worker, "--worker", f"{port},{i}", "--out", str(folder / f"process_{i}.json")],
        count,
        timeout,
        logs=logs,
    )
    reports = []
    for i in range(count):
        path = folder / f"process_{i}.json"
        if codes is None or not path.exists():
            tail = logs[i].read_text()[-3000:] if logs[i].exists() else ""
            raise RuntimeError(f"fuzz process {i} of {count} left no report (exit codes {codes}):\n{tail}")
        with open(path) as f:
            reports.append(json.load(f))
    report = dict(reports[0])
    where = "all on GPU 0" if args.platform == "gpu" else "one CPU device each"
    report["processes"] = f"{count}, {where}, one rank each; each checks its own rank's outputs"
    report["mismatches"] = [dict(m, process=i) for i, r in enumerate(reports) for m in r["mismatches"]]
    report["mismatching_cases"] = len({m["seed"] for m in report["mismatches"]})
    report["per_process"] = [
        dict(cases=r["cases"], mismatching_cases=r["mismatching_cases"], time=r["time"]) for r in reports
    ]
    report["command"] = command
    return report


def work_in_process(args: argparse.Namespace) -> None:
    """--worker PORT,INDEX (set by --processes): join the others; on the GPU, this process's device is GPU 0."""
    global PROCESS
    port, index = (int(v) for v in args.worker.split(","))
    if args.platform == "gpu":
        jax.distributed.initialize(f"localhost:{port}", args.processes, index, local_device_ids=[0])
    else:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(f"localhost:{port}", args.processes, index)
    PROCESS = (index, args.processes)


def leave_together(code: int) -> None:
    """The end of a --worker: free the group together, then exit without jax.distributed's shutdown handshake;
    process 0 hosts the coordination service, so it goes last."""
    from jax._src import distributed

    jax_ep.finalize()
    distributed.global_state.client.wait_at_barrier("jax_ep_fuzz/exit", 120_000)
    if PROCESS[0] == 0:
        time.sleep(2)
    os._exit(code)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=200, help="cases in all, spread over --ranks in turn")
    parser.add_argument("--seed", type=int, default=0, help="campaign seed (picks the buckets and every case)")
    parser.add_argument("--ranks", default="1,2,4,8", help="comma-separated EP sizes, each at most 8")
    parser.add_argument("--buckets", type=int, default=6, help="shape buckets (compiled programs) per R")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--backend", default="xla", choices=["xla", "cuda", "auto"])
    parser.add_argument("--platform", default="cpu", choices=PLATFORMS, help="where the ranks run")
    parser.add_argument("--budget-s", type=float, help="start no case after this many seconds")
    parser.add_argument("--replay", type=int, metavar="SEED", help="rerun the one case of this case seed")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="merge these reports into --out")
    parser.add_argument("--progress", type=float, default=30.0, help="seconds between progress lines")
    parser.add_argument("--processes", type=int, help="R as this many processes, one rank each (GPU: all on GPU 0)")
    parser.add_argument(
        "--transport",
        default="auto",
        choices=["auto", "nccl"],
        help="jax_ep.initialize's, for backend cuda (nccl needs a GPU per rank: NCCL puts no two ranks on one GPU)",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # PORT,INDEX: one process of --processes
    args = parser.parse_args(argv)
    command = "python -m " + shlex.join(["tools.fuzz", *(sys.argv[1:] if argv is None else argv)])

    if args.merge:
        reports = []
        for path in args.merge:
            with open(path) as f:
                reports.append(json.load(f))
        report = merge(reports)
        report["merge_command"] = command
    elif args.replay is not None:
        return replay(args.replay, args.backend, args.platform, args.transport)
    elif args.processes and not args.worker:
        if args.processes < 2:
            parser.error("--processes: at least 2")
        report = in_processes(args, command)
    else:
        if args.worker:
            work_in_process(args)
        ranks = [int(r) for r in args.ranks.split(",")]
        if any(r < 1 or r > 8 for r in ranks):
            parser.error("--ranks: each R must be in 1..8 (8 simulated devices)")
        report = campaign(
            args.seed,
            args.cases,
            ranks,
            args.buckets,
            args.backend,
            progress_s=args.progress,
            platform=args.platform,
            budget_s=args.budget_s,
            transport=args.transport,
        )
        report["command"] = command
    t = report["time"]
    print(
        f"[fuzz] {report['cases']} cases, {report['mismatching_cases']} mismatching, {t['wall_s']} s, "
        f"{t['cases_per_s']} cases/s"
        + (f" ({t['cases_per_s_after_compile']} cases/s after compiling)" if "cases_per_s_after_compile" in t else "")
    )
    print(f"[fuzz] cases per R: {report['counts']['by_ranks']}")
    for m in report["mismatches"]:
        print(f"[fuzz] MISMATCH seed={m['seed']} (replay: python -m tools.fuzz --replay {m['seed']})")
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(dumps(report))
        print(f"[fuzz] wrote {args.out}")
    code = 1 if report["mismatching_cases"] else 0
    if args.worker:
        leave_together(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
