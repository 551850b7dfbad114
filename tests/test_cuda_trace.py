"""The cuda backend's FFI calls trace inside shard_map with the right types (CPU; no kernel runs), and carry what
the kernels rely on: the target (never one XLA captures in command buffers for a group that talks NCCL) and the
call site that each call's tag carries (ranks that reach different jax_ep calls at one position fail when they meet).

There are no GPUs, so no :class:`jax_ep.Group`: the tests take the CPU devices for GPUs and put a stand-in group
for axis "ep" into ``jax_ep.ep.group``'s registry, which is where ``jax_ep/ep/cuda.py:find_group`` looks. They need
the CUDA extension (CI builds it), whose result names and limits the calls are built from.
"""

import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.ep import call_sites
from jax_ep.ep import group as _group
from tests.conftest import cpu_mesh

TARGETS = tuple(
    f"jax_ep_{op}{half}" for op in ("dispatch", "combine", "combine_backward") for half in ("", "_start", "_finish")
)
GROUP_ID = 4242


@pytest.fixture
def extension(monkeypatch):
    """The CUDA extension (its result names and limits shape what is traced), and the CPU devices taken for GPUs,
    so that backend "cuda" traces here."""
    from jax_ep.ep import cuda

    if not _group.available():
        pytest.skip(f"needs the CUDA extension (built wherever nvcc is found): {_group.unavailable_reason()}")
    monkeypatch.setattr(cuda, "on_gpus", lambda: True)
    return _group.extension()


def _stand_in_group(monkeypatch, num_ranks=2, nccl=False):
    """A group as jax_ep.initialize records it (nothing allocated), whose first GPU reaches rank 1 by peer stores,
    or through NCCL."""
    device = jax.devices("cpu")[0]
    group = _group.Group(
        id=GROUP_ID,
        namespace="test",
        axis_name="ep",
        num_ranks=num_ranks,
        num_sms=1,
        sizes={},
        processes=[0],
        setup_timeout_ms=1,
        nccl={device: (1,) if nccl else ()},
        devices=frozenset([device]),
    )
    monkeypatch.setitem(_group._groups, "ep", group)
    return group


ARGS = (
    jax.ShapeDtypeStruct((8, 16), jnp.float32),  # 2 ranks of T=4, H=16
    jax.ShapeDtypeStruct((8, 2), jnp.int32),
    jax.ShapeDtypeStruct((8, 2), jnp.float32),
)


def _targets(text: str) -> Counter:
    """How many FFI calls of each jax_ep target a jaxpr's text holds."""
    return Counter(name for name in re.findall(r"\bjax_ep_\w+", text) if name in TARGETS)


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_forward_and_backward_trace_through_the_ffi_calls(monkeypatch, extension, layout):
    """One jax_ep_dispatch per dispatch, one jax_ep_combine per combine; backward: combine's is one
    jax_ep_combine_backward, dispatch's one jax_ep_combine. Shapes and dtypes come out as the contract says."""
    _stand_in_group(monkeypatch)
    seen = {}

    def moe(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", layout=layout, backend="cuda")
        assert d.handle.config.backend == "cuda" and d.handle.config.group == GROUP_ID
        seen["d"] = d
        return jax_ep.combine(jnp.tanh(d.x).astype(jnp.bfloat16), d.handle, weights=d.weights)

    def loss(x, idx, w):
        out = jax.shard_map(moe, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w)
        return jnp.sum(out.astype(jnp.float32))

    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        forward = _targets(str(jax.make_jaxpr(loss)(*ARGS)))
        grads = jax.eval_shape(jax.grad(loss, argnums=(0, 2)), *ARGS)
        backward = _targets(str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 2)))(*ARGS)))
    assert [(g.shape, g.dtype) for g in grads] == [((8, 16), jnp.float32), ((8, 2), jnp.float32)]
    assert forward == {"jax_ep_dispatch": 1, "jax_ep_combine": 1}
    assert backward == {"jax_ep_dispatch": 1, "jax_ep_combine": 2, "jax_ep_combine_backward": 1}

    d = seen["d"]
    capacity = 2 * 4 * 2 if layout == "ragged" else 2 * 4  # R*T*min(K, L) with L = 4, or R*T
    rows = (capacity,) if layout == "ragged" else (4, capacity)
    assert (d.x.shape, d.x.dtype) == ((*rows, 16), jnp.float32)
    assert (d.weights.shape, d.weights.dtype) == (rows, jnp.float32)
    assert (d.group_sizes.shape, d.group_sizes.dtype) == ((4,), jnp.int32)
    assert (d.expert_load.shape, d.expert_load.dtype) == ((4,), jnp.int32)
    if layout == "ragged":
        assert (d.row_expert.shape, d.row_expert.dtype) == ((capacity,), jnp.int32)
    else:
        assert d.row_expert is None
    assert d.num_dropped.shape == d.num_invalid.shape == ()
    handle = {name: getattr(d.handle, name) for name in ("token_dest_pos", "slot_dest", "recv_rows", "row_slot")}
    assert {name: a.shape for name, a in handle.items()} == {
        "token_dest_pos": (4, 2),
        "slot_dest": (4, 2),
        "recv_rows": (2, 4, 2),
        "row_slot": (capacity if layout == "ragged" else 4 * capacity,),
    }
    assert all(leaf.dtype == jnp.int32 for leaf in jax.tree_util.tree_leaves(d.handle))


