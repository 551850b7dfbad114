"""jax_ep.initialize checks its arguments before touching any GPU (runs on CPU)."""

import jax.numpy as jnp
import pytest
from conftest import cpu_mesh

import jax_ep

SIZES = dict(num_tokens=16, hidden=8, topk=2, num_experts=8)


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


def test_buffer_size_hint_covers_every_transfer():
    hint = jax_ep.buffer_size_hint(num_ranks=2, num_tokens=16, hidden=8, topk=2, num_experts=8, dtype=jnp.bfloat16)
    # float32 combine partial sums dominate: R * T * H * 4 bytes
    assert hint == 2 * 16 * 8 * 4
    wide_topk = jax_ep.buffer_size_hint(num_ranks=2, num_tokens=16, hidden=1, topk=8, num_experts=8)
    assert wide_topk == 2 * 16 * 2 * 8 * 4  # routing metadata: K rows and K weights per token
    many_experts = jax_ep.buffer_size_hint(num_ranks=2, num_tokens=1, hidden=1, topk=1, num_experts=1024)
    assert many_experts == 2 * 1024 * 4  # every rank's per-expert counts


def test_transport_must_be_known():
    with pytest.raises(ValueError, match=r"transport must be one of \('auto', 'nccl'\), got 'nvlink'"):
        jax_ep.initialize(cpu_mesh((2,), ("ep",)), "ep", **SIZES, transport="nvlink")


def test_no_nccl_ranks_before_initialize():
    jax_ep.finalize()
    assert jax_ep.nccl_ranks() == {}
