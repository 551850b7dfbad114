"""What a build of jax_ep needs, and what the built wheel needs: a scikit-build-core metadata provider.

pyproject.toml names this module for ``project.dependencies`` (``[tool.scikit-build.metadata.dependencies]``),
so pip asks it, before it builds, what to install into its isolated build environment, and then what the wheel
depends on. Standard library only: it runs before anything is installed.

The CUDA extension is built where ``JAX_EP_CUDA`` is ``ON``, or ``auto`` (the default) and nvcc is found:
``CUDACXX``, else ``nvcc`` on ``PATH``, as CMakeLists.txt looks for it. Such a build needs jax (the XLA FFI
headers) and the NCCL wheel of nvcc's CUDA major version (``nvidia-nccl-cu13``, or ``-cu12`` for CUDA 12:
``nccl.h`` and the ``libnccl.so.2`` the extension links) in the build environment, and the wheel depends on
that NCCL wheel, since the extension (in ``jax_ep/ep``) loads its ``libnccl.so.2`` (rpath
``$ORIGIN/../../nvidia/nccl/lib``). A build without the extension (``JAX_EP_CUDA=OFF``, or no nvcc) needs neither.
``JAX_EP_NCCL_ROOT`` names an NCCL of your own instead of the wheel, in both places.

``python -m jax_ep._cuda_build`` prints what a build here would choose.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from typing import Any

__all__ = ["cuda_build", "dynamic_metadata", "get_requires_for_dynamic_metadata", "nccl_wheel", "nvcc"]

DEFAULT_CUDA_MAJOR = 13  # when nvcc's version cannot be read


def nvcc() -> str | None:
    """The CUDA compiler a build uses: ``CUDACXX``, else ``nvcc`` on ``PATH``; None when there is none."""
    return os.environ.get("CUDACXX") or shutil.which("nvcc")


def cuda_build() -> bool:
    """Whether a build here makes the CUDA extension: ``JAX_EP_CUDA`` is ``ON``, or ``auto`` and nvcc is found."""
    mode = (os.environ.get("JAX_EP_CUDA") or "auto").strip().upper()
    if mode == "OFF":
        return False
    return mode == "ON" or nvcc() is not None  # any other value fails in CMake, with a message


def cuda_major(compiler: str) -> int:
    """The CUDA major version of ``compiler`` (nvcc prints "release 13.0, ...")."""
    try:
        text = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.SubprocessError):
        return DEFAULT_CUDA_MAJOR
    found = re.search(r"release (\d+)\.", text)
    return int(found.group(1)) if found else DEFAULT_CUDA_MAJOR


def nccl_wheel() -> str | None:
    """The NCCL wheel a build here links and its wheel needs, or None (no CUDA build, or ``JAX_EP_NCCL_ROOT``)."""
    if not cuda_build() or os.environ.get("JAX_EP_NCCL_ROOT") or not sys.platform.startswith("linux"):
        return None
    compiler = nvcc()
    major = cuda_major(compiler) if compiler else DEFAULT_CUDA_MAJOR
    return f"nvidia-nccl-cu{max(major, 12)}"


def get_requires_for_dynamic_metadata(settings: Mapping[str, Any] | None = None) -> list[str]:
    """Build requirements besides ``[build-system].requires``: for a CUDA build, ``cuda-build-requires`` and NCCL."""
    if not cuda_build():
        return []
    wheel = nccl_wheel()
    return [*(settings or {}).get("cuda-build-requires", []), *([wheel] if wheel else [])]


def dynamic_metadata(field: str, settings: Mapping[str, Any] | None = None) -> list[str]:
    """``project.dependencies``: the table's ``base``, and for a CUDA build the NCCL wheel it links."""
    if field != "dependencies":
        raise ValueError(f"jax_ep._cuda_build provides project.dependencies only, not {field}")
    wheel = nccl_wheel()
    return [*(settings or {}).get("base", []), *([wheel] if wheel else [])]


if __name__ == "__main__":
    print(f"nvcc: {nvcc()}; CUDA extension: {'yes' if cuda_build() else 'no'}; NCCL wheel: {nccl_wheel()}")