@pytest.mark.parametrize("wire_dtype", [None, jnp.float8_e4m3fn])
def test_the_split_ops_and_their_backward_passes_trace(monkeypatch, extension, wire_dtype):
    """Each half is one FFI call, forward and backward (dispatch's backward: a start and a finish of the staged
    combine); every custom VJP's cotangents have its inputs' types, mesh-axis variance included."""
    _stand_in_group(monkeypatch)
    x = jax.ShapeDtypeStruct((8, 128), jnp.bfloat16)

    def moe(x, idx, w):
        kw = dict(num_experts=8, axis_name="ep", backend="cuda", wire_dtype=wire_dtype)
        d = jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, w, **kw))
        return jax_ep.combine_finish(jax_ep.combine_start(jnp.tanh(d.x), d.handle, weights=d.weights))

    def loss(x, idx, w):
        return jnp.sum(jax.shard_map(moe, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w).astype(jnp.float32))

    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        forward = _targets(str(jax.make_jaxpr(loss)(x, *ARGS[1:])))
        grads = jax.eval_shape(jax.grad(loss, argnums=(0, 2)), x, *ARGS[1:])
        both = _targets(str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 2)))(x, *ARGS[1:])))
    assert [(g.shape, g.dtype) for g in grads] == [((8, 128), jnp.bfloat16), ((8, 2), jnp.float32)]
    halves = {f"jax_ep_{op}_{half}": 1 for op in ("dispatch", "combine") for half in ("start", "finish")}
    assert forward == halves
    backward = {"jax_ep_combine_backward_start": 1, "jax_ep_combine_backward_finish": 1}
    assert both == halves | backward | {"jax_ep_combine_start": 2, "jax_ep_combine_finish": 2}


def test_combine_partial_dtype_float32_traces(monkeypatch, extension):
    """partial_dtype=float32 with bf16 y is one jax_ep_combine too; a third dtype is refused by the cuda backend."""
    _stand_in_group(monkeypatch)

    def body(x, idx, w, partial_dtype):
        d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda")
        return jax_ep.combine(d.x.astype(jnp.bfloat16), d.handle, partial_dtype=partial_dtype)

    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        f32 = jax.shard_map(lambda *a: body(*a, jnp.float32), in_specs=P("ep"), out_specs=P("ep"))
        assert _targets(str(jax.make_jaxpr(f32)(*ARGS))) == {"jax_ep_dispatch": 1, "jax_ep_combine": 1}
        f16 = jax.shard_map(lambda *a: body(*a, jnp.float16), in_specs=P("ep"), out_specs=P("ep"))
        with pytest.raises(TypeError, match="partial"):
            jax.make_jaxpr(f16)(*ARGS)


