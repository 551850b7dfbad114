"""The "xla" backend: dispatch and combine in pure JAX over ``lax.all_to_all``, on any platform.

Each token travels once per destination rank; the receiver expands the tokens into the layout with a gather;
combine reduces a token's slots on the expert side and sends one partial row per (token, rank) back. Every
function runs on one rank inside ``shard_map``; layout rows are flattened to ``[N, ...]``.

Two exchanges move the tokens (``Config.xla_exchange``), with the same results bit for bit:

* ``"dense"``: each trip sends a buffer of ``[R, T, ...]`` with ``lax.all_to_all``: row ``d`` holds the tokens
  for rank ``d`` in token order, ``send_counts[d]`` of them, and rows past them travel too.
* ``"ragged"``: each trip sends each (token, destination rank) pair once with ``lax.ragged_all_to_all``. The
  send buffer holds the tokens for each destination one after another (at most ``T * min(R, K)`` rows); the
  receiver puts the tokens of source ``s`` at rows ``[s * T, s * T + recv_counts[s])`` of ``[R * T, ...]``, as
  the dense exchange does. On the way back each expert rank writes its partial sums into the source's packed
  buffer, at offsets that one all-to-all of ``R`` integers tells it.
* ``"auto"``: ``"ragged"`` on TPU, ``"dense"`` elsewhere (XLA:CPU does not implement ``ragged_all_to_all``),
  chosen per platform when the computation is lowered (``jax.lax.platform_dependent``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from .routing import assign_rows, local_layout
from .types import Config, Dispatched, Handle, RowType

# The ragged exchange's primitive, looked up at each call: tests on CPU, whose XLA lacks it, put an emulation of
# its documented semantics here (tests/helpers.py).
ragged_all_to_all = jax.lax.ragged_all_to_all


def _all_to_all(buffer: jax.Array, config: Config) -> jax.Array:
    """Row ``d`` of ``buffer [R, ...]`` goes to rank ``d``; row ``r`` of the result came from rank ``r``."""
    return jax.lax.all_to_all(buffer, config.axis_name, 0, 0, tiled=True)


def _take(values: jax.Array, index: jax.Array, fill: int = 0) -> jax.Array:
    """``values[index]`` along axis 0, ``fill`` where ``index < 0``."""
    return jnp.take(values, jnp.where(index < 0, values.shape[0], index), axis=0, mode="fill", fill_value=fill)


class DenseExchange:
    """Token rows in ``[R, T, ...]`` buffers through ``lax.all_to_all``.

    A send buffer has ``send_rows`` rows; the tokens for rank ``d`` start at its row ``starts(send_counts)[d]``.
    Both exchanges receive the ``i``-th token of source ``s`` at row ``s * T + i`` of ``[R * T, ...]``.
    """

    def __init__(self, config: Config) -> None:
        self.config = config

    @property
    def send_rows(self) -> int:
        return self.config.num_ranks * self.config.num_tokens

    def starts(self, send_counts: jax.Array) -> jax.Array:
        """``[R]``: the first row of each destination's tokens in a send buffer."""
        return jnp.arange(self.config.num_ranks, dtype=jnp.int32) * self.config.num_tokens

    def to_experts(self, buffer: jax.Array, send_counts: jax.Array, recv_counts: jax.Array) -> jax.Array:
        """A send buffer ``[send_rows, ...]`` -> what the sources sent here, ``[R * T, ...]``."""
        del send_counts, recv_counts
        return self._swap(buffer)

    def to_sources(
        self, values: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, starts: jax.Array
    ) -> jax.Array:
        """``values [R * T, ...]``, one row per received token, back to their sources: ``[send_rows, ...]``, the
        row of my ``i``-th token sent to rank ``d`` at ``starts[d] + i``."""
        del send_counts, recv_counts, starts
        return self._swap(values)

    def _swap(self, rows: jax.Array) -> jax.Array:
        config = self.config
        blocks = rows.reshape(config.num_ranks, config.num_tokens, *rows.shape[1:])
        return _all_to_all(blocks, config).reshape(rows.shape)


