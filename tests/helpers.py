"""Run jax_ep per rank inside ``jax.shard_map`` over an "ep" axis, and make test routings.

Arrays given to and returned by :func:`ep_jit` functions are stacked over ranks
(leading axis ``R``); the function body sees one rank's slice, without that axis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from tests.conftest import cpu_mesh

AXIS = "ep"
INVALID_IDS = (-7, -2, 2**31 - 1, -(2**31))  # never -1 nor a valid id


def slow(*values: Any, id: str | None = None) -> Any:
    """A parameter set of a sweep that only the slow tier runs (``-m slow``; pyproject.toml's markers)."""
    return pytest.param(*values, marks=pytest.mark.slow, id=id)


def ep_jit(
    fn: Callable[..., Any], num_ranks: int, platform: str = "cpu", mesh: jax.sharding.Mesh | None = None
) -> Callable[..., Any]:
    """``fn`` run on each rank of an "ep" axis of ``num_ranks`` CPU devices (or the first GPUs), jitted once.

    Every argument leaf (arguments may be pytrees, such as a Dispatched) and every output leaf has a
    leading rank axis (per-rank scalars come back as ``[R]``). The returned callable can be traced
    again (``jax.grad``, ``check_grads``). ``mesh`` replaces those devices.
    """
    if mesh is None:
        mesh = cpu_mesh((num_ranks,), (AXIS,)) if platform == "cpu" else gpu_mesh(num_ranks)

    def body(*args):
        out = fn(*jax.tree.map(lambda a: a[0], args))
        return jax.tree.map(lambda v: v[None], out)

    # The mesh is given to shard_map rather than set with jax.set_mesh, which cannot be entered under a
    # trace (check_grads traces the callable); test_shard_map.py covers the jax.set_mesh form.
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(AXIS), out_specs=P(AXIS)))


def gpu_mesh(num_ranks: int) -> jax.sharding.Mesh:
    """A mesh of the first ``num_ranks`` GPUs along the "ep" axis."""
    devices = jax.devices("gpu")[:num_ranks]
    assert len(devices) == num_ranks, f"needs {num_ranks} GPUs, have {len(jax.devices('gpu'))}"
    return jax.make_mesh((num_ranks,), (AXIS,), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)


def to_numpy(tree: Any) -> Any:
    """Every leaf as a NumPy array."""
    return jax.tree.map(np.asarray, tree)


def run_dispatch(x: np.ndarray, topk_idx: np.ndarray, topk_weights: np.ndarray, **kwargs: Any) -> jax_ep.Dispatched:
    """``jax_ep.dispatch`` on ``R = x.shape[0]`` ranks; a Dispatched of NumPy arrays stacked over ranks."""
    num_ranks = x.shape[0]
    call = ep_jit(lambda a, b, c: jax_ep.dispatch(a, b, c, axis_name=AXIS, **kwargs), num_ranks)
    return to_numpy(call(x, topk_idx, topk_weights))


def random_inputs(
    rng: np.random.Generator, num_ranks: int, num_tokens: int, hidden: int, topk: int, dtype: Any = np.float32
) -> tuple[np.ndarray, np.ndarray]:
    """Tokens ``[R, T, H]`` (no zeros, so padding shows) and weights ``[R, T, K]`` in [0.25, 1.25)."""
    x = rng.standard_normal((num_ranks, num_tokens, hidden)).astype(np.float32)
    x = np.where(np.abs(x) < 0.05, 0.5, x).astype(dtype)
    weights = (rng.random((num_ranks, num_tokens, topk)) + 0.25).astype(np.float32)
    return x, weights


def routing(
    rng: np.random.Generator, kind: str, num_ranks: int, num_tokens: int, topk: int, num_experts: int
) -> np.ndarray:
    """``topk_idx [R, T, K]`` int32 of one kind.

    * ``distinct``: distinct valid ids per token and a few -1 (nothing dropped at the default capacity).
    * ``random``: ids in [-1, E) with repeats within a row and -1 slots.
    * ``invalid``: ``random`` plus invalid ids (``INVALID_IDS`` and E, E + 5).
    * ``skewed``: every token picks the same experts, one of them twice (and -1 in slot 3 when K > 3).
    """
    shape = (num_ranks, num_tokens, topk)
    if kind == "distinct":
        ids = np.stack([rng.permutation(num_experts)[:topk] for _ in range(num_ranks * num_tokens)])
        ids = ids.reshape(shape)
        ids[:, 1, 0] = -1
        return ids.astype(np.int32)
    if kind in ("random", "invalid"):
        ids = rng.integers(-1, num_experts, shape)
        ids[:, 0, :] = num_experts - 1  # a row with the same expert K times
        ids[:, 1, -1] = -1
        if kind == "invalid":
            bad = np.array([*INVALID_IDS, num_experts, num_experts + 5])
            mask = rng.random(shape) < 0.25
            ids = np.where(mask, rng.choice(bad, shape), ids)
        return ids.astype(np.int32)
    if kind == "skewed":
        row = [num_experts - 1, 0, num_experts - 1, -1][:topk]
        return np.broadcast_to(np.array(row + [1] * (topk - len(row))), shape).astype(np.int32).copy()
    raise ValueError(kind)


