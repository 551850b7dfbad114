"""The CUDA routing-layout kernel equals the xla backend's layout bit for bit (GPU only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gpu import gpu_devices, require_cuda
from jax.sharding import PartitionSpec as P

pytestmark = require_cuda()


def _routing(kind: str, num_tokens: int, topk: int, num_experts: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "uniform":
        return np.stack([rng.permutation(num_experts)[:topk] for _ in range(num_tokens)]).astype(np.int32)
    if kind == "skewed":
        return np.tile(np.arange(topk, dtype=np.int32) % num_experts, (num_tokens, 1))
    # "messy": -1 slots, invalid ids and duplicates
    idx = rng.integers(0, num_experts, (num_tokens, topk)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[rng.random(idx.shape) < 0.05] = num_experts + 3
    idx[rng.random(idx.shape) < 0.05] = -9
    idx[:, -1] = idx[:, 0]
    return idx


CASES = [
    ("uniform", 4096, 8, 256, 2),
    ("uniform", 1000, 6, 64, 8),
    ("skewed", 777, 4, 16, 4),
    ("messy", 513, 8, 32, 2),
    ("messy", 64, 3, 12, 1),
    ("messy", 2048, 8, 256, 8),
]


@pytest.mark.parametrize("kind,num_tokens,topk,num_experts,num_ranks", CASES)
def test_layout_kernel_matches_xla(kind, num_tokens, topk, num_experts, num_ranks):
    from jax_ep import _cuda
    from jax_ep._layout import local_layout

    device = gpu_devices()[0]
    idx = jax.device_put(_routing(kind, num_tokens, topk, num_experts, seed=num_tokens), device)
    cuda = jax.jit(lambda i: _cuda.local_layout(i, num_experts, num_ranks))(idx)
    xla = jax.jit(lambda i: local_layout(i, num_experts, num_ranks))(idx)
    for name, got, want in zip(xla._fields, cuda, xla, strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=name)
    assert int(np.asarray(xla.num_invalid)) == int(((np.asarray(idx) >= num_experts) | (np.asarray(idx) < -1)).sum())


@require_cuda(min_gpus=2)
def test_layout_kernel_inside_shard_map():
    from jax_ep import _cuda
    from jax_ep._layout import local_layout

    devices = gpu_devices()[:2]
    mesh = jax.make_mesh((2,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    idx = _routing("messy", 2 * 300, 4, 16, seed=7)

    def both(i):
        cuda = _cuda.local_layout(i, 16, 2)
        xla = local_layout(i, 16, 2)
        return tuple(jnp.reshape(a, (1, -1)) for a in (*cuda, *xla))

    with jax.set_mesh(mesh):
        outs = jax.jit(jax.shard_map(both, in_specs=P("ep"), out_specs=P("ep")))(idx)
    for got, want in zip(outs[:5], outs[5:], strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
