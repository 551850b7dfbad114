"""The static configuration of one dispatch, the pytrees it returns, and the arrays they hold (:data:`ROUTED`,
:data:`RECEIVED`): each named, typed and shaped once, for the backends and the dispatch of no slot; and
:class:`Backend`, what the modules ``xla`` and ``cuda`` implement. Rows reach a backend as they travel: a dispatch's
``x`` already packed as FP8 bytes where ``config.wire_dtype`` says so."""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable
from typing import Any, NamedTuple, Protocol

import jax
import jax.numpy as jnp

LAYOUTS = ("ragged", "expert")
DROP_POLICIES = ("balanced", "expert")
XLA_EXCHANGES = ("auto", "dense", "ragged")


@dataclasses.dataclass(frozen=True)
class Config:
    """Everything static about one dispatch: shapes, sizes and choices.

    It is the pytree aux data of :class:`Handle`, so ``combine`` and the
    backward passes see the same configuration as the dispatch that made it.
    """

    axis_name: Hashable
    num_ranks: int  # R: size of the EP axis
    num_experts: int  # E
    num_tokens: int  # T: tokens per rank
    topk: int  # K
    layout: str  # "ragged" or "expert"
    capacity: int  # C
    expert_alignment: int
    backend: str  # resolved: "xla" or "cuda"
    group: int = -1  # backend "cuda": the id of the jax_ep.Group that serves axis_name
    wire_dtype: str | None = None  # "float8_e4m3fn": rows travel packed as FP8 (jax_ep.ep.fp8); None: in x's dtype
    drop_policy: str = "balanced"  # which slots a too-small ragged capacity keeps: "balanced" or "expert"
    partial_dtype: str | None = None  # dispatch's backward pass (a combine): its partial sums' dtype; None: the rows'
    xla_exchange: str = "auto"  # backend "xla": "dense", "ragged", or "auto" (ragged on TPU, dense elsewhere)
    token_shape: tuple[int, ...] | None = None  # the leading dimensions B of dispatch's x; None: (num_tokens,)
    # The call site of the dispatch (jax_ep.ep.call_sites), for backend "cuda"'s tags. Not compared: handles of
    # dispatches at different sites are pytrees of one structure (the two branches of a lax.cond, say).
    site: int = dataclasses.field(default=0, compare=False)

    def shape_key(self) -> tuple:
        """The fields that every rank's call of this dispatch shares: all but this process's group id and the site
        (:func:`jax_ep.ep.call_sites.site`)."""
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("group", "site"))

    @property
    def empty(self) -> bool:
        """No slots at all (T = 0 or K = 0): nothing travels, and no backend runs."""
        return self.num_tokens == 0 or self.topk == 0

    @property
    def batch_shape(self) -> tuple[int, ...]:
        """The leading dimensions of dispatch's ``x`` (and of combine's output): ``B``, ``prod(B) = T``."""
        return (self.num_tokens,) if self.token_shape is None else self.token_shape

    @property
    def local_experts(self) -> int:
        """L = E // R: experts held by each rank."""
        return self.num_experts // self.num_ranks

    @property
    def num_rows(self) -> int:
        """Rows of the flattened receive layout: C (ragged) or L * C (expert)."""
        return self.capacity if self.layout == "ragged" else self.local_experts * self.capacity

    def layout_shape(self, hidden: int) -> tuple[int, ...]:
        """Shape of ``Dispatched.x`` for a hidden size."""
        if self.layout == "ragged":
            return (self.capacity, hidden)
        return (self.local_experts, self.capacity, hidden)

    @property
    def weights_shape(self) -> tuple[int, ...]:
        """Shape of ``Dispatched.weights``."""
        return self.layout_shape(0)[:-1]

    def sizes(self, hidden: int, **more: tuple[int, ...]) -> dict[str, tuple[int, ...]]:
        """The sizes that :class:`Result` shapes name: ``T`` tokens, ``R`` ranks, ``K`` slots, ``L`` local experts,
        ``N`` layout rows, ``layout`` the layout's shape (``[C]`` or ``[L, C]``), ``H`` the row width, and ``more``."""
        sizes = dict(T=self.num_tokens, R=self.num_ranks, K=self.topk, L=self.local_experts, N=self.num_rows, H=hidden)
        return {"1": (1,), "layout": self.weights_shape, **{k: (v,) for k, v in sizes.items()}, **more}


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Handle:
    """The routing of one dispatch, kept for ``combine`` and the backward passes.

    All fields are int32 arrays local to one rank of the EP axis
    (R ranks, T tokens, K slots per token, N rows of the flattened layout):

    * ``token_dest_pos [T, R]``: row of token ``t`` in the send list to rank
      ``d`` (tokens sent to ``d`` in token order), -1 when ``t`` sends nothing
      there.
    * ``send_counts [R]``: tokens sent to each rank.
    * ``slot_dest [T, K]``: rank that slot ``(t, k)`` was sent to, -1 when the
      slot is unused or invalid (a dropped slot keeps its rank).
    * ``recv_rows [R, T, K]``: for the ``i``-th token received from rank ``r``,
      the layout row of its slot ``k``, -1 when that slot was not delivered here.
    * ``recv_counts [R]``: tokens received from each rank.
    * ``row_slot [N]``: for each layout row, the received slot it holds as
      ``(r * T + i) * K + k``; -1 for rows that hold no slot inside the data
      (alignment padding, the expert layout's unused rows), -2 for the ragged
      rows past ``sum(group_sizes)``.
    """

    token_dest_pos: jax.Array
    send_counts: jax.Array
    slot_dest: jax.Array
    recv_rows: jax.Array
    recv_counts: jax.Array
    row_slot: jax.Array
    config: Config = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Dispatched:
    """What :func:`jax_ep.dispatch` returns on each rank.

    Shapes for ``layout="ragged"`` / ``layout="expert"`` (C = capacity,
    L = local experts, H = hidden size):

    * ``x``: ``[C, H]`` / ``[L, C, H]``, dtype of the dispatched ``x``.
      Ragged: rows past ``sum(group_sizes)`` are unspecified (never read by
      ``combine`` or any backward pass); alignment padding inside the segments
      is zero. Expert: rows past ``group_sizes[j]`` of ``x[j]`` are zero.
    * ``weights``: ``[C]`` / ``[L, C]`` float32, the slot's routing weight,
      0 on every row that holds no slot.
    * ``group_sizes``: ``[L]`` int32. Ragged: rows of each expert's segment
      including alignment padding (feed to ``jax.lax.ragged_dot``). Expert:
      rows kept per local expert.
    * ``num_dropped``: int32 scalar, valid slots routed to this rank that did
      not fit in the capacity.
    * ``num_invalid``: int32 scalar, slots of this rank's ``topk_idx`` that are
      neither -1 nor a valid expert id.
    * ``expert_load``: ``[L]`` int32, the valid slots that all ranks routed to
      each local expert, counted before capacity: ``sum(expert_load)`` is the
      slots kept plus ``num_dropped``.
    * ``handle``: :class:`Handle`, for :func:`jax_ep.combine`.
    * ``row_expert``: ragged: ``[C]`` int32, the local expert of each row
      (alignment padding included), -1 past ``sum(group_sizes)``; derived
      from ``group_sizes`` by :func:`jax_ep.dispatch`. Expert: None (row ``i``
      of ``x[j]`` belongs to expert ``j``).

    A backend returns ``row_expert`` None; the public ops fill it in.
    """

    x: jax.Array
    weights: jax.Array
    group_sizes: jax.Array
    num_dropped: jax.Array
    num_invalid: jax.Array
    expert_load: jax.Array
    handle: Handle
    row_expert: jax.Array | None = None


