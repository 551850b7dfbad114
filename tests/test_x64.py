"""With ``jax_enable_x64=True`` dispatch, combine and their gradients run, warn about nothing, keep their
int32/float32 dtypes and give the same bits as without it.

x64 is a process-wide setting, so the x64 side runs this file as a script in a subprocess
(``JAX_ENABLE_X64=1``); the test compares what it saved with the same computation in the test process.
"""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_ep
from tests.helpers import AXIS, assert_bits_equal, ep_jit, random_inputs, routing, specified, to_numpy

R, T, H, K, E = 4, 6, 4, 3, 8
# (layout, capacity, expert_alignment): no drops, and drops with alignment padding
CASES = [("ragged", None, 1), ("ragged", 9, 3), ("expert", None, 1), ("expert", 3, 1)]


def results() -> dict[str, np.ndarray]:
    """Every output of dispatch, combine (both partial dtypes) and their gradients, for every case, by name."""
    out = {}
    for layout, capacity, alignment in CASES:
        rng = np.random.default_rng([7, len(layout), alignment])
        x, topk_weights = random_inputs(rng, R, T, H, K, jnp.bfloat16)
        idx = routing(rng, "invalid", R, T, K, E)
        g = rng.standard_normal((R, T, H)).astype(np.float32)

        def body(x, idx, topk_weights, g, layout=layout, capacity=capacity, alignment=alignment):
            def forward(x, topk_weights):
                d = jax_ep.dispatch(
                    x,
                    idx,
                    topk_weights,
                    num_experts=E,
                    axis_name=AXIS,
                    layout=layout,
                    capacity=capacity,
                    expert_alignment=alignment,
                )
                y = jnp.tanh(d.x.astype(jnp.float32))
                outs = (
                    jax_ep.combine(y.astype(jnp.bfloat16), d.handle, weights=d.weights),
                    jax_ep.combine(y, d.handle, weights=d.weights, partial_dtype=jnp.float32),
                    jax_ep.combine(d.x, d.handle),
                )
                return outs, d

            outs, d = forward(x, topk_weights)
            loss = lambda x, w: sum(jnp.sum(o.astype(jnp.float32) * g) for o in forward(x, w)[0])  # noqa: E731
            return d, outs, jax.grad(loss, argnums=(0, 1))(x, topk_weights)

        d, outs, grads = to_numpy(ep_jit(body, R)(x, idx, topk_weights, g))
        fields = {name: getattr(d, name) for name in ("weights", "group_sizes", "num_dropped", "num_invalid")}
        fields["x"] = specified(d.x, d.group_sizes)  # the ragged tail is unspecified
        fields.update({f"handle_{i}": leaf for i, leaf in enumerate(jax.tree_util.tree_leaves(d.handle))})
        fields.update({f"combine_{i}": o for i, o in enumerate(outs)})
        fields.update({"dx": grads[0], "dtopk_weights": grads[1]})
        out.update({f"{layout}-{capacity}-{alignment}-{name}": value for name, value in fields.items()})
    return out


def wide_ids() -> dict[str, np.ndarray]:
    """A dispatch whose ids include values outside int32's range: int64 under x64, where they must be invalid and
    not wrap around (2**32 + 1 to 1, -2**32 - 1 to -1); without x64 the same slots hold -2, an invalid int32 id."""
    rng = np.random.default_rng(11)
    x, topk_weights = random_inputs(rng, R, T, H, K)
    idx = routing(rng, "random", R, T, K, E).astype(np.int64)
    idx[:, 0, 0], idx[:, 1, 1], idx[:, 2, 2] = 2**32 + 1, -(2**32) - 1, 2**31
    if not jax.config.jax_enable_x64:
        idx = np.where((idx < -(2**31)) | (idx >= 2**31), -2, idx).astype(np.int32)

    def body(x, idx, w):
        return jax_ep.dispatch(x, idx, w, num_experts=E, axis_name=AXIS)

    d = to_numpy(ep_jit(body, R)(x, idx, topk_weights))
    fields = {name: getattr(d, name) for name in ("weights", "group_sizes", "num_invalid", "expert_load")}
    fields["x"] = specified(d.x, d.group_sizes)
    return {f"wide_ids-{name}": value for name, value in fields.items()}


@pytest.mark.slow  # a subprocess
def test_x64_runs_without_warnings_and_matches_x32(tmp_path):
    assert not jax.config.jax_enable_x64
    saved = tmp_path / "x64.npz"
    env = {**os.environ, "JAX_ENABLE_X64": "1"}
    command = [sys.executable, "-W", "error", "-m", "tests.test_x64", str(saved)]
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    assert "warn" not in (done.stdout + done.stderr).lower(), done.stdout + done.stderr
    x64 = _load(saved)
    want = {**results(), **wide_ids()}
    assert np.all(want["wide_ids-num_invalid"] >= 3)
    assert sorted(x64) == sorted(want)
    for name, value in want.items():
        if name.endswith(("group_sizes", "num_dropped", "num_invalid")) or "handle" in name:
            assert x64[name].dtype == np.int32, name
        assert_bits_equal(x64[name], value, err_msg=name)


def _save(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """``.npz`` of raw bits and dtype names (NumPy files cannot hold bfloat16)."""
    raw = {name: value.view(f"uint{8 * value.itemsize}") for name, value in arrays.items()}
    np.savez(path, **raw, dtypes=np.array([f"{name}={value.dtype.name}" for name, value in arrays.items()]))


def _load(path: Path) -> dict[str, np.ndarray]:
    with np.load(path) as saved:
        dtypes = dict(entry.split("=") for entry in saved["dtypes"])
        return {name: saved[name].view(jnp.dtype(dtype)) for name, dtype in dtypes.items()}


if __name__ == "__main__":  # the x64 side, run by the test above
    assert jax.config.jax_enable_x64, "run with JAX_ENABLE_X64=1"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arrays = {**results(), **wide_ids()}
    _save(Path(sys.argv[1]), arrays)
