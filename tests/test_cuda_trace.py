"""The cuda backend's FFI calls trace inside shard_map with the right types (CPU; no kernel runs)."""

import jax
import jax.numpy as jnp
import pytest
from conftest import cpu_mesh
from jax.sharding import PartitionSpec as P

from jax_ep import _cuda

pytestmark = pytest.mark.skipif(not _cuda.available(), reason=_cuda.unavailable_reason())

TARGETS = ("jax_ep_routing_layout", "jax_ep_exchange", "jax_ep_tokens_to_rows", "jax_ep_rows_to_tokens")


@pytest.mark.parametrize("layout", ["ragged", "expert"])
def test_forward_and_backward_trace_through_the_ffi_calls(monkeypatch, layout):
    import jax_ep

    monkeypatch.setattr(_cuda, "_state", {"axis_name": "ep", "num_ranks": 2, "timeout_cycles": 1})

    def moe(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=8, axis_name="ep", layout=layout, backend="cuda")
        return jax_ep.combine(jnp.tanh(d.x).astype(jnp.bfloat16), d.handle, weights=d.weights)

    def loss(x, idx, w):
        out = jax.shard_map(moe, in_specs=P("ep"), out_specs=P("ep"))(x, idx, w)
        return jnp.sum(out.astype(jnp.float32))

    args = (
        jax.ShapeDtypeStruct((8, 16), jnp.float32),
        jax.ShapeDtypeStruct((8, 2), jnp.int32),
        jax.ShapeDtypeStruct((8, 2), jnp.float32),
    )
    with jax.set_mesh(cpu_mesh((2,), ("ep",))):
        grads = jax.eval_shape(jax.grad(loss, argnums=(0, 2)), *args)
        text = str(jax.make_jaxpr(jax.grad(loss, argnums=(0, 2)))(*args))
    assert [g.shape for g in grads] == [(8, 16), (8, 2)]
    counts = {name: text.count(name) for name in TARGETS}
    # dispatch: layout, counts and metadata exchanges, tokens; combine: rows to tokens; and each backward pass
    assert counts == {
        "jax_ep_routing_layout": 1,
        "jax_ep_exchange": 3,
        "jax_ep_tokens_to_rows": 2,
        "jax_ep_rows_to_tokens": 2,
    }


def test_cuda_without_initialize_is_a_clear_error(monkeypatch):
    import jax_ep

    monkeypatch.setattr(_cuda, "_state", {})

    def body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=4, axis_name="ep", backend="cuda").x

    with jax.set_mesh(cpu_mesh((2,), ("ep",))), pytest.raises(ValueError, match="jax_ep.initialize"):
        jax.eval_shape(
            jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")),
            jax.ShapeDtypeStruct((4, 8), jnp.float32),
            jax.ShapeDtypeStruct((4, 2), jnp.int32),
            jax.ShapeDtypeStruct((4, 2), jnp.float32),
        )