class RowType(NamedTuple):
    """The hidden size and dtype of a dispatch's ``x`` (its rows may travel as packed FP8 bytes)."""

    hidden: int
    dtype: Any


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingDispatch:
    """What :func:`jax_ep.dispatch_start` returns: pass it to :func:`jax_ep.dispatch_finish`.

    It holds what the start produced (``started``, a pytree of the backend's own); on the cuda backend the
    start's call stays open on the GPU until its finish runs.
    """

    started: Any
    config: Config = dataclasses.field(metadata=dict(static=True))
    x_type: RowType = dataclasses.field(metadata=dict(static=True))


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PendingCombine:
    """What :func:`jax_ep.combine_start` returns: pass it to :func:`jax_ep.combine_finish`."""

    y: jax.Array
    handle: Handle
    weights: jax.Array | None
    started: Any  # a pytree of the backend's own
    partial_dtype: Any = dataclasses.field(metadata=dict(static=True))
    site: int = dataclasses.field(default=0, metadata=dict(static=True))  # of combine_start (call_sites)


LIKE_ROWS = None  # a Result in the dtype of the rows the call moves


class Result(NamedTuple):
    """An array an op returns: its name (a :class:`Dispatched` or :class:`Handle` field for a dispatch's), its dtype
    (:data:`LIKE_ROWS`: the rows'), its shape as the names of the sizes it has (:meth:`Config.sizes`), and its
    value in a dispatch of no slot (``T = 0`` or ``K = 0``), or a function of the config that gives it."""

    name: str
    dtype: Any
    shape: tuple[str, ...]
    empty: Any = 0

    def shape_in(self, sizes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
        return tuple(n for size in self.shape for n in sizes[size])


_I32, _F32 = jnp.int32, jnp.float32
# A dispatch's routing of this rank's own slots, then what it receives: every Dispatched and Handle array.
ROUTED = (Result("token_dest_pos", _I32, ("T", "R"), -1), Result("slot_dest", _I32, ("T", "K"), -1))
RECEIVED = (
    Result("x", LIKE_ROWS, ("layout", "H")),
    Result("weights", _F32, ("layout",)),
    Result("group_sizes", _I32, ("L",)),
    Result("num_dropped", _I32, ()),
    Result("num_invalid", _I32, ()),
    Result("expert_load", _I32, ("L",)),
    Result("send_counts", _I32, ("R",)),
    Result("recv_rows", _I32, ("R", "T", "K"), -1),
    Result("recv_counts", _I32, ("R",)),
    Result("row_slot", _I32, ("N",), lambda config: -2 if config.layout == "ragged" else -1),
)


def dispatched(config: Config, arrays: dict[str, jax.Array]) -> Dispatched:
    """The :class:`Dispatched` of a dispatch's arrays by name (:data:`ROUTED` and :data:`RECEIVED`)."""
    handle = Handle(**{f.name: arrays[f.name] for f in dataclasses.fields(Handle) if f.name != "config"}, config=config)
    fields = {f.name: arrays[f.name] for f in dataclasses.fields(Dispatched) if f.name in arrays}
    return Dispatched(**fields, handle=handle)


def empty_dispatch(config: Config, x: jax.Array) -> Dispatched:
    """The dispatch of no slot (``T = 0`` or ``K = 0``), the same on every rank: each array at its ``empty`` value.
    Its arrays vary over the mesh axes as ``x`` does."""
    sizes = config.sizes(x.shape[-1])
    arrays = {}
    for r in ROUTED + RECEIVED:
        value = r.empty(config) if callable(r.empty) else r.empty
        dtype = x.dtype if r.dtype is LIKE_ROWS else r.dtype
        arrays[r.name] = jax.lax.full_like(x, value, dtype, r.shape_in(sizes))
    return dispatched(config, arrays)


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
