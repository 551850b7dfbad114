"""Backend choice: which row exchange a dispatch uses."""

from __future__ import annotations

from collections.abc import Hashable
from types import ModuleType

from . import _cuda, _xla
from ._validate import check_choice

BACKENDS = ("auto", "xla", "cuda")


def resolve(backend: str, axis_name: Hashable, num_ranks: int) -> str:
    """The concrete backend ("xla" or "cuda") that ``backend`` names for this EP axis."""
    check_choice("backend", backend, BACKENDS)
    if backend == "xla":
        return "xla"
    reason = _cuda.not_ready_reason(axis_name, num_ranks)
    if backend == "cuda" and reason:
        raise ValueError(f"jax_ep: backend='cuda' cannot run here: {reason}")
    return "xla" if reason else "cuda"


def module(backend: str) -> ModuleType:
    """The module with ``exchange`` and ``local_layout`` for a resolved backend."""
    return _cuda if backend == "cuda" else _xla
