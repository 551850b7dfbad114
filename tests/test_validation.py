"""Bad input fails at trace time with ValueError/TypeError naming the argument, the expected and the actual value.

Nothing here compiles: each call is traced with ``jax.eval_shape`` under ``shard_map``.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from tests.conftest import cpu_mesh
from tests.helpers import AXIS, ep_jit

R, T, H, K, E = 2, 4, 3, 2, 4
L = E // R
C_RAGGED = R * T * min(K, L)  # default capacity, expert_alignment=1
C_EXPERT = R * T


def mentions(*parts: str) -> str:
    """A regex that matches a message containing every part, in any order (whole words for identifiers)."""

    def one(part: str) -> str:
        text = re.escape(part)
        if re.fullmatch(r"\w+", part):
            text = rf"(?<!\w){text}(?!\w)"
        return rf"(?=.*{text})"

    return "(?s)" + "".join(one(p) for p in parts)


POSITIVE = r"(?=.*(positive|>= ?1|> ?0))"  # the expected value of a count
FLOATING = r"(?=.*\bfloat)"  # the expected dtype kind ("float", "floating")


def _spec(shape, dtype):
    """A per-rank ``shape`` as the global ShapeDtypeStruct of R ranks (leading axis R times longer)."""
    if not shape:
        return jax.ShapeDtypeStruct((R,), dtype)
    return jax.ShapeDtypeStruct((R * shape[0], *shape[1:]), dtype)


def trace(fn, *per_rank_args, num_ranks=R, axis=AXIS):
    """Trace ``fn`` on each rank of an "ep" axis without compiling; args given as (shape, dtype) per rank."""
    mesh = cpu_mesh((num_ranks,), (axis,))
    args = [_spec(shape, dtype) for shape, dtype in per_rank_args]
    with jax.set_mesh(mesh):
        return jax.eval_shape(jax.shard_map(fn, in_specs=P(axis), out_specs=P(axis)), *args)


GOOD = {"x": ((T, H), jnp.float32), "topk_idx": ((T, K), jnp.int32), "topk_weights": ((T, K), jnp.float32)}


def trace_dispatch(x=None, topk_idx=None, topk_weights=None, **kwargs):
    """Trace ``jax_ep.dispatch`` with the given per-rank (shape, dtype) of each array, others good."""
    kwargs = {"num_experts": E, "axis_name": AXIS, **kwargs}
    arrays = [x or GOOD["x"], topk_idx or GOOD["topk_idx"], topk_weights or GOOD["topk_weights"]]
    return trace(lambda x, i, w: jax_ep.dispatch(x, i, w, **kwargs).x, *arrays)


def test_good_arguments_trace():
    out = trace_dispatch()
    assert out.shape == (R * C_RAGGED, H)


def test_numpy_integers_are_accepted_as_sizes():
    out = trace_dispatch(num_experts=np.int64(E), capacity=np.int32(5), expert_alignment=np.int64(1))
    assert out.shape == (R * 5, H)


# --- x ---------------------------------------------------------------------------------------------------------------


def test_x_scalar():
    with pytest.raises(ValueError, match=mentions("x", "1", "()")):
        trace(lambda i, w: jax_ep.dispatch(jnp.float32(1), i, w, num_experts=E, axis_name=AXIS).x, *_ids_and_weights())


def _ids_and_weights():
    return GOOD["topk_idx"], GOOD["topk_weights"]


@pytest.mark.parametrize("lead", [(), (2, 2), (1, 2, 2)], ids=str)
def test_x_any_leading_dimensions_trace(lead):
    """Version 3: x [*B, H], topk_idx and topk_weights [*B, K]; combine returns [*B, H']."""

    def fn(x, i, w):
        d = jax_ep.dispatch(x, i, w, num_experts=E, axis_name=AXIS)
        return jax_ep.combine(d.x[:, :2], d.handle)

    out = trace(fn, ((*lead, H), jnp.float32), ((*lead, K), jnp.int16), ((*lead, K), jnp.bfloat16))
    per_rank = (*lead, 2)
    assert out.shape == (R * per_rank[0], *per_rank[1:])


def test_x_integer_dtype():
    with pytest.raises(TypeError, match=mentions("x", "int32") + FLOATING):
        trace_dispatch(x=((T, H), jnp.int32))


# --- topk_idx --------------------------------------------------------------------------------------------------------


def test_topk_idx_rank_1():
    with pytest.raises(ValueError, match=mentions("topk_idx", "(4,)", "[*B, K]")):
        trace_dispatch(topk_idx=((T,), jnp.int32), topk_weights=((T,), jnp.float32))


def test_topk_idx_wrong_num_tokens():
    with pytest.raises(ValueError, match=mentions("topk_idx", "(4,)", "(5, 2)")):
        trace_dispatch(topk_idx=((T + 1, K), jnp.int32), topk_weights=((T + 1, K), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bool_])
def test_topk_idx_dtype(dtype):
    with pytest.raises(TypeError, match=mentions("topk_idx", "integer", jnp.dtype(dtype).name)):
        trace_dispatch(topk_idx=((T, K), dtype))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int16, jnp.uint8, jnp.uint32])
