"""jax_ep.initialize checks its arguments before touching any GPU (runs on CPU)."""

import dataclasses
import math

import jax
import jax.numpy as jnp
import pytest

import jax_ep
from jax_ep.ep import group as _group
from tests.conftest import cpu_mesh

SIZES = dict(num_tokens=16, hidden=8, topk=2, num_experts=8)


@pytest.fixture
def built():
    """Skips where the CUDA extension, which computes buffer_size_hint (ffi/kernels/launch.h), is not built."""
    if not _group.available():
        pytest.skip(f"the CUDA extension is not built: {_group.unavailable_reason()}")


def test_a_cpu_mesh_is_refused():
    with pytest.raises(ValueError, match=r"needs a mesh of GPUs, got devices of \['cpu'\]"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **SIZES)


def test_axis_must_be_in_the_mesh():
    with pytest.raises(ValueError, match=r"axis_name 'tp' is not an axis of the mesh \('ep',\)"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "tp", **SIZES)


@pytest.mark.parametrize("name", sorted(SIZES))
def test_sizes_must_be_positive_ints(name):
    with pytest.raises(ValueError, match=f"{name} must be a positive int, got 0"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **{**SIZES, name: 0})
    with pytest.raises(TypeError, match=f"{name} must be an int, got 2.5"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **{**SIZES, name: 2.5})


def test_timeout_must_be_positive():
    with pytest.raises(ValueError, match="timeout_s must be positive, got 0"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **SIZES, timeout_s=0)


def test_num_sms_must_be_a_positive_int():
    with pytest.raises(ValueError, match="num_sms must be a positive int, got 0"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **SIZES, num_sms=0)
    with pytest.raises(TypeError, match="num_sms must be an int, got 1.5"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **SIZES, num_sms=1.5)


