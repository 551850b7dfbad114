"""What the CUDA extension tells Python about its FFI targets and kernels (runs on CPU; needs the built extension).

The targets' results are named once, in ffi/xla/handlers.h (kTargets); backends/cuda.py builds result types by
those names. Here every op is traced on CPU devices taken for GPUs, and the names cuda.py builds for each target
must be the ones the extension lists.
"""

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.ep import group as _group
from tests.conftest import cpu_mesh

TARGETS = {
    f"jax_ep_{op}{half}" for op in ("dispatch", "combine", "combine_backward") for half in ("", "_start", "_finish")
}


@pytest.fixture
def extension():
    if not _group.available():
        pytest.skip(f"the CUDA extension is not built: {_group.unavailable_reason()}")
    return _group.extension()


def test_results_lists_the_nine_targets(extension):
    results = extension.results()
    assert set(results) == TARGETS == set(extension.registrations())
    assert results["jax_ep_dispatch"] == [
        *("x", "weights", "group_sizes", "num_dropped", "num_invalid", "token_dest_pos", "send_counts"),
        *("slot_dest", "recv_rows", "recv_counts", "row_slot"),
    ]
    assert results["jax_ep_dispatch_start"] == ["token_dest_pos", "slot_dest", "sent"]
    assert all(len(set(names)) == len(names) for names in results.values())


def test_cuda_py_builds_the_results_the_extension_lists(monkeypatch, extension):
    """The whole ops and the split ops, forward and backward, reach all nine targets."""
    from jax_ep.ep.backends import cuda

    built = {}
    call = cuda._call

    def spy(target, results, *args, **kwargs):
        built.setdefault(target, set()).update(results)
        return call(target, results, *args, **kwargs)

    monkeypatch.setattr(cuda, "_call", spy)
    monkeypatch.setattr(cuda, "on_gpus", lambda: True)
    group = _group.Group(4242, "ep", 2, 1, {}, [0], 1, {})
    monkeypatch.setitem(_group._groups, "ep", group)

    def moe(x, idx, w):
        kw = dict(num_experts=8, axis_name="ep", backend="cuda")
        d = jax_ep.dispatch(x, idx, w, **kw)
        whole = jax_ep.combine(jnp.tanh(d.x), d.handle, weights=d.weights)
        d = jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, w, **kw))
        return whole + jax_ep.combine_finish(jax_ep.combine_start(jnp.tanh(d.x), d.handle, weights=d.weights))

    def loss(x, idx, w):
        return jnp.sum(jax.shard_map(moe, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w))

    args = (
        jax.ShapeDtypeStruct((8, 16), jnp.float32),
        jax.ShapeDtypeStruct((8, 2), jnp.int32),
        jax.ShapeDtypeStruct((8, 2), jnp.float32),
    )
    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        jax.eval_shape(jax.grad(loss, argnums=(0, 2)), *args)
    assert built == {target: set(names) for target, names in extension.results().items()}


def test_limits_are_the_kernels_and_bound_backend_cuda(monkeypatch, extension):
    """limits() are the constants the kernels are built with (ffi/kernels/launch.h: a token's rows and the
    receivers' row tables live in shared memory), and backend "cuda" takes a dispatch at both limits and refuses
    one past them before any kernel, naming the limit."""
    from jax_ep.ep.backends import cuda

    header = (Path(__file__).resolve().parents[1] / "ffi" / "kernels" / "launch.h").read_text()
    built = {
        key: int(re.search(rf"\bconstexpr\s+\w+\s+{constant}\s*=\s*(\d+)\s*;", header).group(1))
        for key, constant in (("max_topk", "kMaxTopk"), ("max_experts", "kMaxExperts"))
    }
    assert extension.limits() == built and _group.limits() == built

    monkeypatch.setattr(cuda, "on_gpus", lambda: True)
    monkeypatch.setitem(_group._groups, "ep", _group.Group(4242, "ep", 2, 1, {}, [0], 1, {}))

    def dispatch(topk, num_experts):
        def body(x, idx, w):
            return jax_ep.dispatch(x, idx, w, num_experts=num_experts, axis_name="ep", backend="cuda").x

        args = (
            jax.ShapeDtypeStruct((4, 16), jnp.float32),
            jax.ShapeDtypeStruct((4, topk), jnp.int32),
            jax.ShapeDtypeStruct((4, topk), jnp.float32),
        )
        with jax.set_mesh(cpu_mesh((2,), ("ep",))):
            return jax.eval_shape(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")), *args)

    top, experts = built["max_topk"], built["max_experts"]
    assert dispatch(top, experts).shape[-1] == 16
    refused = f"num_experts must be at most {experts} for backend 'cuda', got {experts + 2}"
    with pytest.raises(ValueError, match=refused):
        dispatch(1, experts + 2)