def assert_bits_equal(actual: np.ndarray, expected: np.ndarray, err_msg: str = "") -> None:
    """Same shape, same dtype and the same bits (so -0.0 differs from 0.0, and NaNs are compared)."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.dtype == expected.dtype, f"{err_msg}: dtype {actual.dtype} != {expected.dtype}"
    assert actual.shape == expected.shape, f"{err_msg}: shape {actual.shape} != {expected.shape}"
    # Bits only: equal bits are equal values, and comparing values of NaN in ml_dtypes' types (bfloat16) is not
    # portable across NumPy versions (NumPy 2.5 reports equal NaN bits as a mismatch).
    as_uint = np.dtype(f"uint{8 * actual.dtype.itemsize}")
    np.testing.assert_array_equal(actual.view(as_uint), expected.view(as_uint), err_msg=err_msg)


def quantize_dequantize(x: np.ndarray) -> np.ndarray:
    """FP8 dispatch's formula in NumPy, independent of jax_ep.ep.fp8: per 128 values, scale = amax / 448 (1 if all
    zero), q = e4m3(x / scale), back as q * scale in x's dtype."""
    blocks = x.astype(np.float32).reshape(*x.shape[:-1], -1, 128)
    amax = np.abs(blocks).max(axis=-1, keepdims=True)
    scale = np.where(amax == 0, np.float32(1), amax / np.float32(448)).astype(np.float32)
    q = (blocks / scale).astype(ml_dtypes.float8_e4m3fn)
    return (q.astype(np.float32) * scale).reshape(x.shape).astype(x.dtype)


def ragged_tail(x: np.ndarray, group_sizes: np.ndarray) -> np.ndarray:
    """``[R, C]``: the rows of a ragged ``x [R, C, H]`` past ``sum(group_sizes)`` (their content is unspecified)."""
    used = np.asarray(group_sizes).sum(axis=-1)
    return np.arange(x.shape[1])[None, :] >= used[:, None]


def specified(x: np.ndarray, group_sizes: np.ndarray) -> np.ndarray:
    """``x`` (stacked over ranks) with the unspecified ragged tail set to 0; the expert layout ([R, L, C, H]) as is."""
    x = np.asarray(x)
    if x.ndim != 3:
        return x
    return np.where(ragged_tail(x, group_sizes)[..., None], np.zeros((), x.dtype), x)


def assert_dispatch_equal(got: jax_ep.Dispatched, want: Any) -> None:
    """Every specified Dispatched field of ``got`` (stacked over ranks) equals the reference, bit for bit.

    The ragged layout's rows past ``sum(group_sizes)`` are unspecified (SPEC v2), so ``x`` is compared only
    before them; ``weights`` must be 0 there, so it is compared everywhere.
    """
    for field in ("group_sizes", "weights", "num_dropped", "num_invalid", "expert_load"):
        assert_bits_equal(getattr(got, field), getattr(want, field), err_msg=field)
    assert_bits_equal(specified(got.x, got.group_sizes), specified(want.x, want.group_sizes), err_msg="x")
    if want.row_expert is None:
        assert got.row_expert is None, "row_expert: None in the expert layout"
    else:
        assert_bits_equal(got.row_expert, want.row_expert, err_msg="row_expert")


def assert_sum_close(got: np.ndarray, want: np.ndarray, magnitude: np.ndarray, eps: float, err_msg: str = "") -> None:
    """``|got - want| <= eps * magnitude + tiny`` elementwise.

    ``want`` is an exact (float64) sum and ``magnitude`` the same sum over absolute values of the
    terms, so ``eps`` bounds the relative rounding error of a sum independently of cancellation.
    """
    got64 = np.asarray(got).astype(np.float64)
    bound = eps * np.asarray(magnitude) + 1e-30
    excess = np.abs(got64 - want) - bound
    worst = np.unravel_index(np.argmax(excess), excess.shape) if excess.size else ()
    assert np.all(excess <= 0), (
        f"{err_msg}: worst at {worst}: got {got64[worst]}, want {want[worst]}, allowed error {bound[worst]}"
    )


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
    """``jax.lax.ragged_all_to_all`` as its docstring defines it, built from ``lax.all_to_all`` (XLA:CPU does not
    implement the primitive; the xla backend's ragged exchange runs on CPU with this in its place).

    Slice ``i`` of ``operand`` (``input_offsets[i]``, ``send_sizes[i]`` rows) goes to rank ``i // (N / R)``; each
    receiver writes the ``i``-th slice it gets, ``recv_sizes[i]`` rows, at the offset its sender gave in
    ``output_offsets``, into a copy of ``output``. Slices travel padded to ``operand``'s rows.
    """
    assert axis_index_groups is None
    num_ranks = jax.lax.axis_size(axis_name)
    slices = input_offsets.shape[0]
    assert slices % num_ranks == 0, (slices, num_ranks)
    rows, tail = operand.shape[0], operand.shape[1:]
    index = jnp.arange(rows, dtype=jnp.int32)
    sent = jnp.where(index < send_sizes[:, None], input_offsets[:, None] + index, rows)  # [slices, rows]
    chunks = jnp.take(operand, sent, axis=0, mode="fill", fill_value=0)  # [slices, rows, ...]
    received = jax.lax.all_to_all(chunks, axis_name, 0, 0, tiled=True)  # slice i from rank i // (N / R)
    offsets = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)
    target = jnp.where(index < recv_sizes[:, None], offsets[:, None] + index, output.shape[0])
    return output.at[target.reshape(-1)].set(received.reshape(slices * rows, *tail), mode="drop")


def collective_operands(jaxpr: Any) -> list[tuple[str, str, tuple[int, ...]]]:
    """``(primitive, dtype, shape)`` of the first operand of every all-to-all in ``jaxpr`` and the jaxprs inside it
    (jit, shard_map, custom VJPs, cond branches, scan bodies)."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in ("all_to_all", "ragged_all_to_all"):
            aval = eqn.invars[0].aval
            found.append((eqn.primitive.name, aval.dtype.name, tuple(aval.shape)))
        for value in eqn.params.values():
            for inner in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(inner, "jaxpr", inner)
                if hasattr(inner, "eqns"):
                    found.extend(collective_operands(inner))
    return found
