"""Skip guards for the GPU tests, which also mark them ``gpu``: they run only where jax sees NVIDIA GPUs (and,
for ``require_cuda``, the extension loads)."""

import jax
import pytest


def gpu_devices() -> list:
    try:
        return jax.devices("gpu")
    except RuntimeError:
        return []


class Marks(list):
    """Several pytest marks that work both as a module's ``pytestmark`` (a list) and as one decorator."""

    def __call__(self, obj):
        for mark in self:
            obj = mark(obj)
        return obj


def require_gpu(reason: str = "needs an NVIDIA GPU", *, needed: bool | None = None) -> Marks:
    """Marks ``gpu`` and a skip unless ``needed`` (default: jax sees an NVIDIA GPU)."""
    if needed is None:
        needed = bool(gpu_devices())
    return Marks([pytest.mark.gpu, pytest.mark.skipif(not needed, reason=reason)])


def require_cuda(min_gpus: int = 1) -> Marks:
    """Marks ``gpu`` and a skip unless ``min_gpus`` GPUs and the CUDA extension are here."""
    from jax_ep.ep import group as _group

    count = len(gpu_devices())
    return require_gpu(
        f"needs {min_gpus} NVIDIA GPU(s) and the CUDA extension (have {count} GPU(s); "
        f"{_group.unavailable_reason() or 'extension loaded'})",
        needed=count >= min_gpus and _group.available(),
    )


KERNELS = ("routing.cu", "dispatch.cu", "combine.cu", "combine_backward.cu")


def build_harness(source, out_dir):
    """A test program (tests/cuda/*.cu) linked with the project's kernels (ffi/kernels), for this machine's GPU (for
    an H100 or H200 where there is none): its path. Skips without nvcc."""
    import shutil
    import subprocess
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path

    nvcc = shutil.which("nvcc")
    if nvcc is None:
        pytest.skip("nvcc not found")
    root = Path(__file__).resolve().parents[1]
    arch = "-arch=native" if gpu_devices() else "-arch=sm_90"
    flags = [nvcc, "-std=c++17", "--expt-relaxed-constexpr", f"-I{root / 'ffi'}", arch]

    def compile_one(path):
        target = Path(out_dir) / f"{Path(path).stem}.o"
        done = subprocess.run([*flags, "-c", str(path), "-o", str(target)], capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stderr[-4000:]
        return str(target)

    sources = [Path(source), *(root / "ffi" / "kernels" / k for k in KERNELS)]
    with ThreadPoolExecutor(len(sources)) as pool:
        objects = list(pool.map(compile_one, sources))
    program = Path(out_dir) / Path(source).stem
    done = subprocess.run([*flags, *objects, "-o", str(program)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    return program
