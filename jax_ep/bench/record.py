"""Shared provenance for committed GPU results: command, commit, device and versions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


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


def provenance(command: str) -> dict:
    """Who and what produced a result: the exact command, git commit, devices and library versions."""
    import jax

    from jax_ep import _group

    info = {
        "command": os.environ.get("JAX_EP_COMMAND") or command,
        "commit": os.environ.get("JAX_EP_COMMIT") or _git_commit(),
        "devices": _nvidia_smi() or [str(d) for d in jax.devices()],
        "jax": jax.__version__,
        "python": sys.version.split()[0],
        "cuda_extension": _group.available(),
    }
    if _group.available():
        info["nccl"] = _group.nccl_version()
        info["cuda_runtime"], info["cuda_driver"] = _group.cuda_versions()
    return info


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
