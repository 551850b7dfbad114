"""A Flax NNX mixture-of-experts layer whose experts are spread over a mesh axis with jax_ep.

Needs flax (``python -m pip install -e ".[nn]"``); ``import jax_ep`` does not import it.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
from collections.abc import Callable, Hashable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from .ep._validate import check_choice, check_float_dtype, check_positive_int
from .ep.fp8 import check_wire_dtype
from .ep.ops import HANDLE, ROWS, combine, dispatch, dispatch_finish, dispatch_start
from .ep.types import LAYOUTS
from .gmm.mlp import grouped_mlp, mlp

ROUTERS = ("softmax", "sigmoid", "softmax_topk")
Router = Callable[[jax.Array], tuple[jax.Array, jax.Array, jax.Array]]
# MoE's remat choices and the jax.checkpoint policy of each (over the names jax_ep.dispatch gives its outputs).
REMATS = {
    None: None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "handle": jax.checkpoint_policies.save_only_these_names(HANDLE),
    "rows": jax.checkpoint_policies.save_only_these_names(HANDLE, ROWS),
}


class MoEOutput(NamedTuple):
    """What :class:`MoE` returns (N tokens, H hidden size).

    * ``out``: ``[..., H]``, shape and dtype of the layer's input.
    * ``aux_loss``: float32 scalar, the load-balancing loss of this call (add
      it to the training loss with a small coefficient, e.g. 0.01).
    * ``num_dropped``: int32 scalar, routing slots of this call that did not
      fit in ``capacity``, summed over all ranks; 0 with ``capacity=None``.
    """

    out: jax.Array
    aux_loss: jax.Array
    num_dropped: jax.Array


class MLP(nnx.Module):
    """The weights of one MLP, or of ``num_experts`` stacked MLPs sharded over the EP axis.

    Parameters (E = ``num_experts``, leading dimension absent when it is None;
    H = ``hidden``, F = ``intermediate``; dtype ``param_dtype``):

    * ``w_in``: ``[E, H, F]``, the up projection.
    * ``w_gate``: ``[E, H, F]``, the gate projection; None unless ``gated``.
    * ``w_out``: ``[E, F, H]``, the down projection.

    Stacked weights are annotated ``(axis_name, None, None)`` so that, created
    under ``mesh``, each rank of the EP axis holds only its local experts.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        gated: bool,
        mesh: jax.sharding.Mesh,
        axis_name: Hashable,
        num_experts: int | None = None,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        lead, spec = ((), ()) if num_experts is None else ((num_experts,), (axis_name,))
        init = nnx.with_partitioning(
            nnx.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=tuple(range(len(lead)))),
            (*spec, None, None),
            mesh=mesh,
        )

        def param(rows: int, cols: int) -> nnx.Param:
            return nnx.Param(init(rngs.params(), (*lead, rows, cols), param_dtype))

        self.w_in = param(hidden, intermediate)
        self.w_gate = param(hidden, intermediate) if gated else None
        self.w_out = param(intermediate, hidden)

    def weights(self) -> dict[str, jax.Array]:
        """The parameter arrays by name (``w_gate`` only when gated)."""
        names = ("w_in", "w_gate", "w_out") if self.w_gate is not None else ("w_in", "w_out")
        return {name: getattr(self, name)[...] for name in names}