def test_topk_idx_any_integer_dtype_traces(dtype):
    assert trace_dispatch(topk_idx=((T, K), dtype)).shape == (R * C_RAGGED, H)


@pytest.mark.parametrize(("num_tokens", "topk"), [(0, K), (T, 0), (0, 0)])
def test_no_tokens_or_no_slots_trace(num_tokens, topk):
    """Version 3: T = 0 and K = 0 are valid (no ZeroDivisionError)."""
    out = trace_dispatch(
        x=((num_tokens, H), jnp.float32),
        topk_idx=((num_tokens, topk), jnp.int32),
        topk_weights=((num_tokens, topk), jnp.float32),
    )
    assert out.shape == (R * num_tokens * min(topk, L) * R, H)


# --- topk_weights ----------------------------------------------------------------------------------------------------


def test_topk_weights_wrong_shape():
    with pytest.raises(ValueError, match=mentions("topk_weights", "(4, 2)", "(4, 3)")):
        trace_dispatch(topk_weights=((T, K + 1), jnp.float32))


def test_topk_weights_rank_1():
    with pytest.raises(ValueError, match=mentions("topk_weights", "(4, 2)", "(4,)")):
        trace_dispatch(topk_weights=((T,), jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.int32, jnp.bool_])
def test_topk_weights_dtype(dtype):
    with pytest.raises(TypeError, match=mentions("topk_weights", jnp.dtype(dtype).name) + FLOATING):
        trace_dispatch(topk_weights=((T, K), dtype))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn])
def test_topk_weights_any_float_dtype_traces(dtype):
    assert trace_dispatch(topk_weights=((T, K), dtype)).shape == (R * C_RAGGED, H)


# --- static arguments ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_experts", [3, 5, 1])
def test_num_experts_not_a_multiple_of_ranks(num_experts):
    with pytest.raises(ValueError, match=mentions("num_experts", str(R), str(num_experts))):
        trace_dispatch(num_experts=num_experts)


@pytest.mark.parametrize(("num_experts", "error"), [(0, ValueError), (-4, ValueError), (4.0, TypeError)])
def test_num_experts_not_a_positive_int(num_experts, error):
    with pytest.raises(error, match=mentions("num_experts", str(num_experts))):
        trace_dispatch(num_experts=num_experts)


def test_unknown_layout():
    with pytest.raises(ValueError, match=mentions("layout", "ragged", "expert", "dense")):
        trace_dispatch(layout="dense")


def test_unknown_backend():
    with pytest.raises(ValueError, match=mentions("backend", "auto", "xla", "cuda", "tpu")):
        trace_dispatch(backend="tpu")


@pytest.mark.parametrize("capacity", [0, -3])
def test_capacity_not_positive(capacity):
    with pytest.raises(ValueError, match=mentions("capacity", str(capacity)) + POSITIVE):
        trace_dispatch(capacity=capacity)