def test_fp8_dispatch_moves_packed_bytes_through_one_call(monkeypatch, extension):
    """wire_dtype=float8_e4m3fn: one jax_ep_dispatch of uint8 rows of ceil16(H + H/32) bytes; d.x comes back
    in x's dtype and shape."""
    _stand_in_group(monkeypatch)
    seen = {}

    def body(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda", wire_dtype=jnp.float8_e4m3fn)
        seen["x"] = d.x
        return d.x

    args = (jax.ShapeDtypeStruct((8, 256), jnp.bfloat16), *ARGS[1:])
    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        text = str(jax.make_jaxpr(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))(*args))
    assert _targets(text) == {"jax_ep_dispatch": 1}
    assert re.search(r"u8\[4,272\].*jax_ep_dispatch|jax_ep_dispatch.*u8\[16,272\]", text.replace("\n", " "))
    assert (seen["x"].shape, seen["x"].dtype) == ((16, 256), jnp.bfloat16)


def _trace_cuda_dispatch(topk=2):
    def body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=4, axis_name="ep", backend="cuda").x

    jax.eval_shape(
        jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")),
        jax.ShapeDtypeStruct((4, 8), jnp.float32),
        jax.ShapeDtypeStruct((4, topk), jnp.int32),
        jax.ShapeDtypeStruct((4, topk), jnp.float32),
    )


def test_cuda_without_initialize_is_a_clear_error(monkeypatch, extension):
    monkeypatch.setattr(_group, "_groups", {})
    with jax.set_mesh(cpu_mesh((2,), ("ep",))), pytest.raises(ValueError, match=r"jax_ep\.initialize\(mesh, 'ep'"):
        _trace_cuda_dispatch()


def test_cuda_with_a_group_of_another_size_is_a_clear_error(monkeypatch, extension):
    _stand_in_group(monkeypatch, num_ranks=4)
    with jax.set_mesh(cpu_mesh((2,), ("ep",))), pytest.raises(ValueError, match="for 4 ranks.*runs over 2"):
        _trace_cuda_dispatch()


def test_cuda_topk_over_the_kernels_limit_is_a_clear_error(monkeypatch, extension):
    _stand_in_group(monkeypatch)
    max_topk = _group.limits()["max_topk"]
    topk = max_topk + 1
    with (
        jax.set_mesh(cpu_mesh((2,), ("ep",))),
        pytest.raises(ValueError, match=f"topk must be at most {max_topk}.*got {topk}"),
    ):
        _trace_cuda_dispatch(topk)


def _ffi_eqns(jaxpr) -> list:
    """Every ffi_call equation of ``jaxpr`` and its sub-jaxprs, in order."""
    eqns = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "ffi_call":
            eqns.append(eqn)
        for param in eqn.params.values():
            for sub in param if isinstance(param, (tuple, list)) else [param]:
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    eqns.extend(_ffi_eqns(inner))
    return eqns


def _traced_eqns(body, x=ARGS[0]) -> list:
    """The FFI calls of the gradient of sum(body(x, idx, w) ** 2), body inside shard_map over the stand-in group."""

    def loss(x, idx, w):
        out = jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w)
        return jnp.sum(out.astype(jnp.float32) ** 2)

    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        return _ffi_eqns(jax.make_jaxpr(jax.grad(loss, argnums=(0, 2)))(x, *ARGS[1:]).jaxpr)


def _traced(body) -> list[tuple[str, dict]]:
    """(target name, attributes) of each FFI call of :func:`_traced_eqns`."""
    return [(eqn.params["target_name"], dict(eqn.params["attributes"])) for eqn in _traced_eqns(body)]


def _whole(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda")
    return jax_ep.combine(d.x * 2, d.handle, weights=d.weights)


def _split(x, idx, w):
    d = jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, w, num_experts=8, axis_name="ep", backend="cuda"))
    return jax_ep.combine_finish(jax_ep.combine_start(d.x * 2, d.handle, weights=d.weights))