class MoE(nnx.Module):
    """Top-k routed mixture of experts, expert-parallel over one mesh axis.

    Tokens are sharded over ``(*data_axes, axis_name)``; each rank of the EP
    axis ``axis_name`` (R ranks) holds ``num_experts // R`` experts. A call
    runs the router, :func:`jax_ep.dispatch`, the experts and
    :func:`jax_ep.combine` inside ``jax.shard_map`` over ``mesh``, so it works
    under ``jax.jit``, ``jax.grad`` and ``nnx`` transforms, and gradients reach
    the router, the experts and the input.

    Router (logits ``x @ router_kernel`` in float32):

    * ``"softmax"``: ``p = softmax(logits)``; the top-k of ``p`` are the
      experts, their probabilities the weights (not renormalized).
    * ``"sigmoid"``: ``s = sigmoid(logits)``; the top-k of ``s`` are the
      experts, the weights are those scores divided by their sum;
      ``p = s / sum(s)`` for the auxiliary loss.
    * ``"softmax_topk"``: the top-k of the logits are the experts, the
      weights a softmax over those ``k`` logits (Mixtral; Qwen3 with
      ``norm_topk_prob``); ``p = softmax(logits)`` for the auxiliary loss.
    * a callable ``logits [T, E] float32 -> (topk_weights [T, K], topk_idx
      [T, K], aux_loss [])`` on each rank's ``T`` tokens: weights of any
      floating dtype, ids of any integer dtype (as :func:`jax_ep.dispatch`
      takes them), ``aux_loss`` a scalar. The layer's ``aux_loss`` is its mean
      over the token shards.

    The auxiliary loss of the named routers is Switch-style,
    ``E * sum_e f_e * P_e``, with ``f_e`` the share of the ``N * K`` routing
    slots that chose expert ``e`` and ``P_e`` the mean of ``p[:, e]`` over the
    ``N`` tokens of the call; it is 1 for perfectly even routing. Only ``P_e``
    carries gradient.

    Experts are :class:`MLP` s. Expert matmuls run in the dtype of the input
    (:func:`jax_ep.grouped_matmul` on the ``"ragged"`` layout: Pallas Mosaic
    GPU kernels on Hopper GPUs, ``jax.lax.ragged_dot`` elsewhere; a batched
    ``einsum`` on the ``"expert"`` layout); the router runs in float32.

    Parameters:

    * ``router_kernel``: ``[H, E]`` float32, replicated.
    * ``experts``: :class:`MLP` with ``[E, H, F]`` / ``[E, F, H]`` weights of
      ``param_dtype``, sharded over ``axis_name``.
    * ``shared``: :class:`MLP` with ``[H, S]`` / ``[S, H]`` weights, applied to
      every token and added to the output; None unless
      ``shared_intermediate`` is given.
    """

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        *,
        num_experts: int,
        topk: int,
        mesh: jax.sharding.Mesh,
        axis_name: Hashable = "ep",
        data_axes: Sequence[Hashable] = (),
        router: str | Router = "softmax",
        gated: bool = True,
        activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
        shared_intermediate: int | None = None,
        layout: str = "ragged",
        capacity: int | None = None,
        capacity_factor: float | None = None,
        expert_alignment: int = 1,
        partial_dtype: Any = None,
        wire_dtype: Any = None,
        overlap: bool = False,
        remat: str | None = None,
        param_dtype: jax.typing.DTypeLike = jnp.float32,
        rngs: nnx.Rngs,
    ) -> None:
        """Create the layer's parameters, sharded over ``mesh``.

        Args:
          hidden: H, the model width.
          intermediate: F, the hidden width of each expert.
          num_experts: E, a multiple of the size of ``axis_name``.
          topk: K, experts per token, in ``[1, E]``.
          mesh: the device mesh, all of its axes ``AxisType.Auto`` or all
            ``AxisType.Explicit`` (``jax.make_mesh``'s default).
          axis_name: the EP mesh axis (R ranks).
          data_axes: other mesh axes the token batch is sharded over (data
            parallelism); experts are replicated over them.
          router: ``"softmax"``, ``"sigmoid"``, ``"softmax_topk"`` or a callable
            router, see the class docstring.
          gated: SwiGLU-style gated experts if True, plain MLPs otherwise.
          activation: the experts' activation function.
          shared_intermediate: S, hidden width of a shared expert applied to
            every token; None for none.
          layout: ``"ragged"`` or ``"expert"``, the :func:`jax_ep.dispatch`
            layout the experts compute on.
          capacity: passed to :func:`jax_ep.dispatch`, per rank; None never
            drops (with ``capacity_factor`` None).
          capacity_factor: ``f > 0``, the capacity from the ``T`` tokens each
            rank routes (``K`` slots each, ``L`` local experts): ragged
            ``C = ceil(f * T * K) + L * (expert_alignment - 1)``, expert
            ``C = ceil(f * T * K / L)``. Not with ``capacity``.
          expert_alignment: passed to :func:`jax_ep.dispatch`.
          partial_dtype: passed to :func:`jax_ep.dispatch` (its backward
            pass) and :func:`jax_ep.combine`: None, or ``jnp.float32`` for
            sums rounded once.
          wire_dtype: passed to :func:`jax_ep.dispatch`: None, or
            ``jnp.float8_e4m3fn`` to send tokens as FP8 (``hidden`` a multiple
            of 128).
          overlap: dispatch with the split ops (:func:`jax_ep.dispatch_start`
            / ``dispatch_finish``) and compute the shared expert between the
            start and the finish (pinned there by
            ``jax.lax.optimization_barrier``), so it runs while the peers'
            tokens travel. Same results as without; no effect without a
            shared expert (the whole ops then save the split's extra launch).
          remat: None, or recompute the dispatch, the experts and combine in
            the backward pass (``jax.checkpoint``; the router's outputs are
            kept), keeping: ``"full"`` nothing more (the recompute routes and
            dispatches again); ``"handle"``
            also the dispatch's handle, weights and group sizes (int32 and
            float32 arrays of about ``R*T*K + 2*C`` elements per rank; the
            recompute moves the rows again along the saved handle but routes
            nothing);
            ``"rows"`` also the dispatched rows (``C * H`` of ``x``'s dtype;
            the recompute runs no dispatch). Gradients are the same bit for
            bit. ``"handle"`` dispatches with ``transfer="separate"`` and
            cannot be combined with ``overlap``.
          param_dtype: dtype of the expert weights.
          rngs: ``nnx.Rngs`` with a ``params`` stream.
        """
        for name, value in (("hidden", hidden), ("intermediate", intermediate), ("num_experts", num_experts)):
            check_positive_int(name, value)
        if not callable(router):
            check_choice("router", router, ROUTERS)
        check_choice("layout", layout, LAYOUTS)
        if len(set(mesh.axis_types)) > 1:
            raise ValueError(
                f"jax_ep.nn.MoE: the mesh's axes must be all Auto or all Explicit (flax shards parameters only on "
                f"such meshes), got axis types {dict(zip(mesh.axis_names, mesh.axis_types, strict=True))}; make the "
                f"mesh with axis_types=(AxisType.Auto,) * {len(mesh.axis_names)} or with AxisType.Explicit"
            )
        if axis_name not in mesh.shape:
            raise ValueError(f"jax_ep.nn.MoE: axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
        if num_experts % mesh.shape[axis_name]:
            raise ValueError(
                f"jax_ep.nn.MoE: num_experts must be a multiple of mesh axis {axis_name!r} of size "
                f"{mesh.shape[axis_name]}, got {num_experts}"
            )
        if not 1 <= topk <= num_experts:
            raise ValueError(f"jax_ep.nn.MoE: topk must be in [1, num_experts={num_experts}], got {topk}")
        check_wire_dtype(wire_dtype, hidden)
        if isinstance(data_axes, (str, bytes)) or not isinstance(data_axes, Sequence):
            raise TypeError(
                f"jax_ep.nn.MoE: data_axes must be a sequence of mesh axis names, e.g. ({data_axes!r},), "
                f"got {data_axes!r}"
            )
        for axis in data_axes:
            if axis not in mesh.shape or axis == axis_name:
                raise ValueError(
                    f"jax_ep.nn.MoE: data_axes must name mesh axes other than axis_name {axis_name!r}; "
                    f"{axis!r} is not one of {tuple(a for a in mesh.shape if a != axis_name)}"
                )
        if len(set(data_axes)) != len(data_axes):
            raise ValueError(f"jax_ep.nn.MoE: data_axes names an axis twice: {tuple(data_axes)}")
        if capacity is not None:
            check_positive_int("capacity", capacity)
        if capacity_factor is not None:
            if capacity is not None:
                raise ValueError(
                    f"jax_ep.nn.MoE: give capacity or capacity_factor, not both; got capacity={capacity} and "
                    f"capacity_factor={capacity_factor}"
                )
            if isinstance(capacity_factor, bool) or not isinstance(capacity_factor, numbers.Real):
                raise TypeError(
                    f"jax_ep.nn.MoE: capacity_factor must be a positive number, got {capacity_factor!r} of type "
                    f"{type(capacity_factor).__name__}"
                )
            if not 0 < capacity_factor < math.inf:
                raise ValueError(f"jax_ep.nn.MoE: capacity_factor must be a positive number, got {capacity_factor}")
        check_positive_int("expert_alignment", expert_alignment)
        if partial_dtype is not None:
            check_float_dtype("partial_dtype", partial_dtype)
        if not isinstance(overlap, bool):
            raise TypeError(f"jax_ep.nn.MoE: overlap must be a bool, got {overlap!r}")
        check_choice("remat", remat, REMATS)
        if remat == "handle" and overlap:
            raise ValueError(
                "jax_ep.nn.MoE: remat='handle' routes and moves the rows in separate exchanges, which the split "
                "ops of overlap=True do not; use remat='rows' or 'full' with overlap, or overlap=False"
            )
        self.hidden = hidden
        self.num_experts = num_experts
        self.topk = topk
        self.mesh = mesh
        self.axis_name = axis_name
        self.token_axes = (*data_axes, axis_name)
        self.router = router
        self.activation = activation
        self.layout = layout
        self.capacity = capacity
        self.capacity_factor = capacity_factor
        self.expert_alignment = expert_alignment
        self.partial_dtype = partial_dtype
        self.wire_dtype = wire_dtype
        self.overlap = overlap
        self.remat = remat
        self.router_kernel = nnx.Param(
            nnx.with_partitioning(nnx.initializers.lecun_normal(), (None, None), mesh=mesh)(
                rngs.params(), (hidden, num_experts), jnp.float32
            )
        )
        mlp = dict(gated=gated, mesh=mesh, axis_name=axis_name, param_dtype=param_dtype, rngs=rngs)
        self.experts = MLP(hidden, intermediate, num_experts=num_experts, **mlp)
        self.shared = None if shared_intermediate is None else MLP(hidden, shared_intermediate, **mlp)

    def __call__(self, x: jax.Array) -> MoEOutput:
        """Apply the layer to ``x [..., H]`` (any floating dtype).

        The ``N`` tokens (the product of the leading dimensions) are split
        over the ``(*data_axes, axis_name)`` mesh axes, so ``N`` must be a
        multiple of their total size. On a mesh with ``Explicit`` axes ``x``
        may have any sharding: the layer reshards its operands to the
        ``shard_map`` specs and gives ``out`` the sharding of ``x``
        (replicated where ``x`` is not on the mesh).

        float64 ``x`` (under ``jax_enable_x64``) warns: the output is float64
        but only float32-accurate, as the router, the routing weights and
        :func:`jax_ep.combine`'s sums are float32.

        Returns:
          :class:`MoEOutput`: ``out [..., H]`` in the dtype of ``x``, the
          float32 ``aux_loss`` and the int32 ``num_dropped``.
        """
        if x.ndim == 0 or x.shape[-1] != self.hidden:
            raise ValueError(
                f"jax_ep.nn.MoE: the last dimension of x must be the layer's hidden size {self.hidden}, "
                f"got input shape {tuple(x.shape)}"
            )
        if x.dtype == jnp.float64:
            warnings.warn(
                "jax_ep.nn.MoE: float64 x gives a float64 output of only float32 accuracy (the router, the "
                "routing weights and combine's sums are float32); float32 x gives the same accuracy for less",
                stacklevel=2,
            )
        with jax.named_scope("jax_ep.MoE"):
            shards = math.prod(self.mesh.shape[name] for name in self.token_axes)
            num_tokens = math.prod(x.shape[:-1])
            if num_tokens % shards:
                raise ValueError(
                    f"jax_ep.nn.MoE: the number of tokens must be a multiple of {shards}, the size of mesh axes "
                    f"{self.token_axes}; got input shape {tuple(x.shape)} ({num_tokens} tokens)"
                )
            params = {"router": self.router_kernel[...], "experts": self.experts.weights()}
            specs = {"router": P(), "experts": P(self.axis_name)}
            if self.shared is not None:
                params["shared"] = self.shared.weights()
                specs["shared"] = P()
            token_spec = P(self.token_axes)
            explicit = AxisType.Explicit in self.mesh.axis_types
            if explicit:
                # shard_map checks that Explicit-typed operands are sharded as its in_specs say.
                x_sharding = self._sharding_of(x)
                tokens = jnp.reshape(
                    jax.sharding.reshard(x, x_sharding),
                    (num_tokens, self.hidden),
                    out_sharding=NamedSharding(self.mesh, token_spec),
                )
                params = jax.sharding.reshard(params, jax.tree.map(lambda s: NamedSharding(self.mesh, s), specs))
            else:
                tokens = x.reshape(num_tokens, self.hidden)
            out, aux_loss, num_dropped = jax.shard_map(
                functools.partial(self._local, num_tokens=num_tokens),
                mesh=self.mesh,
                in_specs=(token_spec, specs),
                out_specs=(token_spec, P(), P()),
            )(tokens, params)
            out = jnp.reshape(out, x.shape, out_sharding=x_sharding if explicit else None)
            return MoEOutput(out, aux_loss, num_dropped)

    def _sharding_of(self, x: jax.Array) -> NamedSharding:
        """``x``'s sharding on the layer's (Explicit) mesh: its type's spec, or replicated where ``x`` is not on it."""
        sharding = jax.typeof(x).sharding
        on_mesh = sharding.mesh.axis_names == self.mesh.axis_names
        return NamedSharding(self.mesh, sharding.spec if on_mesh else P())

    def _local(
        self, x: jax.Array, params: dict[str, Any], *, num_tokens: int
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One rank's ``x [T, H]`` of all ``num_tokens`` -> ``out [T, H]``, ``aux_loss []``, ``num_dropped []``.

        Named scopes (for profiles): ``router``, ``dispatch``, ``experts``, ``combine``, ``shared_expert``,
        ``aux_loss``.
        """
        with jax.named_scope("router"):
            logits = x.astype(jnp.float32) @ params["router"]  # [T, E]
            topk_weights, topk_idx, aux_parts = self._route(logits)

        body = functools.partial(self._experts_and_exchange, params=params)
        if self.remat is not None:
            body = jax.checkpoint(body, policy=REMATS[self.remat])
        out, num_dropped = body(x, topk_idx, topk_weights)

        with jax.named_scope("aux_loss"):
            aux_parts, num_dropped = jax.lax.psum((aux_parts, num_dropped), self.token_axes)
            if callable(self.router):  # the mean of the router's own loss over the token shards
                aux_loss = aux_parts / math.prod(jax.lax.axis_size(a) for a in self.token_axes)
            else:
                slots, prob_sum = aux_parts
                aux_loss = self.num_experts * jnp.sum(slots / (num_tokens * self.topk) * prob_sum / num_tokens)
        return out, aux_loss, num_dropped

    def _route(self, logits: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
        """One rank's ``topk_weights [T, K]``, ``topk_idx [T, K]`` and what its auxiliary loss sums over the
        ranks: the callable router's ``aux_loss``, or the named routers' slots per expert ``[E]`` and sum of
        ``p`` over the tokens ``[E]``."""
        if callable(self.router):
            topk_weights, topk_idx, aux_loss = self.router(logits)
            self._check_routed(logits, topk_weights, topk_idx, aux_loss)
            return topk_weights, topk_idx, jnp.asarray(aux_loss, jnp.float32)
        if self.router == "softmax":
            probs = jax.nn.softmax(logits, axis=-1)
            topk_weights, topk_idx = jax.lax.top_k(probs, self.topk)
        elif self.router == "softmax_topk":
            top_logits, topk_idx = jax.lax.top_k(logits, self.topk)
            topk_weights = jax.nn.softmax(top_logits, axis=-1)
            probs = jax.nn.softmax(logits, axis=-1)
        else:
            scores = jax.nn.sigmoid(logits)
            top_scores, topk_idx = jax.lax.top_k(scores, self.topk)
            topk_weights = top_scores / jnp.sum(top_scores, axis=-1, keepdims=True)
            probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
        slots = jnp.zeros(self.num_experts, jnp.float32).at[topk_idx].add(1.0)
        return topk_weights, topk_idx, (slots, jnp.sum(probs, axis=0))

    def _check_routed(self, logits, topk_weights, topk_idx, aux_loss) -> None:
        """A callable router's outputs have the shapes and dtypes the layer documents."""
        want = (logits.shape[0], self.topk)
        for name, value, kind in (("topk_weights", topk_weights, "floating"), ("topk_idx", topk_idx, "integer")):
            shape, dtype = getattr(value, "shape", None), getattr(value, "dtype", None)
            ok = shape == want and dtype is not None and jnp.issubdtype(dtype, getattr(jnp, kind))
            if not ok:
                raise ValueError(
                    f"jax_ep.nn.MoE: router must return {name} of shape {want} ([T, topk]) with {kind} values, "
                    f"got {type(value).__name__} of shape {shape} and dtype {dtype}"
                )
        if jnp.shape(aux_loss) != ():
            raise ValueError(f"jax_ep.nn.MoE: router must return a scalar aux_loss, got shape {jnp.shape(aux_loss)}")

    def _experts_and_exchange(
        self, x: jax.Array, topk_idx: jax.Array, topk_weights: jax.Array, params: dict[str, Any]
    ) -> tuple[jax.Array, jax.Array]:
        """Dispatch, the experts, combine and the shared expert: ``out [T, H]`` and this rank's ``num_dropped``.
        This is what ``remat`` recomputes."""

        def shared_expert(x):
            with jax.named_scope("shared_expert"):
                return mlp(x, params["shared"], jnp.matmul, self.activation)

        shared = None
        with jax.named_scope("dispatch"):
            kw = dict(
                num_experts=self.num_experts,
                axis_name=self.axis_name,
                layout=self.layout,
                capacity=self._capacity(x.shape[0]),
                expert_alignment=self.expert_alignment,
                partial_dtype=self.partial_dtype,
                wire_dtype=self.wire_dtype,
                transfer="separate" if self.remat == "handle" else "fused",
            )
            if self.overlap and "shared" in params:
                # Optimization barriers pin the shared expert between the start and the finish in XLA's schedule.
                pending = dispatch_start(x, topk_idx, topk_weights, **kw)
                x_shared, pending = jax.lax.optimization_barrier((x, pending))
                shared, pending = jax.lax.optimization_barrier((shared_expert(x_shared), pending))
                d = dispatch_finish(pending)
            else:
                d = dispatch(x, topk_idx, topk_weights, **kw)
        with jax.named_scope("experts"):
            if self.layout == "ragged":
                y = grouped_mlp(d.x, params["experts"], d.group_sizes, self.activation)
            else:
                y = mlp(d.x, params["experts"], functools.partial(jnp.einsum, "lch,lhf->lcf"), self.activation)
        with jax.named_scope("combine"):
            out = combine(y, d.handle, weights=d.weights, partial_dtype=self.partial_dtype)
        if "shared" in params:
            out = out + (shared if shared is not None else shared_expert(x))
        return out, d.num_dropped

    def _capacity(self, num_tokens: int) -> int | None:
        """The dispatch's capacity for ``num_tokens`` tokens per rank: ``capacity``, or ``capacity_factor``'s."""
        if self.capacity_factor is None or num_tokens == 0:
            return self.capacity
        local = self.num_experts // self.mesh.shape[self.axis_name]
        slots = self.capacity_factor * num_tokens * self.topk
        if self.layout == "ragged":
            return math.ceil(slots) + local * (self.expert_alignment - 1)
        return math.ceil(slots / local)
