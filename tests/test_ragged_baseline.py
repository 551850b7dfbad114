"""The benchmark's ragged_all_to_all baseline computes what jax_ep's dispatch + combine compute (CPU, emulated)."""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import jax_ep
from bench.ragged_baseline import emulated_ragged_all_to_all, ragged_roundtrip
from tests.conftest import cpu_mesh
from tests.helpers import slow


@pytest.mark.parametrize(
    "ranks,tokens,topk,experts", [slow(1, 5, 3, 4), slow(2, 16, 4, 8), slow(4, 8, 2, 16), (8, 6, 2, 8)]
)
def test_baseline_equals_dispatch_then_combine(ranks, tokens, topk, experts):
    rng = np.random.default_rng(ranks)
    x = rng.standard_normal((ranks * tokens, 6)).astype(np.float32)
    idx = np.stack([rng.permutation(experts)[:topk] for _ in range(ranks * tokens)]).astype(np.int32)
    idx[::3] = idx[0]  # skewed: a third of the tokens pick the same experts
    w = rng.random((ranks * tokens, topk)).astype(np.float32)

    def baseline(x, idx, w):
        return ragged_roundtrip(x, idx, w, num_experts=experts, axis_name="ep", exchange=emulated_ragged_all_to_all)

    def jax_ep_roundtrip(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=experts, axis_name="ep", backend="xla")
        return jax_ep.combine(d.x, d.handle, weights=d.weights)

    with jax.set_mesh(cpu_mesh((ranks,), ("ep",))):
        got = [
            jax.jit(jax.shard_map(f, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)
            for f in (baseline, jax_ep_roundtrip)
        ]
    want = w.sum(1, keepdims=True) * x
    for out in got:
        np.testing.assert_allclose(np.asarray(out), want, rtol=1e-5, atol=1e-5)
