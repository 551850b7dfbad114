"""What the CUDA extension tells Python about its FFI targets and kernels, and how backends/cuda.py's spec of each
target fits the public types (runs on CPU; needs the built extension)."""

import dataclasses

import pytest

from jax_ep.ep import group as _group
from jax_ep.ep.types import Dispatched, Handle


@pytest.fixture
def extension():
    if not _group.available():
        pytest.skip(f"the CUDA extension is not built: {_group.unavailable_reason()}")
    return _group.extension()


def test_every_target_of_the_spec_is_registered_twice_captured_and_not(extension):
    """Each target cuda.py specifies has a handler XLA may capture in command buffers, and an _uncaptured twin it
    may not (for groups that talk NCCL), as the handlers' own metadata says; the extension registers no other."""
    from jax_ep.ep.backends import cuda

    compatible = extension.command_buffer_compatible()
    names = {name for target in cuda.TARGETS for name in (target, f"{target}_uncaptured")}
    assert set(extension.registrations()) == set(compatible) == names
    assert all(compatible[name] != name.endswith("_uncaptured") for name in names)


def test_a_dispatch_returns_every_array_of_dispatched_and_handle():
    """The whole dispatch's results are the arrays of Dispatched and Handle, once each, and its two halves split
    them: the start's routing, the finish's the rest."""
    from jax_ep.ep.backends import cuda

    fields = {f.name for cls in (Dispatched, Handle) for f in dataclasses.fields(cls)} - {"handle", "config"}
    whole = [r.name for r in cuda.TARGETS["jax_ep_dispatch"].results]
    start = [r.name for r in cuda.TARGETS["jax_ep_dispatch_start"].results if r.name != "sent"]
    finish = [r.name for r in cuda.TARGETS["jax_ep_dispatch_finish"].results]
    assert len(whole) == len(set(whole)) and fields <= set(whole)
    assert sorted(start + finish) == sorted(whole)
    assert {f.name for f in dataclasses.fields(Handle)} - {"config"} <= set(whole)


def test_limits_come_from_the_kernels_and_bound_what_backend_cuda_takes(extension):
    limits = _group.limits()
    assert limits == extension.limits() and set(limits) == {"max_topk", "max_experts"}
    assert _group.over_limits(topk=limits["max_topk"], num_experts=limits["max_experts"]) == ""
    too_many = _group.over_limits(topk=limits["max_topk"] + 1, num_experts=8)
    assert f"topk must be at most {limits['max_topk']}" in too_many and f"got {limits['max_topk'] + 1}" in too_many
    assert "num_experts must be at most" in _group.over_limits(topk=1, num_experts=limits["max_experts"] + 1)
