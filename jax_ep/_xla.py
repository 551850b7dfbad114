"""The "xla" backend's row exchange: ``lax.all_to_all`` of the whole buffer, on any platform."""

from __future__ import annotations

import jax

from ._layout import local_layout
from ._types import Config

__all__ = ["exchange", "local_layout"]


def exchange(buffer: jax.Array, counts: jax.Array, config: Config) -> tuple[jax.Array, jax.Array]:
    """Row ``d`` of ``buffer [R, ...]`` goes to rank ``d``; row ``r`` of the result came from rank ``r``.

    All rows travel (the padding too); ``counts [R]`` travels alongside.
    """
    received = jax.lax.all_to_all(buffer, config.axis_name, 0, 0, tiled=True)
    received_counts = jax.lax.all_to_all(counts, config.axis_name, 0, 0, tiled=True)
    return received, received_counts