class RaggedExchange(DenseExchange):
    """Each (token, destination rank) pair once, through ``lax.ragged_all_to_all`` (module attribute
    :data:`ragged_all_to_all`)."""

    @property
    def send_rows(self) -> int:
        return self.config.num_tokens * min(self.config.num_ranks, self.config.topk)

    def starts(self, send_counts: jax.Array) -> jax.Array:
        return jnp.cumsum(send_counts, dtype=jnp.int32) - send_counts

    def to_experts(self, buffer: jax.Array, send_counts: jax.Array, recv_counts: jax.Array) -> jax.Array:
        config = self.config
        output = jax.lax.full_like(buffer, 0, shape=(config.num_ranks * config.num_tokens, *buffer.shape[1:]))
        here = jax.lax.axis_index(config.axis_name).astype(jnp.int32) * config.num_tokens
        offsets = jnp.broadcast_to(here, (config.num_ranks,))  # where this rank's tokens land on each receiver
        return self._send(buffer, output, self.starts(send_counts), send_counts, offsets, recv_counts)

    def to_sources(
        self, values: jax.Array, send_counts: jax.Array, recv_counts: jax.Array, starts: jax.Array
    ) -> jax.Array:
        config = self.config
        output = jax.lax.full_like(values, 0, shape=(self.send_rows, *values.shape[1:]))
        blocks = jnp.arange(config.num_ranks, dtype=jnp.int32) * config.num_tokens
        their_starts = _all_to_all(starts, config)  # each source's row for this rank's tokens
        return self._send(values, output, blocks, recv_counts, their_starts, send_counts)

    def _send(self, operand, output, input_offsets, send_sizes, output_offsets, recv_sizes) -> jax.Array:
        return ragged_all_to_all(
            operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, axis_name=self.config.axis_name
        )


EXCHANGES = {"dense": DenseExchange, "ragged": RaggedExchange}


def _by_platform(config: Config, op, *args):
    """``op(exchange, *args)`` with the exchange ``config.xla_exchange`` names; ``"auto"``: ragged on TPU, dense
    elsewhere, picked when the computation is lowered for its platform."""
    if config.xla_exchange != "auto":
        return op(EXCHANGES[config.xla_exchange](config), *args)
    ragged, dense = (functools.partial(op, EXCHANGES[name](config)) for name in ("ragged", "dense"))
    return jax.lax.platform_dependent(*args, tpu=ragged, default=dense)