@pytest.mark.parametrize("capacity", [2.5, 8.0, "8", True, np.float32(8)])
def test_capacity_not_an_int(capacity):
    with pytest.raises(TypeError, match=mentions("capacity", "int", str(capacity))):
        trace_dispatch(capacity=capacity)


@pytest.mark.parametrize("alignment", [0, -8])
def test_expert_alignment_not_positive(alignment):
    with pytest.raises(ValueError, match=mentions("expert_alignment", str(alignment)) + POSITIVE):
        trace_dispatch(expert_alignment=alignment)


def test_expert_alignment_not_an_int():
    with pytest.raises(TypeError, match=mentions("expert_alignment", "int", "2.0")):
        trace_dispatch(expert_alignment=2.0)


def test_ragged_segments_past_int32():
    """An alignment (capped at capacity + 1) that would push the ragged layout's segment starts past int32 fails
    before anything runs, naming expert_alignment; one row less traces."""
    capacity = (2**31 - 1 - R * T * K) // L  # L * capacity + R * T * K is the last span that fits
    trace_dispatch(capacity=capacity, expert_alignment=capacity + 1)
    with pytest.raises(ValueError, match=mentions("expert_alignment", "int32", str(capacity + 2))):
        trace_dispatch(capacity=capacity + 1, expert_alignment=capacity + 2)
    trace_dispatch(capacity=capacity + 1, expert_alignment=capacity + 2, layout="expert")


@pytest.mark.parametrize("policy", ["first", "Balanced", None])
def test_unknown_drop_policy(policy):
    with pytest.raises(ValueError, match=mentions("drop_policy", "balanced", "expert", repr(policy))):
        trace_dispatch(drop_policy=policy)


def test_unknown_xla_exchange():
    with pytest.raises(ValueError, match=mentions("xla_exchange", "auto", "dense", "ragged", "'sparse'")):
        trace_dispatch(xla_exchange="sparse")


@pytest.mark.parametrize(("partial_dtype", "shown"), [(jnp.int32, "int32"), ("foo", "foo")])
def test_dispatch_partial_dtype_not_floating(partial_dtype, shown):
    with pytest.raises(TypeError, match=mentions("partial_dtype", shown) + FLOATING):
        trace_dispatch(partial_dtype=partial_dtype)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(drop_policy="expert"),
        dict(partial_dtype=jnp.float32),
        dict(xla_exchange="dense"),
        dict(xla_exchange="ragged"),
        dict(layout="expert", drop_policy="balanced"),
    ],
    ids=str,
)
def test_version_3_keywords_trace(kwargs):
    assert trace_dispatch(**kwargs).shape[-1] == H


# --- axis_name -------------------------------------------------------------------------------------------------------


def test_axis_name_not_bound_inside_shard_map():
    with pytest.raises(ValueError, match=mentions("axis_name", "'model'")):
        trace_dispatch(axis_name="model")


def test_axis_name_outside_shard_map():
    x, idx, w = jnp.ones((T, H)), jnp.zeros((T, K), jnp.int32), jnp.ones((T, K))
    with pytest.raises(ValueError, match=mentions("axis_name", "'ep'", "shard_map")):
        jax.eval_shape(lambda: jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS))


# --- backend="cuda" without GPUs -------------------------------------------------------------------------------------


def test_cuda_backend_on_cpu_is_an_error():
    """No silent fallback: asking for "cuda" on CPU devices fails at trace time and says so."""
    with pytest.raises((ValueError, RuntimeError), match=mentions("cuda")):
        trace_dispatch(backend="cuda")


def test_auto_backend_on_cpu_runs():
    """backend="auto" on CPU runs (the xla backend) and delivers the tokens."""
    rng = np.random.default_rng(0)
    x = (rng.random((R, T, H)) + 0.5).astype(np.float32)
    idx = np.broadcast_to(np.arange(K, dtype=np.int32), (R, T, K)).copy()
    w = np.ones((R, T, K), np.float32)

    def body(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, backend="auto")
        return jax_ep.combine(d.x, d.handle)

    np.testing.assert_allclose(np.asarray(ep_jit(body, R)(x, idx, w)), K * x, rtol=1e-6)


