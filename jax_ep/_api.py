"""The public ops: argument checks, static sizes, backend choice and custom VJPs."""

from __future__ import annotations

import functools
from collections.abc import Hashable

import jax
import jax.numpy as jnp

from . import _backends, _ops
from ._types import LAYOUTS, Config, Dispatched, Handle
from ._validate import check_array, check_choice, check_positive_int


def default_capacity(
    *, num_ranks: int, num_tokens: int, topk: int, num_experts: int, layout: str = "ragged", expert_alignment: int = 1
) -> int:
    """The capacity ``C`` that ``capacity=None`` stands for.

    Ragged: ``R*T*min(K, L) + L*(expert_alignment-1)``; expert: ``R*T``. With
    distinct expert ids per token nothing is ever dropped at this size.
    """
    local_experts = num_experts // num_ranks
    if layout == "ragged":
        return num_ranks * num_tokens * min(topk, local_experts) + local_experts * (expert_alignment - 1)
    return num_ranks * num_tokens


def _axis_size(axis_name: Hashable) -> int:
    try:
        return jax.lax.axis_size(axis_name)
    except (NameError, KeyError, ValueError) as err:
        raise ValueError(
            f"jax_ep: axis_name={axis_name!r} is not a bound mesh axis; call dispatch inside "
            f"jax.shard_map over a mesh that has this axis ({err})"
        ) from None


def dispatch(
    x: jax.Array,
    topk_idx: jax.Array,
    topk_weights: jax.Array,
    *,
    num_experts: int,
    axis_name: Hashable,
    layout: str = "ragged",
    capacity: int | None = None,
    expert_alignment: int = 1,
    backend: str = "auto",
) -> Dispatched:
    """Send each token to the ranks of its top-k experts.

    Call inside ``jax.shard_map`` over the EP mesh axis ``axis_name`` (R ranks);
    every argument is this rank's shard.

    Args:
      x: ``[T, H]`` tokens, any floating dtype.
      topk_idx: ``[T, K]`` int32 global expert ids in ``[0, num_experts)``;
        -1 marks an unused slot, any other value is invalid and counted.
      topk_weights: ``[T, K]`` float32 routing weights.
      num_experts: E, a multiple of R. Expert ``e`` lives on rank ``e // L``.
      axis_name: the EP mesh axis.
      layout: ``"ragged"`` (expert segments one after another, for
        ``jax.lax.ragged_dot``) or ``"expert"`` (``[L, C, H]``).
      capacity: C, rows kept (ragged) or rows per local expert (expert);
        ``None`` is :func:`default_capacity`. Slots that do not fit are
        dropped and counted in ``num_dropped``.
      expert_alignment: ragged segments are padded to a multiple of this.
      backend: ``"auto"``, ``"xla"`` or ``"cuda"``.

    Returns:
      A :class:`Dispatched`; see its docstring for shapes.
    """
    check_array("x", x, ndim=2, kind="floating")
    num_tokens, hidden = x.shape
    check_array("topk_idx", topk_idx, ndim=2, dtype=jnp.int32, leading=(num_tokens,))
    check_array("topk_weights", topk_weights, shape=topk_idx.shape, dtype=jnp.float32)
    num_experts = check_positive_int("num_experts", num_experts)
    expert_alignment = check_positive_int("expert_alignment", expert_alignment)
    check_choice("layout", layout, LAYOUTS)
    if capacity is not None:
        capacity = check_positive_int("capacity", capacity)
    num_ranks = _axis_size(axis_name)
    if num_experts % num_ranks:
        raise ValueError(
            f"jax_ep.dispatch: num_experts must be a multiple of the size of axis {axis_name!r}; "
            f"expected a multiple of {num_ranks}, got {num_experts}"
        )
    topk = topk_idx.shape[1]
    if capacity is None:
        capacity = default_capacity(
            num_ranks=num_ranks,
            num_tokens=num_tokens,
            topk=topk,
            num_experts=num_experts,
            layout=layout,
            expert_alignment=expert_alignment,
        )
    config = Config(
        axis_name=axis_name,
        num_ranks=num_ranks,
        num_experts=num_experts,
        num_tokens=num_tokens,
        topk=topk,
        layout=layout,
        capacity=capacity,
        expert_alignment=expert_alignment,
        backend=_backends.resolve(backend, axis_name, num_ranks),
    )
    with jax.named_scope("jax_ep.dispatch"):
        return _dispatch(config, x, topk_idx, topk_weights)


def combine(y: jax.Array, handle: Handle, *, weights: jax.Array | None = None) -> jax.Array:
    """Bring expert outputs back to their tokens and sum them.

    ``out[t] = sum over delivered slots (t, k) of w * y[row of (t, k)]`` with
    ``w = weights[row]``, or 1 when ``weights`` is None. Sums are in float32.

    Args:
      y: expert outputs shaped like ``Dispatched.x`` (``[C, H]`` or
        ``[L, C, H]``), any floating dtype.
      handle: ``Dispatched.handle`` of the dispatch that made the layout.
      weights: optional, shaped like ``Dispatched.weights`` (``[C]`` or
        ``[L, C]``), floating; usually ``Dispatched.weights``.

    Returns:
      ``[T, H]`` in the dtype of ``y``.
    """
    if not isinstance(handle, Handle):
        raise TypeError(f"jax_ep.combine: handle must be a jax_ep.Handle (Dispatched.handle), got {type(handle)}")
    config = handle.config
    check_array("y", y, ndim=len(config.weights_shape) + 1, kind="floating", leading=config.weights_shape)
    if weights is not None:
        check_array("weights", weights, shape=config.weights_shape, kind="floating")
    with jax.named_scope("jax_ep.combine"):
        return _combine(y, handle, weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _dispatch(config: Config, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    return _ops.dispatch(config, x, topk_idx, topk_weights)


def _dispatch_fwd(config, x, topk_idx, topk_weights):
    result = _dispatch(config, x, topk_idx, topk_weights)
    return result, result.handle


def _dispatch_bwd(config, handle, cotangent):
    rows_ct = cotangent.x.reshape(config.num_rows, -1)
    dx = _ops.to_tokens(handle, rows_ct, None)
    dtopk_weights = _ops.slot_values_to_tokens(handle, cotangent.weights.reshape(-1))
    return dx, None, dtopk_weights


_dispatch.defvjp(_dispatch_fwd, _dispatch_bwd)


@jax.custom_vjp
def _combine(y: jax.Array, handle: Handle, weights: jax.Array | None) -> jax.Array:
    rows = y.reshape(handle.config.num_rows, -1)
    flat_weights = None if weights is None else weights.reshape(-1)
    return _ops.to_tokens(handle, rows, flat_weights)


def _combine_fwd(y, handle, weights):
    return _combine(y, handle, weights), (y, handle, weights)


def _combine_bwd(residuals, cotangent):
    y, handle, weights = residuals
    rows_ct = _ops.to_experts(handle, cotangent).astype(jnp.float32)
    rows_ct = rows_ct.reshape(y.shape)
    if weights is None:
        return rows_ct.astype(y.dtype), None, None
    # Padding rows get exactly 0, even where y or weights hold NaN or inf there.
    held = (handle.row_slot >= 0).reshape(weights.shape)
    dy = jnp.where(held[..., None], rows_ct * weights.astype(jnp.float32)[..., None], 0.0).astype(y.dtype)
    dweights = jnp.sum(rows_ct * jnp.where(held[..., None], y.astype(jnp.float32), 0.0), axis=-1)
    return dy, None, dweights.astype(weights.dtype)


_combine.defvjp(_combine_fwd, _combine_bwd)
