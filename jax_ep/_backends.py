"""Backend choice: which implementation runs a dispatch."""

from __future__ import annotations

from types import ModuleType

from ._validate import check_choice

BACKENDS = ("auto", "xla", "cuda")


def resolve(backend: str) -> str:
    """The concrete backend ("xla" or "cuda") that ``backend`` names here."""
    check_choice("backend", backend, BACKENDS)
    if backend == "cuda":
        raise ValueError(
            "jax_ep: backend='cuda' was asked for, but the CUDA dispatch/combine kernels are not part of "
            "this build; use backend='xla' or 'auto'"
        )
    return "xla"


def module(backend: str) -> ModuleType:
    """The module that implements a resolved backend."""
    from . import _xla

    return _xla
