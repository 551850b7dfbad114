"""Rows on the wire as FP8 (``wire_dtype=jnp.float8_e4m3fn``): e4m3 values with one float32 scale per 128.

A packed row is ``W = ceil16(H + 4 * H / 128)`` bytes: the ``H`` e4m3 values, then the ``H / 128`` float32
scales (their bytes, little-endian), then zero bytes up to a multiple of 16. Every backend moves packed rows
as plain bytes, so both quantize and dequantize with the functions below and agree bit for bit.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from . import division

BLOCK = 128  # values per scale
E4M3_MAX = 448.0  # the largest finite float8_e4m3fn
WIRE_DTYPES = (jnp.dtype(jnp.float8_e4m3fn),)


def check_wire_dtype(wire_dtype: Any, hidden: int) -> jnp.dtype | None:
    """``wire_dtype`` as a dtype (None: rows travel in ``x``'s dtype); FP8 needs ``hidden % 128 == 0``."""
    if wire_dtype is None:
        return None
    try:
        dtype = jnp.dtype(wire_dtype)
    except TypeError:
        dtype = None
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"jax_ep.dispatch: wire_dtype must be None or jnp.float8_e4m3fn, got {wire_dtype!r}")
    if hidden % BLOCK:
        raise ValueError(
            f"jax_ep.dispatch: wire_dtype={dtype.name} sends one scale per {BLOCK} values, so the hidden size "
            f"must be a multiple of {BLOCK}; got H={hidden}"
        )
    return dtype


def packed_width(hidden: int) -> int:
    """Bytes of one packed row of ``hidden`` values."""
    return -(-(hidden + 4 * (hidden // BLOCK)) // 16) * 16


def quantize(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``x [..., H]`` -> e4m3 values ``[..., H]`` (as their uint8 bits) and float32 scales ``[..., H / 128]``.

    Per block of 128: ``scale = amax / 448`` (1 for an all-zero block), ``q = x / scale`` rounded to the
    nearest e4m3 (ties to even).
    """
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = jnp.max(jnp.abs(blocks), axis=-1)
    zero = amax == 0
    # Both divisions correctly rounded, as the contract (and the NumPy oracle) computes them: XLA's own are not
    # on GPUs, and XLA turns divisions by constants and broadcasts into multiplications by reciprocals.
    scale = jnp.where(zero, jnp.float32(1), division.divide(amax, jnp.float32(E4M3_MAX)))
    q = to_e4m3_bits(division.divide(blocks, scale[..., None]))
    return q.reshape(x.shape), scale


def to_e4m3_bits(v: jax.Array) -> jax.Array:
    """float32 -> the uint8 bits of float8_e4m3fn, rounded to nearest, ties to even (NaN past the largest).

    Integer arithmetic on the float32 bits, not ``astype``, so that the rounding never depends on how a
    platform converts (checked against ml_dtypes in tests/test_wire_fp8.py, and on an H200 over exact quotients).
    """
    bits = jax.lax.bitcast_convert_type(v, jnp.uint32)
    magnitude = bits & jnp.uint32(0x7FFFFFFF)
    # Normal e4m3 (|v| >= 2^-6): keep 3 of the 23 mantissa bits, ties to even; a carry moves into the exponent.
    kept = (magnitude + jnp.uint32(0x7FFFF) + ((magnitude >> 20) & jnp.uint32(1))) >> 20
    normal = kept.astype(jnp.int32) - ((127 - 7) << 3)
    # Subnormal e4m3 (|v| < 2^-6): multiples of 2^-9 (jnp.round rounds half to even).
    subnormal = jnp.round(jax.lax.bitcast_convert_type(magnitude, jnp.float32) * 512).astype(jnp.int32)
    code = jnp.where(magnitude < jnp.uint32(0x3C800000), subnormal, normal)  # 0x3C800000: 2^-6
    code = jnp.minimum(code, 0x7F).astype(jnp.uint8)  # 0x7F: NaN (inf, NaN, and past 464 round there)
    return code | ((bits >> 31).astype(jnp.uint8) << 7)


def from_e4m3_bits(code: jax.Array) -> jax.Array:
    """The uint8 bits of float8_e4m3fn -> float32, exactly."""
    c = code.astype(jnp.uint32)
    exponent, mantissa = (c >> 3) & jnp.uint32(0xF), c & jnp.uint32(7)
    normal = jax.lax.bitcast_convert_type(((exponent + 120) << 23) | (mantissa << 20), jnp.float32)
    value = jnp.where(exponent == 0, mantissa.astype(jnp.float32) * jnp.float32(2.0**-9), normal)
    value = jnp.where((c & jnp.uint32(0x7F)) == 0x7F, jnp.float32(jnp.nan), value)
    return jnp.where((c >> 7) == 1, -value, value)


def dequantize(q: jax.Array, scale: jax.Array, dtype: Any) -> jax.Array:
    """e4m3 bits ``q`` (uint8) times their block's scale, in ``dtype``: ``(q * scale).astype(dtype)``."""
    blocks = from_e4m3_bits(q).reshape(*q.shape[:-1], q.shape[-1] // BLOCK, BLOCK)
    return (blocks * scale[..., None]).reshape(q.shape).astype(dtype)


def pack(x: jax.Array) -> jax.Array:
    """``x [T, H]`` -> packed rows ``[T, W]`` uint8."""
    q, scale = quantize(x)
    rows, hidden = x.shape
    parts = [
        q,
        jax.lax.bitcast_convert_type(scale, jnp.uint8).reshape(rows, 4 * (hidden // BLOCK)),
    ]
    pad = packed_width(hidden) - hidden - 4 * (hidden // BLOCK)
    if pad:
        parts.append(jnp.zeros((rows, pad), jnp.uint8))
    return jnp.concatenate(parts, axis=-1)


def unpack(rows: jax.Array, hidden: int, dtype: Any) -> jax.Array:
    """Packed rows ``[N, W]`` -> ``[N, H]`` in ``dtype``; a row of zero bytes gives zeros."""
    q = rows[:, :hidden]
    scale_bytes = rows[:, hidden : hidden + 4 * (hidden // BLOCK)].reshape(rows.shape[0], hidden // BLOCK, 4)
    return dequantize(q, jax.lax.bitcast_convert_type(scale_bytes, jnp.float32), dtype)


def wire_rows(x: jax.Array, wire_dtype: str | None) -> jax.Array:
    """The rows of a dispatch as they travel: ``x``, or its packed FP8 rows (``wire_dtype`` a Config's)."""
    return x if wire_dtype is None else pack(x)