def _documented_staging(num_ranks, num_tokens, hidden, topk, num_experts, itemsize):
    """docs/api.md: ``2 * R * (16 + 16 * ceil((L + 1) / 4) + ceil16(T * K * 12) + T * ceil16(H * itemsize))``."""
    local = max(num_experts // num_ranks, 1)
    ceil16 = lambda n: -(-n // 16) * 16  # noqa: E731
    return (
        2
        * num_ranks
        * (
            16
            + 16 * math.ceil((local + 1) / 4)
            + ceil16(num_tokens * topk * 12)
            + num_tokens * ceil16(hidden * itemsize)
        )
    )


def _fixed_bytes(num_ranks, num_tokens, hidden, topk, num_experts, dtype):
    """What buffer_size_hint counts beyond the staging and the routing scratch: the signals and the peer table."""
    sizes = dict(num_ranks=num_ranks, num_tokens=num_tokens, hidden=hidden, topk=topk, num_experts=num_experts)
    staging = _documented_staging(**sizes, itemsize=jnp.dtype(dtype).itemsize)
    scratch = 4 * _group.extension().routing_scratch_ints(num_ranks, num_tokens, topk, num_experts)
    return jax_ep.buffer_size_hint(**sizes, dtype=dtype) - staging - scratch


@pytest.mark.parametrize(
    ("num_ranks", "num_tokens", "hidden", "topk", "num_experts", "dtype"),
    [
        (2, 16, 8, 2, 8, jnp.bfloat16),
        (2, 16, 1, 8, 8, jnp.float32),  # routing metadata dominates
        (2, 1, 1, 1, 1024, jnp.float32),  # every expert's count
        (8, 4096, 7168, 8, 256, jnp.bfloat16),
        (3, 5, 7, 3, 3, jnp.float16),  # nothing a multiple of 16
        (4, 2, 3, 1, 2, jnp.float32),  # fewer experts than ranks: L counts as 1
    ],
)
def test_buffer_size_hint_is_the_documented_formula(built, num_ranks, num_tokens, hidden, topk, num_experts, dtype):
    """The staging, the routing scratch, and about 10 KB of signals and peer table that no shape changes; with
    nccl=True, the staging's bytes again (the outbox and the inbox)."""
    sizes = dict(num_ranks=num_ranks, num_tokens=num_tokens, hidden=hidden, topk=topk, num_experts=num_experts)
    hint = jax_ep.buffer_size_hint(**sizes, dtype=dtype)
    fixed = _fixed_bytes(**sizes, dtype=dtype)
    assert 0 < fixed < 12_000 and fixed == _fixed_bytes(1, 1, 1, 1, 1, jnp.float32)
    staging = _documented_staging(**sizes, itemsize=jnp.dtype(dtype).itemsize)
    assert jax_ep.buffer_size_hint(**sizes, dtype=dtype, nccl=True) == hint + staging
    assert hint == jax_ep.buffer_size_hint(**sizes, dtype=jnp.dtype(dtype))  # a dtype object or a type alike


def test_buffer_size_hint_default_dtype_is_float32_and_covers_float32_partials(built):
    """The default dtype is float32: room for combine's float32 partial sums of bf16 tokens."""
    sizes = dict(num_ranks=2, num_tokens=16, hidden=8, topk=2, num_experts=8)
    assert jax_ep.buffer_size_hint(**sizes) == jax_ep.buffer_size_hint(**sizes, dtype=jnp.float32)
    assert jax_ep.buffer_size_hint(**sizes) > jax_ep.buffer_size_hint(**sizes, dtype=jnp.bfloat16)


def test_buffer_size_hint_without_the_extension_says_why(monkeypatch):
    monkeypatch.setattr(_group, "_extension", None)
    monkeypatch.setattr(_group, "_import_error", ImportError("no _jax_ep_cuda here"))
    with pytest.raises(RuntimeError, match="backend 'cuda' is not available: .*no _jax_ep_cuda here"):
        jax_ep.buffer_size_hint(num_ranks=2, **SIZES)


def test_transport_must_be_known():
    with pytest.raises(ValueError, match=r"transport must be one of \('auto', 'nccl'\), got 'nvlink'"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **SIZES, transport="nvlink")


def test_no_nccl_ranks_before_initialize():
    """Without a group (finalize releases every one) no GPU reaches any rank through NCCL."""
    jax_ep.finalize()
    assert jax_ep.nccl_ranks() == {}
    assert jax_ep.nccl_ranks("ep") == {}
    assert _group.group_for("ep") is None


def test_a_refused_initialize_creates_no_group():
    """initialize that fails its checks leaves no group behind for the axis."""
    with pytest.raises(ValueError):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **SIZES)
    assert _group.group_for("ep") is None and jax_ep.nccl_ranks() == {}


def test_the_default_sm_budget_leaves_32_sms_to_a_group_of_several_gpus(built):
    """ffi/kernels/launch.h DefaultNumSms: every SM for a group of one GPU, else all but 32, at least half."""
    default = _group._extension.default_num_sms
    assert default(132, 1) == 132 and default(132, 2) == 100 and default(132, 8) == 100
    assert default(40, 2) == 20 and default(41, 4) == 21  # at most half the GPU left


def test_each_mesh_axis_keeps_its_own_count_of_key_value_namespaces():
    """initialize's keys in jax.distributed's store are named by the mesh axis and how often this process
    initialized it, so processes agree on them whatever else each initialized in between (a process-wide
    counter of groups differed between processes that made different groups)."""
    mesh = cpu_mesh((2,), ("ep",))
    first = _group._namespace(mesh, "ep")
    other = _group._namespace(cpu_mesh((2, 2), ("dp", "ep")), "ep")  # another group in between
    second = _group._namespace(mesh, "ep")
    axis, count = first.split("/")
    assert second == f"{axis}/{int(count) + 1}"
    assert other.split("/")[0] != axis


class _Extension:
    """Stands in for the CUDA extension's finalize steps: records which ran, in order."""

    def __init__(self):
        self.calls = []

    def close_peer_mappings(self, group_id):
        self.calls.append(("close_peer_mappings", group_id))

    def release(self, group_id):
        self.calls.append(("release", group_id))


def _group_of(processes):
    return _group.Group(7, "ns/1", "ep", 2, 1, dict(SIZES), processes, 1000, {}, frozenset())


@pytest.mark.parametrize("barrier_fails", [False, True])
def test_finalize_frees_memory_only_once_every_process_unmapped_it(monkeypatch, barrier_fails):
    extension, barriers = _Extension(), []

    def barrier(namespace, name, processes, timeout_ms):
        barriers.append((namespace, name, processes))
        if barrier_fails:
            raise TimeoutError("process 1 never arrived")

    monkeypatch.setattr(_group, "_extension", extension)
    monkeypatch.setattr(_group, "_barrier", barrier)
    group = _group_of([0, 1])
    if barrier_fails:
        with pytest.raises(TimeoutError, match="process 1 never arrived"):
            group.finalize()
        # Stopped and unmapped, but its memory kept: process 1 may still map it.
        assert extension.calls == [("close_peer_mappings", 7), ("close_peer_mappings", 7)]
    else:
        group.finalize()
        assert extension.calls == [("close_peer_mappings", 7), ("release", 7)]
    assert barriers == [("ns/1", "released", [0, 1])]
    assert group.released
    group.finalize()  # a second call does nothing
    assert len(extension.calls) == 2


def test_finalize_goes_on_past_a_failed_computation_to_its_barrier(monkeypatch):
    """A live result of a failed computation on the group's GPUs (a jax_ep call that gave up: just when the error
    says to initialize again) raises on itself, not in finalize: finalize waits for the other results, meets the
    other processes at its barrier (they would wait there in vain) and frees the memory."""
    extension, barriers, waited = _Extension(), [], []
    device = jax.devices("cpu")[0]

    class Result:
        def __init__(self, name, error=None):
            self.name, self.error = name, error

        def devices(self):
            return {device}

        def block_until_ready(self):
            waited.append(self.name)
            if self.error:
                raise self.error

    results = [Result("failed", RuntimeError("jax_ep: rank 1 gave up")), Result("fine")]
    monkeypatch.setattr(_group, "_extension", extension)
    monkeypatch.setattr(_group, "_barrier", lambda namespace, name, *_: barriers.append(name))
    monkeypatch.setattr(jax, "live_arrays", lambda: results)
    group = dataclasses.replace(_group_of([0, 1]), devices=frozenset([device]))
    group.finalize()
    assert waited == ["failed", "fine"] and barriers == ["released"]
    assert extension.calls == [("close_peer_mappings", 7), ("release", 7)]


def test_finalize_of_one_process_frees_at_once_and_clears_jax_caches(monkeypatch):
    extension, traces = _Extension(), []
    monkeypatch.setattr(_group, "_extension", extension)
    monkeypatch.setattr(_group, "_barrier", lambda *args: pytest.fail("one process needs no barrier"))

    @jax.jit
    def f(x):
        traces.append(1)
        return x + 1

    f(jnp.ones(3))
    f(jnp.ones(3))
    assert len(traces) == 1
    _group_of([0]).finalize()
    assert extension.calls == [("release", 7)]
    f(jnp.ones(3))  # traced again: a computation compiled for the group must not replay after finalize
    assert len(traces) == 2
