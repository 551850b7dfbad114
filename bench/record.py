"""Shared provenance for committed GPU results: command, commit, device and versions."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

# What the library is built from: a result's "sources" hash covers these, under the checkout's root.
SOURCES = ("jax_ep", "ffi", "CMakeLists.txt", "pyproject.toml")


def _nvidia_smi() -> list[str]:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return []
    return [line.strip() for line in out.stdout.splitlines() if line.strip()]


def source_hash(root: Path) -> str | None:
    """A hash of the library's source files under `root` (SOURCES), by path and content, caches and built
    extensions left out; None when it holds none of them. A copy of a tree hashes like a checkout of its commit,
    so a result names the code that ran where git cannot: a GPU machine's copy of a working tree keeps the git
    metadata of the session's start."""
    files = []
    for name in SOURCES:
        path = root / name
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            files += [
                f
                for f in path.rglob("*")
                if f.is_file() and "__pycache__" not in f.parts and f.suffix not in (".pyc", ".so")
            ]
    if not files:
        return None
    digest = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.relative_to(root).as_posix()):
        digest.update(f.relative_to(root).as_posix().encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return digest.hexdigest()[:16]


def checkout_root(start: Path | None = None) -> Path | None:
    """The jax_ep checkout that holds `start` (default: the running script, else the working directory): the
    nearest folder at or above it with both jax_ep/ and ffi/."""
    starts = [start] if start is not None else [Path(sys.argv[0]) if sys.argv and sys.argv[0] else None, Path.cwd()]
    for begin in starts:
        if begin is None:
            continue
        for folder in [begin.resolve(), *begin.resolve().parents]:
            if (folder / "jax_ep").is_dir() and (folder / "ffi").is_dir():
                return folder
    return None


def sources(start: Path | None = None) -> str:
    """source_hash of checkout_root(start), or "unknown"."""
    root = checkout_root(start)
    return (root and source_hash(root)) or "unknown"


def provenance(command: str) -> dict:
    """Who and what produced a result: the exact command, git commit, the hash of the sources that ran
    (`sources`), devices, library versions, and whether backend "cuda" could run (``jax_ep.cuda_available()``)."""
    import jax

    import jax_ep

    return {
        "command": os.environ.get("JAX_EP_COMMAND") or command,
        "commit": os.environ.get("JAX_EP_COMMIT") or _git_commit(),
        "sources": sources(),
        "devices": _nvidia_smi() or [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "cuda_available": jax_ep.cuda_available(),
        "nccl": _nccl_version(),
    }


def _nccl_version() -> int | None:
    """The version code of the ``libnccl.so.2`` this process resolves by soname (the copy jax's CUDA plugin and
    jax_ep's extension load), e.g. 22809 for 2.28.9; else the ``nvidia-nccl`` wheel's; None without either."""
    candidates = ["libnccl.so.2"]
    try:
        import nvidia.nccl

        candidates += [str(Path(folder) / "lib" / "libnccl.so.2") for folder in nvidia.nccl.__path__]
    except ImportError:
        pass
    for name in candidates:
        try:
            library = ctypes.CDLL(name)
        except OSError:
            continue
        version = ctypes.c_int()
        if library.ncclGetVersion(ctypes.byref(version)) == 0:
            return version.value
    return None


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":  # python -m bench.record [ROOT]: the sources hash of a checkout or copy
    print(sources(Path(sys.argv[1]) if len(sys.argv) > 1 else None))
