"""Eight simulated CPU devices, set before jax initializes, and mesh helpers."""

import os

_flag = "--xla_force_host_platform_device_count=8"
if _flag not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_flag}".strip()
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import pytest  # noqa: E402
from jax.sharding import AxisType  # noqa: E402


def cpu_mesh(shape: tuple[int, ...], names: tuple[str, ...]) -> jax.sharding.Mesh:
    """A mesh of simulated CPU devices (also on machines that have GPUs)."""
    count = 1
    for size in shape:
        count *= size
    devices = jax.devices("cpu")[:count]
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(shape), devices=devices)


@pytest.fixture(scope="session", autouse=True)
def _eight_cpu_devices():
    assert len(jax.devices("cpu")) >= 8, "tests need 8 simulated CPU devices; XLA_FLAGS was set too late"
