"""The backend seam: every backend implements the same three functions over a :class:`jax_ep.Handle`.

* ``dispatch(config, x, topk_idx, topk_weights) -> Dispatched``
* ``combine(handle, rows, weights, partial_dtype, row_values=None) -> (out [T, H], slot values [T, K] or None)``:
  the forward combine, and the backward pass of dispatch (with ``row_values``, the weights' cotangent).
* ``combine_backward(handle, cotangent [T, H], y, weights) -> (dy, dweights or None)``: the backward pass of
  combine; ``dy = w * g`` and ``dweights = <g, y[row]>`` on held rows, exactly 0 on rows that hold no slot.

and the split ops' halves and their backward passes (``dispatch_start``, ``dispatch_finish``,
``dispatch_finish_backward``, ``dispatch_start_backward``, and the same four for combine): a start returns a
tuple ``started`` for its finish; the backward pass of a finish returns, besides the inputs' cotangents (None
for zero), a cotangent for ``started`` that carries what the backward pass of the start needs.

``jax_ep._api`` calls only these; each backend owns its fusions and fallbacks.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from types import ModuleType

from .._validate import check_choice
from . import xla

BACKENDS = ("auto", "xla", "cuda")
_warned: set[str] = set()


def resolve(backend: str, axis_name: Hashable, num_ranks: int, topk: int, num_experts: int) -> tuple[str, int]:
    """The concrete backend ("xla" or "cuda") that ``backend`` names for this dispatch, and the cuda group id.

    ``"cuda"`` where it cannot run is a ValueError; ``"auto"`` then picks ``"xla"``, warning once per reason
    when the computation runs on GPUs.
    """
    check_choice("backend", backend, BACKENDS)
    if backend == "xla":
        return "xla", -1
    from . import cuda

    group, reason = cuda.find_group(axis_name, num_ranks, topk, num_experts)
    if group is not None:
        return "cuda", group
    if backend == "cuda":
        raise ValueError(f"jax_ep: backend='cuda' cannot run here: {reason}")
    if cuda.on_gpus() and reason not in _warned:
        _warned.add(reason)
        warnings.warn(f"jax_ep: backend='auto' uses 'xla' on these GPUs: {reason}", stacklevel=3)
    return "xla", -1


def module(backend: str) -> ModuleType:
    """The module implementing a resolved backend."""
    if backend == "cuda":
        from . import cuda

        return cuda
    return xla