def _separate(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda", transfer="separate")
    return jax_ep.combine(d.x * 2, d.handle, weights=d.weights)


def _handler_refuses(eqn, num_ranks: int) -> str | None:
    """Why ffi/xla/handlers.cc would refuse this call's operand and result sizes (None: it takes them), restated
    from its checks so that CPUs catch a spec in jax_ep/ep/cuda.py that the handlers would refuse on a GPU."""
    target = eqn.params["target_name"].removesuffix("_uncaptured")
    attrs = dict(eqn.params["attributes"])
    ins = [v.aval for v in eqn.invars]
    outs = [v.aval for v in eqn.outvars]
    phase = next((half for half in ("start", "finish") if target.endswith(half)), "whole")

    def nbytes(a):
        return math.prod(a.shape) * a.dtype.itemsize

    if target.startswith("jax_ep_dispatch"):
        x, idx = ins[0], ins[1]
        t, k = idx.shape
        local = attrs["num_experts"] // num_ranks
        n = local * attrs["capacity"] if attrs["expert_layout"] else attrs["capacity"]
        row_bytes = nbytes(x) // t
        received = [n * row_bytes, 4 * n, 4 * local, 4, 4, 4 * local, 4 * num_ranks, 4 * num_ranks * t * k]
        received += [4 * num_ranks, 4 * n]
        routed = [4 * t * num_ranks, 4 * t * k]
        expected = {"whole": received + routed, "start": routed + [4], "finish": received}[phase]
        got = [nbytes(a) for a in outs]
        return None if got == expected else f"{target}: results of {got} bytes, the kernels write {expected}"
    if target.startswith("jax_ep_combine_backward"):
        g, y, weights, row_slot = ins[0], ins[1], ins[2], ins[6]
        if row_slot.size != y.shape[0] or weights.size not in (0, y.shape[0]):
            return f"{target}: row_slot {row_slot.shape} and weights {weights.shape} against y {y.shape}"
        dy_bytes = y.shape[0] * g.shape[1] * g.dtype.itemsize
        expected = [4] if phase == "start" else [dy_bytes, 4 * y.shape[0] if weights.size else 0]
        got = [nbytes(a) for a in outs]
        return None if got == expected else f"{target}: results of {got} bytes, the kernels write {expected}"
    y, weights, row_values, token_dest_pos, slot_dest = ins[0], ins[1], ins[2], ins[5], ins[6]
    reads_y = not (attrs["stage_own"] and phase == "finish")
    if reads_y and any(a.size not in (0, y.shape[0]) for a in (weights, row_values)):
        return f"{target}: weights {weights.shape} and row_values {row_values.shape} against y {y.shape}"
    if phase == "start":
        return None if [nbytes(a) for a in outs] == [4] else f"{target}: sent of {outs}"
    out, slot_values = outs
    t, k = token_dest_pos.shape[0], slot_dest.shape[1]
    if out.ndim != 2 or out.shape[0] != t or (reads_y and (out.shape[1] != y.shape[1] or out.dtype != y.dtype)):
        return f"{target}: out {out} against y {y} and T={t}"
    valued = row_values.size != 0 if reads_y else slot_values.size != 0
    return None if nbytes(slot_values) == (4 * t * k if valued else 0) else f"{target}: slot_values {slot_values}"


def _fp8(x, idx, w):
    d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda", wire_dtype=jnp.float8_e4m3fn)
    return jax_ep.combine(d.x * 2, d.handle, weights=d.weights, partial_dtype=jnp.float32)


def _split_fp8_expert(x, idx, w):
    kw = dict(num_experts=8, axis_name="ep", backend="cuda", wire_dtype=jnp.float8_e4m3fn, layout="expert")
    d = jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, w, **kw))
    return jax_ep.combine_finish(jax_ep.combine_start(d.x * 2, d.handle, weights=d.weights))


def _other_rows(x, idx, w):  # y of twice x's width in float32, no weights; the rows moved separately, split combine
    d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda", transfer="separate")
    y = jnp.concatenate([d.x, d.x], axis=-1).astype(jnp.float32)
    out = jax_ep.combine_finish(jax_ep.combine_start(y, d.handle))
    return out[:, : x.shape[1]].astype(x.dtype) + jax_ep.combine(y, d.handle)[:, : x.shape[1]].astype(x.dtype)


BODIES = [_whole, _split, _separate, _fp8, _split_fp8_expert, _other_rows]


