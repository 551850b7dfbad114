"""Skip guard for the GPU tests: they run only where jax sees NVIDIA GPUs and the extension loads."""

import jax
import pytest


def gpu_devices() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


def require_cuda(min_gpus: int = 1):
    """A pytest mark that skips unless ``min_gpus`` GPUs and the CUDA extension are here."""
    from jax_ep import _group

    count = len(gpu_devices())
    return pytest.mark.skipif(
        count < min_gpus or not _group.available(),
        reason=f"needs {min_gpus} NVIDIA GPU(s) and the CUDA extension (have {count} GPU(s); "
        f"{_group.unavailable_reason() or 'extension loaded'})",
    )