def _send_pairs(exchange: DenseExchange, token_dest_pos: jax.Array, starts: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The token ``[P]`` and destination rank ``[P]`` of each row of a send buffer; -1 and ``R`` on rows that
    hold none."""
    num_tokens, num_ranks = token_dest_pos.shape
    rows = jnp.where(token_dest_pos < 0, exchange.send_rows, starts[None, :] + token_dest_pos).reshape(-1)
    tokens = jnp.broadcast_to(jnp.arange(num_tokens, dtype=jnp.int32)[:, None], (num_tokens, num_ranks))
    ranks = jnp.broadcast_to(jnp.arange(num_ranks, dtype=jnp.int32), (num_tokens, num_ranks))
    token = jnp.full(exchange.send_rows, -1, jnp.int32).at[rows].set(tokens.reshape(-1), mode="drop")
    dest = jnp.full(exchange.send_rows, num_ranks, jnp.int32).at[rows].set(ranks.reshape(-1), mode="drop")
    return token, dest


def dispatch(config: Config, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    """Forward dispatch on one rank; see :func:`jax_ep.dispatch`."""
    d = route(config, topk_idx, topk_weights)
    return dataclasses.replace(d, x=transfer(d.handle, x).reshape(config.layout_shape(x.shape[-1])))


def route(config: Config, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    """A dispatch that moves no rows: its ``x`` has no columns."""
    return _by_platform(config, _route, topk_idx, topk_weights)


def _route(exchange: DenseExchange, topk_idx: jax.Array, topk_weights: jax.Array) -> Dispatched:
    config = exchange.config
    num_ranks, num_tokens, topk = config.num_ranks, config.num_tokens, config.topk
    local = local_layout(topk_idx, config.num_experts, num_ranks)
    all_counts = _all_to_all(jnp.broadcast_to(local.expert_count, (num_ranks, config.num_experts)), config)
    rank = jax.lax.axis_index(config.axis_name)
    rows = assign_rows(topk_idx, local.slot_rank, all_counts, rank, config)

    send_counts = local.rank_token_count
    recv_counts = _all_to_all(send_counts, config)
    send_token, send_dest = _send_pairs(exchange, local.token_dest_pos, exchange.starts(send_counts))
    # One gather of the rank of each kept slot (-1 for dropped slots, which send nothing). With a second gather
    # of slot_row here, XLA's GPU fusion recomputed the row tables inside consumers of recv_rows.
    kept_dest = jnp.where(rows.slot_row >= 0, rows.slot_dest, -1)
    for_rank = _take(kept_dest, send_token, fill=-1) == send_dest[:, None]
    send_rows = jnp.where(for_rank, _take(rows.slot_row, send_token), -1)
    send_weights = jnp.where(for_rank, _take(topk_weights, send_token), 0.0)
    send_meta = jnp.concatenate([send_rows, jax.lax.bitcast_convert_type(send_weights, jnp.int32)], axis=-1)
    recv_meta = exchange.to_experts(send_meta, send_counts, recv_counts).reshape(num_ranks, num_tokens, 2 * topk)
    sent = (jnp.arange(num_tokens, dtype=jnp.int32)[None, :] < recv_counts[:, None])[..., None]
    recv_rows = jnp.where(sent, recv_meta[..., :topk], -1)
    recv_weights = jnp.where(sent, jax.lax.bitcast_convert_type(recv_meta[..., topk:], jnp.float32), 0.0).reshape(-1)

    slots = jnp.arange(num_ranks * num_tokens * topk, dtype=jnp.int32)
    flat_rows = recv_rows.reshape(-1)
    # row_slot is the scatter's own output: the ragged rows past the data (-2, Handle) are marked in the array
    # the slots are scattered into (no slot lands past the data), not by a select on the scatter's result,
    # which XLA fuses into every consumer of row_slot and of d.x.
    empty = jnp.full(config.num_rows, -1, jnp.int32)
    if config.layout == "ragged":
        empty = jnp.where(jnp.arange(config.num_rows, dtype=jnp.int32) < jnp.sum(rows.group_sizes), empty, -2)
    row_slot = empty.at[jnp.where(flat_rows < 0, config.num_rows, flat_rows)].set(slots, mode="drop")
    handle = Handle(local.token_dest_pos, send_counts, rows.slot_dest, recv_rows, recv_counts, row_slot, config)
    return Dispatched(
        x=jnp.zeros(config.layout_shape(0), topk_weights.dtype),
        weights=_take(recv_weights, row_slot).reshape(config.weights_shape),
        group_sizes=rows.group_sizes,
        num_dropped=rows.num_dropped,
        num_invalid=local.num_invalid,
        expert_load=rows.expert_load,
        handle=handle,
    )


def transfer(handle: Handle, x: jax.Array, *, site: int = 0) -> jax.Array:
    """Token rows ``x [T, H]`` along the routing of ``handle``: layout rows ``[N, H]``, zero where no slot is held.

    Each token goes once to every rank it is routed to; there it fills the rows of its slots.
    """
    return _by_platform(handle.config, _transfer, handle, x)


def _transfer(exchange: DenseExchange, handle: Handle, x: jax.Array) -> jax.Array:
    config = handle.config
    send_token, _ = _send_pairs(exchange, handle.token_dest_pos, exchange.starts(handle.send_counts))
    recv_x = exchange.to_experts(_take(x, send_token), handle.send_counts, handle.recv_counts)
    row_slot = handle.row_slot
    return _take(recv_x, jnp.where(row_slot < 0, -1, row_slot // config.topk))


def _rows_in_order(recv_rows: jax.Array) -> jax.Array:
    """Each token's delivered rows ``[..., K]`` in ascending row order, -1 (no slot) last."""
    big = jnp.iinfo(jnp.int32).max
    ordered = jnp.sort(jnp.where(recv_rows < 0, big, recv_rows), axis=-1)
    return jnp.where(ordered == big, -1, ordered)


def combine(
    handle: Handle,
    rows: jax.Array,
    weights: jax.Array | None,
    partial_dtype: Any,
    row_values: jax.Array | None = None,
    *,
    site: int = 0,
) -> tuple[jax.Array, jax.Array | None]:
    """Weighted sum of layout rows ``rows [N, H]`` back onto tokens: ``[T, H]`` in ``rows.dtype``.

    Each rank sums a token's delivered rows in float32 in ascending row order,
    rounds that partial sum to ``partial_dtype`` and sends it once; the source
    adds the ranks' partial sums in float32 in ascending rank order and rounds
    once to ``rows.dtype``. With ``row_values [N]``, also returns each slot's
    row value ``[T, K]`` float32 (0 where the slot was not delivered).
    """
    return _by_platform(
        handle.config, functools.partial(_combine, partial_dtype=partial_dtype), handle, rows, weights, row_values
    )


def _combine(exchange, handle, rows, weights, row_values, *, partial_dtype):
    config = handle.config
    num_ranks, num_tokens = config.num_ranks, config.num_tokens
    held = handle.recv_rows.reshape(num_ranks * num_tokens, config.topk)
    ordered = _rows_in_order(held)
    partial = jnp.zeros((ordered.shape[0], rows.shape[-1]), jnp.float32)
    for k in range(config.topk):
        term = _take(rows, ordered[:, k]).astype(jnp.float32)
        if weights is not None:
            term = _take(weights, ordered[:, k]).astype(jnp.float32)[:, None] * term
        partial = partial + term
    counts = (handle.send_counts, handle.recv_counts)
    starts = exchange.starts(handle.send_counts)
    # back: my i-th token sent to rank d has its partial sum from d at row starts[d] + i
    back = exchange.to_sources(partial.astype(partial_dtype), *counts, starts)
    pos = handle.token_dest_pos
    total = jnp.zeros((num_tokens, rows.shape[-1]), jnp.float32)
    for dest in range(num_ranks):
        from_dest = back[starts[dest] + jnp.maximum(pos[:, dest], 0)].astype(jnp.float32)
        total = total + jnp.where((pos[:, dest] >= 0)[:, None], from_dest, 0.0)
    out = total.astype(rows.dtype)
    if row_values is None:
        return out, None
    per_slot = _take(row_values.astype(jnp.float32), held.reshape(-1)).reshape(held.shape)
    back_values = exchange.to_sources(per_slot, *counts, starts)  # [send_rows, K]
    dest = handle.slot_dest
    dest_pos = jnp.take_along_axis(pos, jnp.maximum(dest, 0), axis=1)
    back_rows = starts[jnp.maximum(dest, 0)] + jnp.maximum(dest_pos, 0)
    topk = jnp.arange(config.topk, dtype=jnp.int32)[None, :]
    values = jnp.where(dest >= 0, back_values[back_rows, topk], 0.0)
    return out, values


def combine_backward(
    handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None, *, site: int = 0
) -> tuple[jax.Array, jax.Array | None]:
    """The backward pass of combine: ``dy`` (``y``'s shape and dtype) and ``dweights`` (``weights``' shape and
    dtype, None without weights) from the cotangent ``[T, H]`` of combine's output.

    Each held row gets ``dy = w * g`` and ``dweights = <g, y[row]>`` in float32, ``g`` its token's cotangent;
    rows that hold no slot get exactly 0, even where ``y``, ``weights`` or the ragged tail hold NaN or inf.
    """
    rows_ct = transfer(handle, cotangent).astype(jnp.float32).reshape(y.shape)
    held = (handle.row_slot >= 0).reshape(y.shape[:-1])[..., None]
    if weights is None:
        return jnp.where(held, rows_ct, 0.0).astype(y.dtype), None
    dy = jnp.where(held, rows_ct * weights.astype(jnp.float32)[..., None], 0.0).astype(y.dtype)
    dweights = jnp.sum(jnp.where(held, rows_ct * y.astype(jnp.float32), 0.0), axis=-1)
    return dy, dweights.astype(weights.dtype)


# The split ops. XLA schedules this backend's all-to-alls itself, so a dispatch's start only gathers the finish's
# inputs, the finish runs the whole op, and the backward pass of the finish runs the whole backward pass, whose
# cotangents reach the start's through `link` (x's) and `topk_weights`. Combine's start does nothing; its finish
# and that one's backward pass run the whole ops.


class DispatchStarted(NamedTuple):
    """What :func:`dispatch_start` hands to :func:`dispatch_finish`: its inputs, and ``link``, a ``[T, H]``
    placeholder. The cotangent of this is the backward pass's: ``topk_weights``' the weights' cotangent, ``link``'s
    x's (the backward pass of the finish computes both)."""

    rows: jax.Array | None
    topk_idx: jax.Array | None
    topk_weights: jax.Array | None
    link: jax.Array | None


class CombineStarted(NamedTuple):
    """What :func:`combine_start` hands to :func:`combine_finish`: nothing."""


def dispatch_start(
    config: Config, rows: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, x_type: RowType
) -> DispatchStarted:
    link = jax.lax.full_like(rows, 0, x_type.dtype, (config.num_tokens, x_type.hidden))  # only its cotangent: dx
    return DispatchStarted(rows, topk_idx, topk_weights, link)


def dispatch_finish(config: Config, started: DispatchStarted) -> Dispatched:
    return dispatch(config, started.rows, started.topk_idx, started.topk_weights)


def dispatch_finish_backward(handle: Handle, rows_ct: jax.Array, weights_ct: jax.Array) -> DispatchStarted:
    dx, dweights = combine(handle, rows_ct, None, handle.config.partial_dtype or rows_ct.dtype, weights_ct)
    return DispatchStarted(None, None, dweights, dx)


def dispatch_start_backward(config: Config, started: DispatchStarted, dstarted: DispatchStarted, x_type: RowType):
    del config, started, x_type
    return dstarted.link, dstarted.topk_weights


def combine_start(
    handle: Handle, rows: jax.Array, weights: jax.Array | None, partial_dtype: Any, *, site: int = 0
) -> CombineStarted:
    del handle, rows, weights, partial_dtype, site
    return CombineStarted()


def combine_finish(
    handle: Handle, rows: jax.Array, weights: jax.Array | None, partial_dtype: Any, started: CombineStarted, *, site=0
) -> jax.Array:
    del started, site
    return combine(handle, rows, weights, partial_dtype)[0]


def combine_finish_backward(handle: Handle, cotangent: jax.Array, y: jax.Array, weights: jax.Array | None, *, site=0):
    del site
    return (*combine_backward(handle, cotangent, y, weights), CombineStarted())


def combine_start_backward(
    handle: Handle, y: jax.Array, weights: jax.Array | None, dstarted: CombineStarted, *, site: int = 0
):
    del handle, y, weights, dstarted, site
    return None, None
