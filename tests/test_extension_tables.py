"""What the CUDA extension tells Python about its FFI targets and kernels, and how jax_ep/ep/cuda.py's spec of each
target fits the public types (runs on CPU; needs the built extension)."""

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from jax_ep.ep import group as _group
from jax_ep.ep.types import Dispatched, Handle
from tests.conftest import cpu_mesh


@pytest.fixture
def extension():
    if not _group.available():
        pytest.skip(f"the CUDA extension is not built: {_group.unavailable_reason()}")
    return _group.extension()


def test_every_target_of_the_spec_is_registered_twice_captured_and_not(extension):
    """Each target cuda.py specifies has a handler XLA may capture in command buffers, and an _uncaptured twin it
    may not (for groups that talk NCCL), as the handlers' own metadata says; the extension registers no other."""
    from jax_ep.ep import cuda

    compatible = extension.command_buffer_compatible()
    names = {name for target in cuda.TARGETS for name in (target, f"{target}_uncaptured")}
    assert set(extension.registrations()) == set(compatible) == names
    assert all(compatible[name] != name.endswith("_uncaptured") for name in names)


def test_a_dispatch_returns_every_array_of_dispatched_and_handle():
    """The whole dispatch's results are the arrays of Dispatched and Handle (but row_expert, which ops.py derives
    from group_sizes), once each, and its two halves split them: the start's routing, the finish's the rest."""
    from jax_ep.ep import cuda

    fields = {f.name for cls in (Dispatched, Handle) for f in dataclasses.fields(cls)} - {"handle", "config"}
    fields.remove("row_expert")
    whole = [r.name for r in cuda.TARGETS["jax_ep_dispatch"].results]
    start = [r.name for r in cuda.TARGETS["jax_ep_dispatch_start"].results if r.name != "sent"]
    finish = [r.name for r in cuda.TARGETS["jax_ep_dispatch_finish"].results]
    assert len(whole) == len(set(whole)) and fields <= set(whole)
    assert sorted(start + finish) == sorted(whole)
    assert {f.name for f in dataclasses.fields(Handle)} - {"config"} <= set(whole)


def test_limits_are_the_kernels_and_bound_backend_cuda(monkeypatch, extension):
    """limits() are the constants the kernels are built with (ffi/kernels/launch.h: a token's rows and the
    receivers' row tables live in shared memory), and backend "cuda" takes a dispatch at both limits and refuses
    one past them before any kernel, naming the limit."""
    from jax_ep.ep import cuda

    header = (Path(__file__).resolve().parents[1] / "ffi" / "kernels" / "launch.h").read_text()
    built = {
        key: int(re.search(rf"\bconstexpr\s+\w+\s+{constant}\s*=\s*(\d+)\s*;", header).group(1))
        for key, constant in (("max_topk", "kMaxTopk"), ("max_experts", "kMaxExperts"))
    }
    assert extension.limits() == built and _group.limits() == built

    monkeypatch.setattr(cuda, "on_gpus", lambda: True)
    monkeypatch.setitem(_group._groups, "ep", _group.Group(4242, "test", "ep", 2, 1, {}, [0], 1, {}))

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
    with pytest.raises(ValueError, match=f"topk must be at most {top} for backend 'cuda', got {top + 1}"):
        dispatch(top + 1, experts)