# --- combine ---------------------------------------------------------------------------------------------------------


def trace_combine(layout, y_shape, y_dtype=jnp.float32, weights=None, handle=lambda d: d.handle):
    """Trace a good dispatch, then combine with a per-rank ``y`` of ``y_shape`` and ``weights`` (shape, dtype)."""

    def fn(x, idx, w, *rest):
        d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS, layout=layout)
        y = jnp.ones(y_shape, y_dtype)
        kwargs = {} if weights is None else {"weights": jnp.ones(*weights)}
        return jax_ep.combine(y, handle(d), **kwargs)

    return trace(fn, GOOD["x"], GOOD["topk_idx"], GOOD["topk_weights"])


@pytest.mark.parametrize(
    ("layout", "shape", "want"),
    [
        ("ragged", (C_RAGGED + 1, H), (C_RAGGED,)),
        ("ragged", (C_RAGGED - 1, H), (C_RAGGED,)),
        ("expert", (L + 1, C_EXPERT, H), (L, C_EXPERT)),
        ("expert", (L, C_EXPERT - 1, H), (L, C_EXPERT)),
    ],
)
def test_combine_y_wrong_leading_shape(layout, shape, want):
    """y must be shaped like d.x: the message shows the expected leading dimensions and y's shape."""
    with pytest.raises(ValueError, match=mentions("y", str(shape), str(want)[:-1])):
        trace_combine(layout, shape)


@pytest.mark.parametrize(
    ("layout", "shape", "ndim"),
    [("ragged", (C_RAGGED,), 2), ("ragged", (L, C_RAGGED, H), 2), ("expert", (L * C_EXPERT, H), 3)],
)
def test_combine_y_wrong_rank(layout, shape, ndim):
    with pytest.raises(ValueError, match=mentions("y", str(shape), str(ndim))):
        trace_combine(layout, shape)


def test_combine_y_integer_dtype():
    with pytest.raises(TypeError, match=mentions("y", "int32") + FLOATING):
        trace_combine("ragged", (C_RAGGED, H), jnp.int32)


def test_combine_good_arguments_trace():
    out = trace_combine("expert", (L, C_EXPERT, H), jnp.bfloat16, weights=((L, C_EXPERT), jnp.float32))
    assert out.shape == (R * T, H) and out.dtype == jnp.bfloat16


@pytest.mark.parametrize(
    ("layout", "shape", "want"),
    [
        ("ragged", (C_RAGGED + 1,), (C_RAGGED,)),
        ("ragged", (C_RAGGED, 1), (C_RAGGED,)),
        ("expert", (L * C_EXPERT,), (L, C_EXPERT)),
        ("expert", (L, C_EXPERT + 1), (L, C_EXPERT)),
    ],
)
def test_combine_weights_wrong_shape(layout, shape, want):
    y_shape = (C_RAGGED, H) if layout == "ragged" else (L, C_EXPERT, H)
    with pytest.raises(ValueError, match=mentions("weights", str(shape), str(want))):
        trace_combine(layout, y_shape, weights=(shape, jnp.float32))


def test_combine_weights_integer_dtype():
    with pytest.raises(TypeError, match=mentions("weights", "int32") + FLOATING):
        trace_combine("ragged", (C_RAGGED, H), weights=((C_RAGGED,), jnp.int32))


@pytest.mark.parametrize(
    ("handle", "type_name"),
    [(lambda d: d, "Dispatched"), (lambda d: {"row_slot": d.x}, "dict"), (lambda d: None, "NoneType")],
    ids=["Dispatched", "dict", "None"],
)
def test_combine_handle_not_a_handle(handle, type_name):
    with pytest.raises(TypeError, match=mentions("handle", "Handle", type_name)):
        trace_combine("ragged", (C_RAGGED, H), handle=handle)


