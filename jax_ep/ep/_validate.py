"""Trace-time argument checks with messages that name the argument, the expected and the actual value."""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np


def check_positive_int(name: str, value: Any, *, minimum: int = 1) -> int:
    """``value`` is an integer (Python or NumPy, not bool) >= ``minimum`` (1 or 0); returns it as a Python int."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"jax_ep: {name} must be an int, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        what = "a positive int" if minimum == 1 else f"an int >= {minimum}"
        raise ValueError(f"jax_ep: {name} must be {what}, got {value}")
    return int(value)


def check_choice(name: str, value: Any, choices: Sequence[str]) -> None:
    """``value`` is one of ``choices``."""
    if value not in choices:
        raise ValueError(f"jax_ep: {name} must be one of {tuple(choices)}, got {value!r}")


def check_array(
    name: str,
    value: Any,
    *,
    ndim: int | None = None,
    shape: tuple[int, ...] | None = None,
    leading: tuple[int, ...] = (),
    dtype: Any = None,
    kind: str | None = None,
) -> None:
    """``value`` is an array of the given rank, exact shape, leading dims, dtype or dtype kind (``"floating"`` or
    ``"integer"``, bool not included)."""
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise TypeError(f"jax_ep: {name} must be an array, got {type(value).__name__}")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise ValueError(f"jax_ep: {name} must have shape {tuple(shape)}, got {tuple(value.shape)}")
    if ndim is not None and value.ndim != ndim:
        raise ValueError(f"jax_ep: {name} must have {ndim} dimensions, got shape {tuple(value.shape)}")
    if tuple(value.shape[: len(leading)]) != tuple(leading):
        raise ValueError(
            f"jax_ep: {name} must have leading dimensions {tuple(leading)}, got shape {tuple(value.shape)}"
        )
    if dtype is not None and value.dtype != jnp.dtype(dtype):
        raise TypeError(f"jax_ep: {name} must have dtype {jnp.dtype(dtype).name}, got {value.dtype}")
    if kind == "floating" and not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(f"jax_ep: {name} must have a floating dtype, got {value.dtype}")
    if kind == "integer" and not jnp.issubdtype(value.dtype, jnp.integer):
        raise TypeError(f"jax_ep: {name} must have an integer dtype, got {value.dtype}")


def check_float_dtype(name: str, value: Any) -> jnp.dtype:
    """``value`` names a floating dtype; returns it as a NumPy dtype."""
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        raise TypeError(f"jax_ep: {name} must be a floating dtype, got {value!r}") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(f"jax_ep: {name} must be a floating dtype, got {dtype}")
    return dtype
