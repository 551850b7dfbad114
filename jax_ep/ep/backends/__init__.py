"""The backend seam: :class:`Backend`, which the modules ``xla`` and ``cuda`` implement, and the choice of one.

``jax_ep.ep.ops`` calls only these functions; each backend owns its fusions and fallbacks. Rows arrive as
they travel: a dispatch's ``x`` already packed as FP8 bytes where ``config.wire_dtype`` says so.
"""

from __future__ import annotations

import warnings
from collections.abc import Hashable
from typing import Any, Protocol

import jax

from ..._validate import check_choice
from ..types import Config, Dispatched, Handle, RowType
from . import xla

BACKENDS = ("auto", "xla", "cuda")
_warned: set[str] = set()
MaybeArray = jax.Array | None


class Backend(Protocol):
    """What a backend implements; every function runs on one rank inside ``shard_map``, layout rows flattened
    to ``[N, ...]``.

    The split ops' halves return state of the backend's own (a pytree) for the other half. The backward pass of
    a finish returns, besides the inputs' cotangents (None for zero), a cotangent for that state, which carries
    what the backward pass of the start needs. ``site`` is the call's site (``jax_ep.ep.call_sites``), which
    backend "cuda" puts in its tags.
    """

    def dispatch(self, config: Config, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
        """The whole dispatch: layout rows, weights, sizes, ``expert_load`` and the handle, under
        ``config.drop_policy``. ``row_expert`` stays None: the public ops derive it from ``group_sizes``."""

    def route(self, config: Config, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
        """A dispatch that moves no rows (``x`` has no columns): the routing, weights, sizes, ``expert_load`` and
        handle."""

    def transfer(self, handle: Handle, rows: jax.Array, *, site: int) -> jax.Array:
        """Token rows ``[T, W]`` along ``handle``: layout rows ``[N, W]``, as a dispatch moves them; 0 where no
        slot is held."""

    def combine(
        self,
        handle: Handle,
        rows: jax.Array,
        weights: MaybeArray,
        partial_dtype: Any,
        row_values: MaybeArray = None,
        *,
        site: int,
    ) -> tuple[jax.Array, MaybeArray]:
        """Combine: ``[T, H]`` sums, and with ``row_values [N]`` each slot's row value ``[T, K]`` (else None).

        It is also the backward pass of dispatch, with the weights' cotangent as ``row_values``."""

    def combine_backward(
        self, handle: Handle, cotangent: jax.Array, y: jax.Array, weights: MaybeArray, *, site: int
    ) -> tuple[jax.Array, MaybeArray]:
        """The backward pass of combine: ``dy = w * g`` and ``dweights = <g, y[row]>`` on held rows (dweights
        None without weights), exactly 0 on rows that hold no slot."""

    def dispatch_start(
        self, config: Config, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, x_type: RowType
    ) -> Any: ...

    def dispatch_finish(self, config: Config, started: Any) -> Dispatched:
        """What :meth:`dispatch` returns, ``expert_load`` included."""

    def dispatch_finish_backward(self, handle: Handle, rows_ct: jax.Array, weights_ct: jax.Array) -> Any:
        """The cotangent of ``started``: the start of a combine of the cotangent rows whose partial sums travel in
        ``handle.config.partial_dtype`` (dispatch's; None: ``rows_ct``'s dtype), as ops.py's whole-op backward
        passes ask :meth:`combine` for."""

    def dispatch_start_backward(
        self, config: Config, started: Any, dstarted: Any, x_type: RowType
    ) -> tuple[jax.Array, MaybeArray]:
        """``(dx, dtopk_weights)``."""

    def combine_start(
        self, handle: Handle, rows: jax.Array, weights: MaybeArray, partial_dtype: Any, *, site: int
    ) -> Any: ...

    def combine_finish(
        self,
        handle: Handle,
        rows: jax.Array,
        weights: MaybeArray,
        partial_dtype: Any,
        started: Any,
        *,
        site: int,
    ) -> jax.Array: ...

    def combine_finish_backward(
        self, handle: Handle, cotangent: jax.Array, y: jax.Array, weights: MaybeArray, *, site: int
    ) -> tuple[MaybeArray, MaybeArray, Any]:
        """``(dy, dweights, dstarted)``."""

    def combine_start_backward(
        self, handle: Handle, y: jax.Array, weights: MaybeArray, dstarted: Any, *, site: int
    ) -> tuple[MaybeArray, MaybeArray]:
        """``(dy, dweights)``."""


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


def module(backend: str) -> Backend:
    """The module implementing a resolved backend."""
    if backend == "cuda":
        from . import cuda

        return cuda
    return xla
