"""The experts' MLP, ``act(x @ w_gate) * (x @ w_in) @ w_out`` (gated) or ``act(x @ w_in) @ w_out``, over groups of rows.

:func:`grouped_mlp` runs it with :func:`jax_ep.grouped_matmul`, except where the grouped matmul would take its
padded dense path (:mod:`jax_ep.gmm.padded`) for all nine of its ops (the forward pass, ``dx`` and ``dw`` of three
matmuls): there it takes that path once for the whole MLP, under one conditional in each pass. ``x`` and the
output's cotangent go into groups once, the activation runs on the padded rows, and one unpad goes each way (the
backward pass's unpad sums the two parts of ``dx`` as it copies them), where the nine ops would each pad and unpad
their own operands (``x`` four times, the pre-activations out of groups and back in). The conditional picks the
smallest of a few padded sizes that every group fits (:func:`jax_ep.gmm.padded.row_ladder`), so the batched GEMMs
multiply fewer padding rows than the ops' single size. When no size fits, with ``Plan.beyond`` and at most
``BEYOND_GROUPS`` groups larger than the largest size, the MLP stays padded at that size, the rows past it through
the row-tile kernels and the larger groups' ``dw`` through its kernel whole; otherwise each op runs as its plan
says (with ``Plan.beyond`` on the padded path past its rows, else its kernel). It is a ``jax.custom_vjp``
whose residuals are ragged rows (``x`` and the pre-activations): residuals of a ``lax.cond`` are outputs of every
branch, zeros from the untaken ones.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from ..ep._validate import check_array, check_choice
from . import grouped_matmul as _gm
from . import padded as _padded
from .vma import varying_like_inputs

Matmul = Callable[[jax.Array, jax.Array], jax.Array]
# The ops of one matmul that must all take the padded path for grouped_mlp to take it once.
ALL_OPS = ("fwd", "dx", "dw")
# False runs every op on its own everywhere (bench/moe_layer_baselines.py --ablate times both).
FUSED = True
# With Plan.beyond, past every padded size: True keeps the MLP padded once at the largest size, the rows past it
# through the kernels, while at most BEYOND_GROUPS groups are larger; False runs each op on its own there (--ablate).
PAST_ROWS_FUSED = True


def mlp(x: jax.Array, weights: dict[str, jax.Array], matmul: Matmul, activation: Callable) -> jax.Array:
    """``act(x @ w_gate) * (x @ w_in) @ w_out`` (gated, ``weights`` has ``w_gate``) or ``act(x @ w_in) @ w_out``, each
    ``@`` a call of ``matmul``, in the dtype of ``x``."""
    w = {name: value.astype(x.dtype) for name, value in weights.items()}
    if "w_gate" in w:
        hidden = activation(matmul(x, w["w_gate"])) * matmul(x, w["w_in"])
    else:
        hidden = activation(matmul(x, w["w_in"]))
    return matmul(hidden, w["w_out"])


def grouped_mlp(
    x: jax.Array,
    weights: dict[str, jax.Array],
    group_sizes: jax.Array,
    activation: Callable[[jax.Array], jax.Array] = jax.nn.silu,
    *,
    impl: str = "auto",
) -> jax.Array:
    """:func:`mlp` of ``x [M, H]`` with each group's weights, ``weights`` ``w_in``/``w_gate`` ``[G, H, F]`` and
    ``w_out`` ``[G, F, H]``, the groups laid end to end from row 0 as in :func:`jax_ep.grouped_matmul`.

    Results, gradients and ``impl`` as :func:`jax_ep.grouped_matmul`'s (rows past ``sum(group_sizes)`` of the output
    unspecified, of ``dx`` 0). Where that function's plan puts all three ops of both matmul shapes on the padded
    path (at least 256 groups that average at most 1/1.5 of the padded rows), the whole MLP runs padded in one
    ``jax.custom_vjp`` at the smallest padded size every group fits; when none fits, at the largest with the rows
    past it through the kernels while few groups are larger, else each op as its plan says.
    """
    _check(x, weights, group_sizes, impl)
    w = {name: value.astype(x.dtype) for name, value in weights.items()}
    plans = _fused_plans(x, w, impl)
    if plans is None:
        return mlp(x, w, functools.partial(_gm.grouped_matmul, group_sizes=group_sizes, impl=impl), activation)
    ladder = _padded.row_ladder(x.shape[0], group_sizes.shape[0])
    with jax.named_scope("grouped_mlp"):  # the padding rows for the kernels lie past every group
        return _gm.with_rows_padded(lambda rows: fused_mlp(rows, w, group_sizes, activation, plans, ladder), x)


def _check(x: jax.Array, weights: dict[str, jax.Array], group_sizes: jax.Array, impl: str) -> None:
    check_choice("impl", impl, _gm.IMPLS)
    check_array("x", x, ndim=2, kind="floating")
    names = set(weights)
    if names not in ({"w_in", "w_out"}, {"w_gate", "w_in", "w_out"}):
        raise ValueError(f"jax_ep: weights must be w_in, w_out and optionally w_gate, got {sorted(names)}")
    for name, value in weights.items():
        check_array(name, value, ndim=3, kind="floating")
    g, _, f = weights["w_in"].shape
    want = {"w_in": (g, x.shape[1], f), "w_gate": (g, x.shape[1], f), "w_out": (g, f, x.shape[1])}
    shapes = {name: tuple(value.shape) for name, value in weights.items()}
    if any(shapes[name] != want[name] for name in shapes):
        raise ValueError(
            f"jax_ep: with x [M, H] = {tuple(x.shape)} the weights must be w_in/w_gate [G, H, F] and w_out [G, F, H], "
            f"got {shapes}"
        )
    check_array("group_sizes", group_sizes, shape=(g,), dtype=jnp.int32)


def _fused_plans(x: jax.Array, w: dict[str, jax.Array], impl: str) -> tuple[_gm.Plan, _gm.Plan] | None:
    """The plans of ``x @ w_in`` and ``hidden @ w_out`` where the whole MLP takes the padded path, else None."""
    m, (g, h, f) = x.shape[0], w["w_in"].shape
    caller = "jax_ep.gmm.grouped_mlp"
    up = _gm.mosaic_plan((m, h), (g, h, f), x.dtype, w["w_in"].dtype, impl, caller)
    down = _gm.mosaic_plan((m, f), (g, f, h), x.dtype, w["w_out"].dtype, impl, caller)
    plans = (up, down)
    if not FUSED or None in plans or not all(p.padded_ops == ALL_OPS and None not in p[:3] for p in plans):
        return None
    return plans


def _pre_names(w: dict[str, jax.Array]) -> tuple[str, ...]:
    """The weights applied to ``x``: their outputs are the pre-activations."""
    return ("w_gate", "w_in") if "w_gate" in w else ("w_in",)


def _hidden(activation: Callable, *pre: jax.Array) -> jax.Array:
    return activation(pre[0]) * pre[1] if len(pre) == 2 else activation(pre[0])


def _beyond_plans(plans: tuple[_gm.Plan, _gm.Plan]) -> tuple[_gm.Plan, ...]:
    """The plans of the branch where no padded size fits: each op on the padded path past its rows (Plan.beyond), or
    its kernel alone."""
    return tuple(p if p.beyond else p._replace(padded_ops=()) for p in plans)


def _kernel(plan: _gm.Plan, op: str):
    """The kernel of ``op`` that the padded path past its rows runs (``"fwd"``, ``"dx"``: the row-tile kernel from
    explicit starts; ``"dw"``: dw's kernel), its output varying over the mesh axes its inputs vary over."""
    return varying_like_inputs(_gm.dw_kernel(plan) if op == "dw" else _gm.past_rows_kernel(plan, op))


def _on_each_platform(padded, ragged, ladder: tuple[int, ...], past: bool, *args):
    """On CUDA ``padded(*args, rows)`` with the first ``rows`` of ``ladder`` that every group (``args[2]``) fits; where
    none does, with ``past``, ``padded(*args, ladder[-1], past=True)`` (the rows past it through the kernels) while
    at most ``BEYOND_GROUPS`` groups are larger; else ``ragged(*args)`` (each op as its plan says). Elsewhere
    ``ragged`` (XLA's ops)."""

    def on_gpu(*a):
        sizes = a[2]
        index = jnp.searchsorted(jnp.asarray(ladder, jnp.int32), jnp.max(sizes))  # len(ladder) where none fits
        branches = [varying_like_inputs(lambda *b, rows=rows: padded(*b, rows)) for rows in ladder]
        if past:
            top = ladder[-1]
            too_many = (index == len(ladder)) & ~_padded.fits_beyond(sizes, top, _gm.BEYOND_GROUPS)
            index = index + too_many.astype(index.dtype)
            branches.append(varying_like_inputs(lambda *b: padded(*b, top, past=True)))
        return lax.switch(index, [*branches, varying_like_inputs(ragged)], *a)

    return lax.platform_dependent(*args, cuda=on_gpu, default=varying_like_inputs(ragged))


def _past(plans: tuple[_gm.Plan, _gm.Plan]) -> bool:
    """Whether the MLP takes the padded path past every padded size (the rows past it through the kernels)."""
    return PAST_ROWS_FUSED and all(p.beyond for p in plans)


def _forward(x, w, group_sizes, activation, plans, ladder):
    """``(y, pre)``: the output and the ragged pre-activations (``x @ w_gate``, ``x @ w_in`` or ``x @ w_in``)."""
    up, down = _beyond_plans(plans)
    names = _pre_names(w)

    def ragged(x, w, s):
        pre = tuple(_gm.fwd_op(x, w[name], s, up) for name in names)
        return _gm.fwd_op(_hidden(activation, *pre), w["w_out"], s, down), pre

    def padded(x, w, s, rows, past=False):
        m = x.shape[0]
        xp = _padded.pad(x, s, rows)
        with jax.named_scope("grouped_matmul_fwd"):
            pre = tuple(_padded.einsum("gch,ghf->gcf", xp, w[name]) for name in names)
        hidden = _hidden(activation, *pre)
        with jax.named_scope("grouped_matmul_fwd"):
            y = _padded.einsum("gcf,gfh->gch", hidden, w["w_out"])
        into = (None,) * (1 + len(pre))
        if past:  # each group's rows past `rows` through the row-tile kernels, into the rows the unpads leave
            starts = _padded.rows_beyond(s, rows, m)
            with jax.named_scope("grouped_matmul_fwd"):
                pre_past = tuple(_kernel(up, "fwd")(x, w[name], *starts) for name in names)
                y_past = _kernel(down, "fwd")(_hidden(activation, *pre_past), w["w_out"], *starts)
            into = (y_past, *pre_past)
        pre_rows = tuple(_padded.unpad(p, s, m, into=q) for p, q in zip(pre, into[1:], strict=True))
        return _padded.unpad(y, s, m, into=into[0]), pre_rows

    return _on_each_platform(padded, ragged, ladder, _past(plans), x, w, group_sizes)


def _backward(x, w, group_sizes, pre, dy, activation, plans, ladder):
    """``dx`` and the weights' cotangents (a dict like ``w``)."""
    up, down = _beyond_plans(plans)
    names = _pre_names(w)

    def ragged(x, w, s, pre, dy):
        hidden, pullback = jax.vjp(functools.partial(_hidden, activation), *pre)
        grads = {"w_out": _gm.dw_op(hidden, dy, s, down)}
        d_pre = pullback(_gm.dx_op(dy, w["w_out"], s, down).astype(x.dtype))
        grads.update((name, _gm.dw_op(x, d, s, up)) for name, d in zip(names, d_pre, strict=True))
        dx = sum(_gm.dx_op(d, w[name], s, up).astype(x.dtype) for name, d in zip(names, d_pre, strict=True))
        return dx, grads

    def padded(x, w, s, pre, dy, rows, past=False):
        m = x.shape[0]
        dyp = _padded.pad(dy, s, rows)
        hidden, pullback = jax.vjp(functools.partial(_hidden, activation), *(_padded.pad(p, s, rows) for p in pre))
        with jax.named_scope("grouped_matmul_dw"):
            grads = {"w_out": _padded.einsum("gcf,gch->gfh", hidden, dyp)}
        with jax.named_scope("grouped_matmul_dx"):
            d_hidden = _padded.einsum("gch,gfh->gcf", dyp, w["w_out"])
        d_pre = pullback(d_hidden)
        xp = _padded.pad(x, s, rows)
        with jax.named_scope("grouped_matmul_dw"):
            grads.update((name, _padded.einsum("gch,gcf->ghf", xp, d)) for name, d in zip(names, d_pre, strict=True))
        with jax.named_scope("grouped_matmul_dx"):
            dxp = [_padded.einsum("gcf,ghf->gch", d, w[name]) for name, d in zip(names, d_pre, strict=True)]
        # The gate's and the up projection's parts of dx are summed as they are copied out of the groups.
        plus = dxp[1] if len(dxp) == 2 else None
        if not past:
            return _padded.unpad(dxp[0], s, m, plus=plus), grads
        # Each group's rows past `rows` through the row-tile kernels, and the larger groups' dw whole by dw's kernel.
        starts = _padded.rows_beyond(s, rows, m)
        hidden_rows, pullback_rows = jax.vjp(functools.partial(_hidden, activation), *pre)
        with jax.named_scope("grouped_matmul_dx"):
            d_pre_past = pullback_rows(_kernel(down, "dx")(dy, w["w_out"], *starts))
            dx_kernel = _kernel(up, "dx")
            dx_past = [dx_kernel(d, w[name], *starts) for name, d in zip(names, d_pre_past, strict=True)]
        d_pre_rows = [_padded.unpad(d, s, m, into=q) for d, q in zip(d_pre, d_pre_past, strict=True)]
        whole = functools.partial(_padded.larger_groups_whole, group_sizes=s, rows=rows, most=_gm.BEYOND_GROUPS)
        with jax.named_scope("grouped_matmul_dw"):
            grads["w_out"] = whole(grads["w_out"], hidden_rows, dy, kernel=_kernel(down, "dw"))
            for name, d in zip(names, d_pre_rows, strict=True):
                grads[name] = whole(grads[name], x, d, kernel=_kernel(up, "dw"))
        return _padded.unpad(dxp[0], s, m, plus=plus, into=_padded.summed(*dx_past)), grads

    return _on_each_platform(padded, ragged, ladder, _past(plans), x, w, group_sizes, pre, dy)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def fused_mlp(x, w, group_sizes, activation, plans, ladder):
    """:func:`grouped_mlp`'s custom VJP (no checks; ``M`` a multiple of 8, ``w`` in the dtype of ``x``): the padded
    path with the first of the padded sizes ``ladder`` that every group fits, else the kernels of ``plans``."""
    return _forward(x, w, group_sizes, activation, plans, ladder)[0]


def _fused_fwd(x, w, group_sizes, activation, plans, ladder):
    y, pre = _forward(x, w, group_sizes, activation, plans, ladder)
    return y, (x, w, group_sizes, pre)


def _fused_bwd(activation, plans, ladder, residuals, dy):
    x, w, group_sizes, pre = residuals
    dx, grads = _backward(x, w, group_sizes, pre, dy.astype(x.dtype), activation, plans, ladder)
    grads = {name: _gm.summed_to(grads[name].astype(w[name].dtype), w[name]) for name in w}
    return _gm.summed_to(dx, x), grads, None


fused_mlp.defvjp(_fused_fwd, _fused_bwd)
