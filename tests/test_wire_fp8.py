"""dispatch(..., wire_dtype=jnp.float8_e4m3fn): rows as e4m3 with one float32 scale per 128 values.

The oracle quantizes with NumPy and ml_dtypes, independently of jax_ep.ep.fp8.
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import jax_ep
from jax_ep.ep import fp8 as _fp8
from tests.helpers import (
    AXIS,
    assert_bits_equal,
    ep_jit,
    quantize_dequantize,
    random_inputs,
    routing,
    run_dispatch,
    slow,
    specified,
    to_numpy,
)

R, T, K, E = 2, 8, 3, 8


@pytest.mark.parametrize("layout", ["ragged", "expert"])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, slow(jnp.float32)])
def test_fp8_rows_are_the_contract_formula_bit_for_bit(layout, dtype):
    rng = np.random.default_rng(0)
    x, w = random_inputs(rng, R, T, 256, K, dtype)
    x[0, 2, :128] = 0  # an all-zero block: scale 1
    x[1, 3, 5] = 3e4  # a block with a huge outlier
    idx = routing(rng, "random", R, T, K, E)
    kw = dict(num_experts=E, layout=layout, expert_alignment=2)
    got = run_dispatch(x, idx, w, wire_dtype=jnp.float8_e4m3fn, **kw)
    plain = run_dispatch(quantize_dequantize(x), idx, w, **kw)
    assert_bits_equal(specified(got.x, got.group_sizes), specified(plain.x, plain.group_sizes))
    for name in ("weights", "group_sizes", "num_dropped", "num_invalid"):
        assert_bits_equal(getattr(got, name), getattr(plain, name), err_msg=name)
    assert np.isfinite(got.x.astype(np.float32)).all()
    exact = run_dispatch(x, idx, w, **kw)
    assert not np.array_equal(exact.x, got.x)  # FP8 did change the values


def test_the_packed_row_is_values_then_scales():
    x = jnp.asarray(np.random.default_rng(1).standard_normal((3, 256)), jnp.bfloat16)
    rows = _fp8.pack(x)
    assert rows.dtype == jnp.uint8 and rows.shape == (3, _fp8.packed_width(256)) == (3, 272)
    q, scale = _fp8.quantize(x)
    np.testing.assert_array_equal(np.asarray(rows[:, :256]), np.asarray(q))
    np.testing.assert_array_equal(np.asarray(rows[:, 256:264]).view(np.float32), np.asarray(scale))
    assert not np.asarray(rows[:, 264:]).any()
    assert_bits_equal(np.asarray(_fp8.unpack(rows, 256, jnp.bfloat16)), quantize_dequantize(np.asarray(x)))
    zeros = _fp8.unpack(jnp.zeros((2, 272), jnp.uint8), 256, jnp.bfloat16)  # padding rows stay zero
    assert not np.asarray(zeros).astype(np.float32).any()


def test_the_e4m3_conversions_match_ml_dtypes_bit_for_bit():
    """jax_ep.ep.fp8's integer rounding to e4m3 (ties to even, NaN past 464) and its exact way back, against
    ml_dtypes over every e4m3 value, the ties between neighbours, subnormals, and random float32 values."""
    codes = np.arange(256, dtype=np.uint8)
    values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    finite = values[np.isfinite(values)]
    ties = (np.sort(finite)[1:] + np.sort(finite)[:-1]) / 2  # halfway between neighbours: exact in float32
    rng = np.random.default_rng(3)
    samples = np.concatenate(
        [
            finite,
            ties,
            np.nextafter(ties, np.inf),
            np.nextafter(ties, -np.inf),
            rng.standard_normal(200_000).astype(np.float32) * 50,
            rng.uniform(-(2**-6), 2**-6, 50_000).astype(np.float32),
            np.array(
                [448, 460, 464, 464.01, 470, 480, 1e6, np.inf, -np.inf, np.nan, 0.0, -0.0, 2.0**-10, 2.0**-9 * 1.5],
                np.float32,
            ),
        ]
    ).astype(np.float32)
    want = samples.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    got = np.asarray(jax.jit(_fp8.to_e4m3_bits)(samples))
    nan = np.isnan(samples.astype(ml_dtypes.float8_e4m3fn).astype(np.float32))
    np.testing.assert_array_equal(got[~nan], want[~nan])
    assert ((got[nan] & 0x7F) == 0x7F).all()  # NaN (ml_dtypes may set the sign bit differently)
    back = np.asarray(jax.jit(_fp8.from_e4m3_bits)(codes))
    assert_bits_equal(back[np.isfinite(values)], values[np.isfinite(values)])
    assert np.isnan(back[~np.isfinite(values)]).all()


def test_the_gradient_passes_straight_through():
    """d/dx of a loss of the FP8 dispatch equals that of the dispatch without FP8, bit for bit."""
    rng = np.random.default_rng(2)
    x, w = random_inputs(rng, R, T, 128, K, np.float32)
    idx = routing(rng, "distinct", R, T, K, E)
    c = rng.standard_normal((R, R * T * K, 128)).astype(np.float32)

    def grads(wire_dtype):
        def loss(x, idx, w, c):
            d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, wire_dtype=wire_dtype)
            return jnp.sum(d.x * c) + jnp.sum(d.weights * 2.0)

        return to_numpy(ep_jit(jax.grad(loss, argnums=(0, 2)), R)(x, idx, w, c))

    for got, want in zip(grads(jnp.float8_e4m3fn), grads(None), strict=True):
        assert_bits_equal(got, want)
        assert np.abs(want).sum() > 0


@pytest.mark.slow  # an accuracy figure; the bits of the formula are checked above in the default tier
def test_quantization_error_of_activation_like_rows():
    """Relative RMS error of one FP8 round trip over normal and heavy-tailed rows stays within e4m3's 3
    mantissa bits (the figures of docs/guide.md)."""
    rng = np.random.default_rng(3)
    normal = rng.standard_normal((512, 7168)).astype(np.float32)
    heavy = rng.standard_t(3, (512, 7168)).astype(np.float32)
    for rows in (normal, heavy):
        x = rows.astype(ml_dtypes.bfloat16)
        back = np.asarray(_fp8.unpack(_fp8.pack(jnp.asarray(x)), 7168, jnp.bfloat16)).astype(np.float32)
        ref = x.astype(np.float32)
        relative = np.sqrt(np.mean((back - ref) ** 2) / np.mean(ref**2))
        assert 0.005 < relative < 0.05, relative


@pytest.mark.parametrize("bad", [jnp.float8_e5m2, jnp.bfloat16, "fp8"])
def test_wire_dtype_must_be_e4m3(bad):
    rng = np.random.default_rng(4)
    x, w = random_inputs(rng, 1, T, 128, K)
    with pytest.raises(ValueError, match="wire_dtype"):
        run_dispatch(x, routing(rng, "distinct", 1, T, K, E), w, num_experts=E, wire_dtype=bad)


def test_fp8_needs_a_hidden_size_multiple_of_128():
    rng = np.random.default_rng(5)
    x, w = random_inputs(rng, 1, T, 200, K)
    with pytest.raises(ValueError, match=r"multiple of 128; got H=200"):
        run_dispatch(x, routing(rng, "distinct", 1, T, K, E), w, num_experts=E, wire_dtype=jnp.float8_e4m3fn)