@pytest.mark.parametrize("body", BODIES, ids=["whole", "split", "separate", "fp8", "split_fp8", "other_rows"])
def test_every_call_the_ops_make_has_the_sizes_the_handlers_check(monkeypatch, extension, body):
    """The operand and result sizes of every FFI call of the ops and their gradients (whole and split, the rows
    moved separately, FP8 rows, both layouts) pass the size checks of the handlers, which refuse a call otherwise:
    a spec that the handlers would refuse fails here, on CPUs."""
    _stand_in_group(monkeypatch)
    eqns = _traced_eqns(body, jax.ShapeDtypeStruct((8, 128), jnp.bfloat16))
    targets = {eqn.params["target_name"] for eqn in eqns}
    assert len(eqns) >= 4 and any(t.startswith("jax_ep_combine_backward") for t in targets), targets
    assert [why for eqn in eqns if (why := _handler_refuses(eqn, num_ranks=2))] == []


def test_the_size_checks_restated_here_refuse_a_wrong_spec(monkeypatch, extension):
    """The restated checks refuse a dispatch whose x is declared a row short, and a combine without row values
    whose slot_values are [T, K]: the test above would fail if cuda.py declared them so."""
    from jax_ep.ep import cuda

    _stand_in_group(monkeypatch)
    spec = cuda.TARGETS["jax_ep_dispatch"]
    short_x = tuple(r._replace(shape=r.shape[:-1]) if r.name == "x" else r for r in spec.results)
    monkeypatch.setitem(cuda.TARGETS, "jax_ep_dispatch", spec._replace(results=short_x))

    def weights(x, idx, w):  # the forward pass alone: combine would refuse d.x of one dimension
        return jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda").weights

    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        traced = jax.make_jaxpr(jax.shard_map(weights, in_specs=P("ep"), out_specs=P("ep")))(*ARGS)
    refusals = [why for eqn in _ffi_eqns(traced.jaxpr) if (why := _handler_refuses(eqn, num_ranks=2))]
    assert len(refusals) == 1 and refusals[0].startswith("jax_ep_dispatch: results of"), refusals

    monkeypatch.setitem(cuda.TARGETS, "jax_ep_dispatch", spec)
    combine = cuda._combine
    monkeypatch.setattr(cuda, "_combine", lambda *args, **kw: combine(*args, **{**kw, "with_values": True}))
    eqns = _traced_eqns(_whole, jax.ShapeDtypeStruct((8, 128), jnp.bfloat16))
    refusals = [why for eqn in eqns if (why := _handler_refuses(eqn, num_ranks=2))]
    assert len(refusals) == 1 and refusals[0].startswith("jax_ep_combine: slot_values"), refusals


@pytest.mark.parametrize("body", [_whole, _split, _separate], ids=["whole", "split", "separate"])
@pytest.mark.parametrize("nccl", [False, True], ids=["peer_stores", "nccl"])
def test_calls_of_a_group_that_talks_nccl_are_never_captured(monkeypatch, extension, body, nccl):
    """Every target the ops and their gradients call is one XLA may capture in command buffers, as its handler's
    metadata says (what XLA asks), unless the group reaches a rank through NCCL: then none is."""
    _stand_in_group(monkeypatch, nccl=nccl)
    calls = _traced(body)
    compatible = extension.command_buffer_compatible()
    assert len(calls) >= 4  # dispatch, combine and their backward passes
    for target, _ in calls:
        assert target.endswith("_uncaptured") == nccl, target
        assert compatible[target] == (not nccl), target


def test_each_op_and_its_backward_pass_carry_their_own_call_sites(monkeypatch, extension):
    """dispatch and combine at their call sites; their backward passes at sites derived from those (dispatch's
    backward pass is a combine kernel: its site differs from the combine's)."""
    _stand_in_group(monkeypatch)
    calls = _traced(_whole)
    by_target = {}
    for target, attrs in calls:
        by_target.setdefault(target.removesuffix("_uncaptured"), []).append(attrs["site"])
    (dispatch_site,) = by_target["jax_ep_dispatch"]
    combine_sites = by_target["jax_ep_combine"]  # combine, then the backward pass of dispatch
    (combine_backward_site,) = by_target["jax_ep_combine_backward"]
    assert len(combine_sites) == 2 and len(set(combine_sites)) == 2
    combine_site, dispatch_backward_site = combine_sites
    assert dispatch_backward_site == call_sites.backward(dispatch_site, "the backward pass")
    assert combine_backward_site == call_sites.backward(combine_site, "the backward pass")
    assert call_sites.describe(dispatch_site).startswith("jax_ep.dispatch at test_cuda_trace.py in _whole")
    assert call_sites.describe(combine_site).startswith("jax_ep.combine at test_cuda_trace.py in _whole")


