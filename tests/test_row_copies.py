"""The padded grouped matmul's row-copy kernels (jax_ep.gmm.row_copies) against its XLA row copies.

On CPU the Pallas kernels run in interpret mode, on arrays with spare rows at the end (the interpreter clamps a
block that runs past the array, where Triton masks it); on a CUDA GPU they run compiled, on every edge: the last
group's blocks running past the array, empty groups, NaN in every row outside the groups.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl

from jax_ep.gmm import padded as padded
from jax_ep.gmm import row_copies as rc
from tests.gpu import gpu_devices, require_gpu
from tests.helpers import slow

ON_CUDA = bool(gpu_devices())
# (rows a group, columns, group sizes, rows past the groups)
CASES = {
    "ragged": (48, 700, [40, 0, 48, 17, 30], 21),
    "to_the_end": (40, 192, [3, 40, 33], 0),  # the last group's last block runs past the array
    "empty": (16, 64, [0, 0], 5),
    "one_row": (8, 1024, [1], 0),
}


def make(case: str, dtype, spare: int):
    rows, d, sizes, tail = CASES[case]
    sizes = np.asarray(sizes, np.int32)
    m = int(sizes.sum()) + tail
    a = np.random.default_rng(0).standard_normal((m + spare, d)).astype(np.float32)
    a[sizes.sum() :] = np.nan  # past the groups: must never reach a result
    starts = np.cumsum(sizes) - sizes
    return jnp.asarray(a, dtype), jnp.asarray(starts), jnp.asarray(sizes), rows, m + spare


def check_kernels(case: str, dtype, spare: int, into: bool = True):
    a, starts, sizes, rows, m = make(case, dtype, spare)
    total = int(sizes.sum())
    p = rc.pad(a, starts, sizes, rows)
    np.testing.assert_array_equal(np.asarray(p, np.float32), np.asarray(padded._xla_pad(a, sizes, rows), np.float32))
    u = rc.unpad(p, starts, sizes, m)
    want = np.asarray(a, np.float32).copy()
    want[total:] = 0
    np.testing.assert_array_equal(np.asarray(u, np.float32), want)
    q = padded._xla_pad(jnp.flip(a, axis=1), sizes, rows)  # another addend, also 0 past each group
    summed = rc.unpad(p, starts, sizes, m, plus=q)
    want_sum = (jnp.asarray(p, jnp.float32) + jnp.asarray(q, jnp.float32)).astype(a.dtype)
    np.testing.assert_array_equal(
        np.asarray(summed, np.float32), np.asarray(padded._xla_unpad(want_sum, sizes, m), np.float32)
    )
    if into:  # groups larger than the padded rows (half of them here): each group's first rows come back, its
        # others keep into's, and rows past the groups are 0 (every case of more than one row a group has some)
        half = max(rows // 2, 1)
        p_half = rc.pad(a, starts, sizes, half)
        base = jnp.flip(a, axis=0)
        want = np.asarray(base, np.float32).copy()
        blocks = np.asarray(p_half, np.float32)
        for start, size, block in zip(np.asarray(starts), np.asarray(sizes), blocks, strict=True):
            want[start : start + min(int(size), half)] = block[: min(int(size), half)]
        want[total:] = 0
        np.testing.assert_array_equal(np.asarray(rc.unpad(p_half, starts, sizes, m, into=base), np.float32), want)
        np.testing.assert_array_equal(np.asarray(padded._xla_unpad(p_half, sizes, m, starts, base), np.float32), want)
    for first in sorted({0, total // 2, total, m}):
        z = np.asarray(jax.jit(rc.zero_rows_from)(a, jnp.int32(first)), np.float32)
        assert np.all(z[first:] == 0)
        np.testing.assert_array_equal(z[:first], np.asarray(a, np.float32)[:first])  # untouched, NaN included


@pytest.mark.parametrize("case", [c if c in ("ragged", "to_the_end") else slow(c) for c in sorted(CASES)])
def test_row_copies_interpreted(monkeypatch, case):
    monkeypatch.setattr(pl, "pallas_call", functools.partial(pl.pallas_call, interpret=True))
    check_kernels(case, jnp.float32, spare=64, into=case == "ragged")  # interpreted: slow


@require_gpu(needed=ON_CUDA)
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("case", sorted(CASES))
def test_row_copies_on_gpu(case, dtype):
    check_kernels(case, dtype, spare=0)


def test_arrays_past_int32_take_xlas_copies():
    """The kernels are traced for arrays they were run with, and XLA's gathers take larger ones."""
    bf16 = jnp.bfloat16
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    small = str(jax.make_jaxpr(lambda a, s: padded.pad(a, s, 64))(jax.ShapeDtypeStruct((256, 128), bf16), sizes))
    assert "jax_ep_pad_rows" in small
    huge = jax.ShapeDtypeStruct((2**24, 128), bf16)  # 2**31 elements
    jaxprs = [
        jax.make_jaxpr(lambda a, s: padded.pad(a, s, 64))(jax.ShapeDtypeStruct((256, 2**23), bf16), sizes),
        jax.make_jaxpr(lambda p, s: padded.unpad(p, s, 2**24))(jax.ShapeDtypeStruct((4, 64, 128), bf16), sizes),
        jax.make_jaxpr(lambda a: padded.zero_rows_from(a, jnp.int32(3)))(huge),
    ]
    for jaxpr in jaxprs:
        assert "pallas_call" not in str(jaxpr)


@require_gpu(needed=ON_CUDA)
def test_sizes_that_do_not_fit_the_array_stay_inside_it():
    """Group sizes past the array's end, or negative (a caller's error), give unspecified rows, but no kernel reads or
    writes outside its arrays (a fault would end the process), and a group inside the array is still copied."""
    a = jnp.asarray(np.random.default_rng(1).standard_normal((40, 256)), jnp.bfloat16)
    for sizes in ([10, 50], [-5, 12, 20], [30, 30]):
        s = jnp.asarray(sizes, jnp.int32)
        starts = jnp.cumsum(s) - s
        p = jax.block_until_ready(rc.pad(a, starts, s, 64))
        u = jax.block_until_ready(rc.unpad(p, starts, s, 40))
        first = int(np.argmax(np.asarray(sizes) > 0))  # the first group with rows starts at 0 or past it
        if int(starts[first]) >= 0 and int(starts[first]) + sizes[first] <= 40:
            rows = slice(int(starts[first]), int(starts[first]) + sizes[first])
            np.testing.assert_array_equal(np.asarray(p[first, : sizes[first]]), np.asarray(a[rows]))
            np.testing.assert_array_equal(np.asarray(u[rows]), np.asarray(a[rows]))
