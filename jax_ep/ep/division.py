"""float32 division rounded to nearest even on every platform.

XLA's GPU backend divides float32 with PTX ``div.full.f32``, which is within 2 ulps of the quotient but not
correctly rounded (openxla/xla#37181), and XLA may turn a division by a broadcast into a multiplication by a
reciprocal. :func:`divide` takes XLA's quotient and moves it to the correctly rounded one, comparing the
dividend exactly, in integer arithmetic, with the divisor times the midpoints between neighbouring floats.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ULPS = 3  # how far XLA's quotient may be: div.full.f32 is within 2 ulps, a reciprocal times a value about as close


def _u32(value: int) -> jax.Array:
    return jnp.uint32(value)


def _parts(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The bits of a non-negative finite float32 v -> (significand, exponent), v = significand * 2**exponent."""
    field = bits >> 23
    fraction = bits & _u32(0x7FFFFF)
    significand = jnp.where(field == 0, fraction, fraction | _u32(0x800000))
    exponent = jnp.maximum(field, _u32(1)).astype(jnp.int32) - 150
    return significand, exponent


def _bit_length(x: jax.Array) -> jax.Array:
    return 32 - jax.lax.clz(x).astype(jnp.int32)


def _shift_left(hi: jax.Array, lo: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 64-bit (hi, lo) shifted left by n in [0, 63] (every shift below kept under 32 bits)."""
    small = n < 32
    m = jnp.where(small, n, n - 32).astype(jnp.uint32)
    carried = jnp.where(m == 0, _u32(0), lo >> jnp.where(m == 0, _u32(1), _u32(32) - m))
    return jnp.where(small, (hi << m) | carried, lo << m), jnp.where(small, lo << m, _u32(0))


def _compare(
    a: tuple[jax.Array, jax.Array], b: tuple[jax.Array, jax.Array], low: jax.Array, high: jax.Array
) -> jax.Array:
    """sign(a - b * (low + high) / 2) for positive finite a and b, given by their _parts, and adjacent floats
    0 <= low < high, given by their bits (integers throughout: no flushing of subnormals)."""
    (sig_a, exp_a), (sig_b, exp_b) = a, b
    sig_l, exp_l = _parts(low)
    sig_h, exp_h = _parts(high)
    # The midpoint is M * 2**(exp_l - 1): high's exponent is exp_l or exp_l + 1.
    m = sig_l + (sig_h << (exp_h - exp_l).astype(jnp.uint32))
    # P = M * sig_b, up to 50 bits, as (hi, lo) from 16-bit halves.
    m1, m0 = m >> 16, m & _u32(0xFFFF)
    b1, b0 = sig_b >> 16, sig_b & _u32(0xFFFF)
    low_part, cross = m0 * b0, m1 * b0 + m0 * b1
    p_lo = low_part + ((cross & _u32(0xFFFF)) << 16)
    p_hi = m1 * b1 + (cross >> 16) + (p_lo < low_part).astype(jnp.uint32)
    # Compare sig_a * 2**s with P, s = exp_a - (exp_l - 1 + exp_b): first by bit length, then by value.
    s = exp_a - (exp_l - 1 + exp_b)
    length_a = _bit_length(sig_a) + jnp.maximum(s, 0)
    length_p = jnp.where(p_hi != 0, 32 + _bit_length(p_hi), _bit_length(p_lo)) + jnp.maximum(-s, 0)
    zero = jnp.zeros_like(sig_a)
    x_hi, x_lo = _shift_left(zero, sig_a, jnp.clip(s, 0, 63))
    y_hi, y_lo = _shift_left(p_hi, p_lo, jnp.clip(-s, 0, 63))
    greater = (x_hi > y_hi) | ((x_hi == y_hi) & (x_lo > y_lo))
    equal = (x_hi == y_hi) & (x_lo == y_lo)
    by_value = jnp.where(equal, 0, jnp.where(greater, 1, -1))
    return jnp.where(length_a == length_p, by_value, jnp.sign(length_a - length_p))


@jax.jit
def divide_from(a: jax.Array, b: jax.Array, quotient: jax.Array) -> jax.Array:
    """The correctly rounded a / b, from ``quotient`` within ULPS ulps of it (the result is ``quotient``
    where a, b or the result is not finite, or a or b is 0).

    A binary search over the 2 * ULPS + 1 candidates: each step compares a / b with the midpoint between two
    neighbouring candidates (3 comparisons for ULPS = 3); a quotient exactly on a midpoint takes the even one.
    """
    a, b, quotient = jnp.broadcast_arrays(a, b, quotient)
    bits_a, bits_b, bits_q = (jax.lax.bitcast_convert_type(v, jnp.uint32) for v in (a, b, quotient))
    magnitude = _u32(0x7FFFFFFF)
    abs_a, abs_b, q = bits_a & magnitude, bits_b & magnitude, bits_q & magnitude
    infinity = _u32(0x7F800000)
    finite = (abs_a < infinity) & (abs_b < infinity) & (abs_a != 0) & (abs_b != 0) & (q < infinity)
    one = _u32(0x3F800000)
    parts_a, parts_b = (_parts(jnp.where(finite, v, one)) for v in (abs_a, abs_b))
    q = jnp.where(finite, q, one).astype(jnp.int32)

    def candidate(k: jax.Array) -> jax.Array:  # the bits of q moved by k ulps, kept finite and >= 0
        return jnp.clip(q + k, 0, 0x7F7FFFFF).astype(jnp.uint32)

    lo, hi = jnp.full_like(q, -ULPS), jnp.full_like(q, ULPS)
    for _ in range((2 * ULPS).bit_length()):
        j = (lo + hi) >> 1  # compare with the midpoint between candidates j and j + 1
        below, above = candidate(j), candidate(j + 1)
        order = _compare(parts_a, parts_b, below, above)
        tie = jnp.where(above % 2 == 0, j + 1, j)
        open_ = lo < hi
        lo = jnp.where(open_ & (order > 0), j + 1, jnp.where(open_ & (order == 0), tie, lo))
        hi = jnp.where(open_ & (order < 0), j, jnp.where(open_ & (order == 0), tie, hi))
    sign = (bits_a ^ bits_b) & _u32(0x80000000)
    corrected = jax.lax.bitcast_convert_type(candidate(lo) | sign, jnp.float32)
    return jnp.where(finite, corrected, quotient)


@jax.jit
def divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """a / b in float32, rounded to nearest even, on every platform."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return divide_from(a, b, a / b)