@pytest.mark.parametrize(
    ("partial_dtype", "shown"),
    [(jnp.int32, "int32"), ("foo", "foo"), (jnp.bool_, "bool"), (np.uint8, "uint8")],
    ids=["int32", "foo", "bool", "uint8"],
)
def test_combine_partial_dtype_not_floating(partial_dtype, shown):
    """partial_dtype must name a floating dtype: TypeError naming the argument, "float" and what was given."""

    def fn(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)
        return jax_ep.combine(d.x, d.handle, partial_dtype=partial_dtype)

    with pytest.raises(TypeError, match=mentions("partial_dtype", shown) + FLOATING):
        trace(fn, GOOD["x"], GOOD["topk_idx"], GOOD["topk_weights"])


@pytest.mark.parametrize("partial_dtype", [None, jnp.float32, jnp.bfloat16, "float16", np.dtype(np.float32)])
def test_combine_partial_dtype_floating_traces(partial_dtype):
    """None and any floating dtype (type, name or dtype object) are accepted; the output keeps y's dtype."""

    def fn(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)
        return jax_ep.combine(d.x.astype(jnp.float16), d.handle, partial_dtype=partial_dtype)

    out = trace(fn, GOOD["x"], GOOD["topk_idx"], GOOD["topk_weights"])
    assert out.shape == (R * T, H) and out.dtype == jnp.float16


@pytest.mark.parametrize(
    "kwargs,error,match",
    [
        (dict(num_experts=10), ValueError, "multiple of num_ranks=4"),
        (dict(layout="experts"), ValueError, "layout"),
        (dict(expert_alignment=0), ValueError, "expert_alignment"),
        (dict(num_ranks=0), ValueError, "num_ranks"),
        (dict(topk=2.0), TypeError, "topk"),
        (dict(topk=-1), ValueError, "topk"),
        (dict(num_tokens=-2), ValueError, "num_tokens"),
    ],
)
def test_default_capacity_checks_its_arguments(kwargs, error, match):
    sizes = {**dict(num_ranks=4, num_tokens=8, topk=2, num_experts=16), **kwargs}
    with pytest.raises(error, match=match):
        jax_ep.default_capacity(**sizes)
    assert jax_ep.default_capacity(num_ranks=4, num_tokens=8, topk=2, num_experts=16, expert_alignment=4) == 76
    assert jax_ep.default_capacity(num_ranks=4, num_tokens=0, topk=2, num_experts=16, expert_alignment=4) == 12
    assert jax_ep.default_capacity(num_ranks=4, num_tokens=8, topk=0, num_experts=16, layout="expert") == 32


def test_backend_cuda_on_cpu_devices_says_it_needs_gpus():
    """Not "call initialize" (which refuses CPU meshes): the reason is the devices."""

    def body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=4, axis_name="ep", backend="cuda").x

    with pytest.raises(ValueError, match="runs on NVIDIA GPUs, and jax's devices here are cpu devices"):
        ep_jit(body, 2)(np.ones((2, 4, 8), np.float32), np.zeros((2, 4, 2), np.int32), np.ones((2, 4, 2), np.float32))


def test_the_missing_extension_reason_says_what_happened(tmp_path):
    """Imported from a source checkout with no built extension: not "circular import", but where and what to do."""
    from jax_ep.ep.group import why_not_loaded

    error = ImportError("cannot import name '_jax_ep_cuda' from partially initialized module 'jax_ep.ep'")
    package = tmp_path / "jax_ep"
    package.mkdir()
    (tmp_path / "ffi").mkdir()
    (tmp_path / "pyproject.toml").write_text("")
    reason = why_not_loaded(error, package)
    assert f"source tree {package}" in reason and "Run from another directory" in reason
    (package / "ep").mkdir()
    (package / "ep" / "_jax_ep_cuda.cpython-311-x86_64-linux-gnu.so").write_text("")
    reason = why_not_loaded(ImportError("libnccl.so.2: cannot open shared object file"), package)
    assert "libnccl.so.2" in reason and "BUILD.md" in reason and "source tree" not in reason
