"""The benchmarks' yardsticks on GPUs: the seconds of a peer copy and of a fill, timed with CUDA events.

``bench/copy_timing.cu`` (CUDA runtime only) is compiled by nvcc (``CUDACXX``, else ``nvcc`` on ``PATH``) into a
shared library on first use, kept under ``build/bench/`` of the checkout by the hash of its source, and called
through ctypes: the yardsticks are the benchmarks' own, and nothing of them ships in jax_ep's wheel.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SOURCE = Path(__file__).with_name("copy_timing.cu")
CACHE = Path(__file__).resolve().parents[1] / "build" / "bench"
_ERROR_BYTES = 512


def library_path() -> Path:
    """Where the library built from this version of ``copy_timing.cu`` lives (under ``CACHE``)."""
    digest = hashlib.sha256(SOURCE.read_bytes()).hexdigest()[:16]
    return CACHE / f"libcopy_timing_{digest}.so"


def build(path: Path) -> Path:
    """Compiles ``copy_timing.cu`` into the shared library ``path`` (written whole, then renamed into place, so that
    processes building it at once never load half a file)."""
    nvcc = os.environ.get("CUDACXX") or shutil.which("nvcc")
    if not nvcc:
        raise RuntimeError(
            "bench/copy_timing.py: the copy and fill timings compile bench/copy_timing.cu, and no nvcc was found: "
            "put nvcc on PATH or set CUDACXX"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
        built = Path(scratch) / path.name
        command = [nvcc, "-O2", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "-o", str(built), str(SOURCE)]
        done = subprocess.run(command, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"bench/copy_timing.py: {' '.join(command)} failed:\n{done.stderr[-3000:]}")
        os.replace(built, path)
    return path


@functools.cache
def _library() -> ctypes.CDLL:
    path = library_path()
    if not path.is_file():
        build(path)
    library = ctypes.CDLL(str(path))
    out = [ctypes.POINTER(ctypes.c_double), ctypes.c_char_p, ctypes.c_size_t]
    library.jax_ep_bench_peer_copy_seconds.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_size_t, ctypes.c_int, *out]
    library.jax_ep_bench_fill_seconds.argtypes = [ctypes.c_int, ctypes.c_size_t, ctypes.c_int, *out]
    library.jax_ep_bench_peer_copy_seconds.restype = library.jax_ep_bench_fill_seconds.restype = ctypes.c_int
    return library


def _call(name: str, *args: int, iters: int) -> float:
    if iters < 1:
        raise ValueError(f"bench/copy_timing.py: iters must be at least 1, got {iters}")
    seconds = ctypes.c_double()
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    if getattr(_library(), name)(*args, iters, ctypes.byref(seconds), error, _ERROR_BYTES) != 0:
        raise RuntimeError(f"bench/copy_timing.py: {name}: {error.value.decode()}")
    return seconds.value


def peer_copy_seconds(src_ordinal: int, dst_ordinal: int, nbytes: int, iters: int) -> float:
    """Seconds per ``cudaMemcpyPeerAsync`` of ``nbytes`` from one local GPU to another (CUDA events, the mean of
    ``iters`` after 3 warm-up copies; the source holds pseudo-random bytes).

    With ``src_ordinal == dst_ordinal`` it is a device-to-device copy on one GPU: ``nbytes`` read and written.
    """
    return _call("jax_ep_bench_peer_copy_seconds", src_ordinal, dst_ordinal, nbytes, iters=iters)


def fill_seconds(ordinal: int, nbytes: int, iters: int) -> float:
    """Seconds per ``cudaMemsetAsync`` of ``nbytes`` on one GPU (CUDA events, the mean of ``iters``): writes only."""
    return _call("jax_ep_bench_fill_seconds", ordinal, nbytes, iters=iters)