def test_the_halves_of_a_split_op_carry_one_call_site(monkeypatch, extension):
    """A start and its finish make one call (one tag), in the forward and in the backward pass."""
    _stand_in_group(monkeypatch)
    sites = {}
    for target, attrs in _traced(_split):
        sites.setdefault(target.removesuffix("_uncaptured"), []).append(attrs["site"])
    assert sites["jax_ep_dispatch_start"] == sites["jax_ep_dispatch_finish"]
    assert sites["jax_ep_combine_backward_start"] == sites["jax_ep_combine_backward_finish"]
    # The combine halves: combine_start/finish of the forward pass, then the backward pass of dispatch's halves.
    assert sites["jax_ep_combine_start"] == sites["jax_ep_combine_finish"]
    assert len(set(sites["jax_ep_combine_start"])) == 2


def test_a_dispatch_in_a_cond_branch_has_another_call_site_than_the_next_one(monkeypatch, extension):
    """The scenario the site exists for: an extra dispatch in a lax.cond branch that only some ranks take, before
    the dispatch every rank makes. The two get different sites, so ranks that meet at them fail."""
    _stand_in_group(monkeypatch)

    def body(x, idx, w):
        def extra(x):
            return x + jnp.sum(jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda").weights)

        x = jax.lax.cond(jax.lax.axis_index("ep") == 0, extra, lambda x: x, x)
        d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda")
        return jax_ep.combine(d.x, d.handle, weights=d.weights)

    sites = [attrs["site"] for target, attrs in _traced(body) if target.startswith("jax_ep_dispatch")]
    assert len(sites) == 2 and sites[0] != sites[1]


def _site_in(fn, args=ARGS):
    sites = []

    def body(x, idx, w):
        d = fn(x, idx, w)
        sites.append(d.handle.config.site)
        return d.weights

    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep"))).trace(*args)
    return sites[-1]


def _moe_dispatch(x, idx, w):
    return jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="xla")


def test_a_call_site_does_not_depend_on_where_the_traced_function_was_called_from():
    """Frames outside the traced function (a first call from a warm-up loop in one process and from the training
    loop in another) take no part: the same code traced from two callers has one site; another line another."""

    def caller_a():
        return _site_in(_moe_dispatch)

    def caller_b():
        return _site_in(_moe_dispatch)

    assert caller_a() == caller_b()

    def elsewhere(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="xla")

    assert _site_in(elsewhere) != caller_a()


def test_calls_of_other_shapes_from_one_line_have_other_call_sites(monkeypatch, extension):
    """A function jitted for two sizes, whose executables two processes run in another order, makes calls of one
    line with other layouts: their sites differ (so those ranks fail when they meet, where they would pair regions of
    other layouts), each described with its operands. The same shapes keep one site."""
    _stand_in_group(monkeypatch)
    wide = (jax.ShapeDtypeStruct((8, 32), jnp.float32), *ARGS[1:])
    more_tokens = tuple(jax.ShapeDtypeStruct((16, a.shape[1]), a.dtype) for a in ARGS)
    sites = [_site_in(_moe_dispatch, args) for args in (ARGS, wide, more_tokens, ARGS)]
    assert len(set(sites[:3])) == 3 and sites[3] == sites[0]
    assert call_sites.describe(sites[1]).endswith("(x [4, 32] float32)")

    def combined(dtype, partial_dtype=None):
        def body(x, idx, w):
            d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", backend="cuda")
            return jax_ep.combine(d.x.astype(dtype), d.handle, weights=d.weights, partial_dtype=partial_dtype)

        return [attrs["site"] for target, attrs in _traced(body) if target.startswith("jax_ep_combine")][0]

    f32, bf16, bf16_f32_partials = combined(jnp.float32), combined(jnp.bfloat16), combined(jnp.bfloat16, jnp.float32)
    assert len({f32, bf16, bf16_f32_partials}) == 3 and combined(jnp.float32) == f32
