"""jax_ep.ep.division: float32 quotients rounded to nearest even, from a quotient up to 3 ulps off.

NumPy's float32 division is the oracle (IEEE). XLA's GPU division is up to 2 ulps off; here the quotients
handed to divide_from are the exact ones moved by -3..3 ulps, so the correction itself is what is tested.
"""

import jax
import numpy as np
import pytest

from jax_ep.ep import division as _division
from tests.gpu import gpu_devices, require_gpu
from tests.helpers import assert_bits_equal

N = 1 << 16


def _off_by(quotient: np.ndarray, ulps: int) -> np.ndarray:
    """``quotient`` moved by ``ulps`` along the float32 magnitudes (staying finite and on its side of 0)."""
    bits = quotient.view(np.uint32).astype(np.int64)
    magnitude = np.clip((bits & 0x7FFFFFFF) + ulps, 0, 0x7F7FFFFF)
    return (magnitude | (bits & 0x80000000)).astype(np.uint32).view(np.float32)


def _pairs(kind: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if kind == "normal":
        return rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    if kind == "any bits":  # every finite exponent: quotients that overflow or underflow are left out below
        a = rng.integers(1, 0x7F800000, N, dtype=np.uint32).view(np.float32)
        return a * np.where(rng.random(N) < 0.5, -1, 1).astype(np.float32), rng.integers(
            1, 0x7F800000, N, dtype=np.uint32
        ).view(np.float32)
    if kind == "fp8 scales":  # x / (amax / 448) for bfloat16 values
        x = rng.standard_normal(N).astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)
        amax = (np.abs(rng.standard_normal(N)) + 0.01).astype(np.float32)
        return x.view(np.float32), (amax / np.float32(448)).astype(np.float32)
    if kind == "subnormal quotients":
        a = rng.integers(1, 1 << 10, N).astype(np.float32) * np.float32(2.0**-140)
        return a, (np.float32(2.0) ** rng.integers(1, 20, N)).astype(np.float32)
    # "subnormal ties": a / b = odd * 2**-150, exactly halfway between two subnormals
    return (rng.integers(0, 1 << 12, N) * 2 + 1).astype(np.float32) * np.float32(2.0**-120), np.full(
        N, 2.0**30, np.float32
    )


@pytest.mark.parametrize("kind", ["normal", "any bits", "fp8 scales", "subnormal quotients", "subnormal ties"])
def test_quotients_within_3_ulps_become_the_correctly_rounded_one(kind):
    a, b = _pairs(kind, np.random.default_rng(len(kind)))
    with np.errstate(all="ignore"):
        want = (a / b).astype(np.float32)
    keep = np.isfinite(want) & (want != 0)
    a, b, want = a[keep], b[keep], want[keep]
    assert want.size > N // 4
    for ulps in range(-3, 4):
        start = _off_by(want, ulps)
        inside = (want.view(np.uint32) & 0x7FFFFFFF).astype(np.int64) + ulps >= 0
        got = np.asarray(_division.divide_from(a, b, start))
        assert_bits_equal(got[inside], want[inside], err_msg=f"{kind}, start {ulps} ulps off")


def test_divide_is_numpy_division_and_leaves_special_values():
    rng = np.random.default_rng(7)
    a, b = rng.standard_normal(N).astype(np.float32), rng.standard_normal(N).astype(np.float32)
    assert_bits_equal(np.asarray(_division.divide(a, b)), a / b)
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1.0, 3.0], np.float32)
    by = np.array([2.0, 5.0, 3.0, 2.0, 1.0, 0.0, -np.inf], np.float32)
    with np.errstate(all="ignore"):
        got, want = np.asarray(_division.divide(special, by)), special / by
        np.testing.assert_array_equal(got, want)  # NaN where NumPy has NaN (a GPU's NaN may carry other bits)
        assert_bits_equal(got[~np.isnan(want)], want[~np.isnan(want)])
    assert_bits_equal(np.asarray(jax.jit(_division.divide)(a[:5], np.float32(448))), a[:5] / np.float32(448))


@require_gpu("needs an NVIDIA GPU: XLA's own division there is approximate")
def test_divide_on_the_gpu_is_numpy_division():
    """On a GPU, XLA's float32 quotient is up to 2 ulps off (div.full.f32); divide's is NumPy's, bit for bit,
    and so are FP8's scales and quotients there."""
    rng = np.random.default_rng(11)
    a, b = rng.standard_normal(1 << 20).astype(np.float32), rng.standard_normal(1 << 20).astype(np.float32)
    gpu = gpu_devices()[0]
    a_gpu, b_gpu = jax.device_put(a, gpu), jax.device_put(b, gpu)
    raw = np.asarray(jax.jit(lambda a, b: a / b)(a_gpu, b_gpu))
    assert_bits_equal(np.asarray(_division.divide(a_gpu, b_gpu)), a / b)
    print(f"XLA's own quotient differs from NumPy's in {int((raw != a / b).sum())} of {a.size}")
    scale = (np.abs(b[:4096]) + 0.01).astype(np.float32)
    got = np.asarray(_division.divide(jax.device_put(scale, gpu), np.float32(448)))
    assert_bits_equal(got, (scale / np.float32(448)).astype(np.float32))
