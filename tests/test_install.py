"""What jax_ep.cuda_available() means, and what a build asks pip for (jax_ep/_cuda_build.py); runs on CPU."""

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from gpu import gpu_devices, require_cuda

import jax_ep
from jax_ep import _cuda_build
from jax_ep.ep import group as _group

ROOT = Path(__file__).resolve().parents[1]
no_gpu = pytest.mark.skipif(bool(gpu_devices()), reason="checks a machine without GPUs")


@no_gpu
def test_cuda_available_needs_a_gpu_even_where_the_extension_loads(monkeypatch):
    monkeypatch.setattr(_group, "_extension", object())  # as if the extension had loaded (it does without a GPU)
    assert _group.available()
    assert not jax_ep.cuda_available()


@no_gpu
def test_the_built_extension_loads_without_a_gpu_but_cannot_run():
    if not _group.available():
        pytest.skip(f"the CUDA extension is not built here: {_group.unavailable_reason()}")
    assert not jax_ep.cuda_available()


@require_cuda()
def test_cuda_available_where_the_extension_loads_and_jax_sees_a_gpu():
    assert jax_ep.cuda_available()


def test_cuda_available_needs_the_extension(monkeypatch):
    monkeypatch.setattr(_group, "_extension", None)
    assert not jax_ep.cuda_available()


def fake_nvcc(folder: Path, release: str) -> Path:
    nvcc = folder / "nvcc"
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IEXEC)
    return nvcc


@pytest.fixture
def build_env(monkeypatch, tmp_path):
    """A build environment with no nvcc, no JAX_EP_* settings; tests add what they need."""
    for name in ("CUDACXX", "JAX_EP_CUDA", "JAX_EP_NCCL_ROOT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    return monkeypatch


SETTINGS = {"base": ["jax>=0.10.2", "numpy"], "cuda-build-requires": ["jax>=0.10.2"]}


def requirements() -> tuple[list[str], list[str]]:
    """(build requirements a build adds, the wheel's dependencies)."""
    return (
        _cuda_build.get_requires_for_dynamic_metadata(SETTINGS),
        _cuda_build.dynamic_metadata("dependencies", SETTINGS),
    )


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the NCCL wheels are for Linux")
def test_a_cuda_build_gets_jax_and_the_nccl_wheel_of_its_nvcc(build_env, tmp_path):
    build_env.setenv("PATH", str(fake_nvcc(tmp_path, "13.0").parent))
    assert requirements() == (["jax>=0.10.2", "nvidia-nccl-cu13"], ["jax>=0.10.2", "numpy", "nvidia-nccl-cu13"])
    (tmp_path / "cuda12").mkdir()
    build_env.setenv("CUDACXX", str(fake_nvcc(tmp_path / "cuda12", "12.8")))  # CUDACXX first
    assert requirements() == (["jax>=0.10.2", "nvidia-nccl-cu12"], ["jax>=0.10.2", "numpy", "nvidia-nccl-cu12"])
    build_env.setenv("JAX_EP_NCCL_ROOT", str(tmp_path))  # an NCCL of one's own: no wheel
    assert requirements() == (["jax>=0.10.2"], ["jax>=0.10.2", "numpy"])


def test_a_build_without_the_extension_needs_neither(build_env, tmp_path):
    assert requirements() == ([], ["jax>=0.10.2", "numpy"])  # auto, and no nvcc
    build_env.setenv("PATH", str(fake_nvcc(tmp_path, "13.0").parent))
    build_env.setenv("JAX_EP_CUDA", "OFF")
    assert requirements() == ([], ["jax>=0.10.2", "numpy"])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the NCCL wheels are for Linux")
def test_jax_ep_cuda_on_without_nvcc_still_asks_for_nccl(build_env):
    build_env.setenv("JAX_EP_CUDA", "on")  # CMake then fails, saying that nvcc is missing
    assert requirements()[0] == ["jax>=0.10.2", "nvidia-nccl-cu13"]


def test_pyproject_names_the_provider_with_these_settings():
    tomllib = pytest.importorskip("tomllib")
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    table = pyproject["tool"]["scikit-build"]["metadata"]["dependencies"]
    assert (table["provider"], table["provider-path"]) == ("_cuda_build", "jax_ep")
    assert {key: table[key] for key in SETTINGS} == SETTINGS
    assert "dependencies" in pyproject["project"]["dynamic"]
    assert not any(r.startswith(("jax", "nvidia-nccl")) for r in pyproject["build-system"]["requires"])


@pytest.mark.slow  # a subprocess (pyproject.toml's markers), though a quick one
def test_the_provider_runs_before_anything_is_installed(tmp_path):
    """It runs in pip's bare build environment: the standard library only, loaded as a top-level module."""
    env = {key: value for key, value in os.environ.items() if key not in ("JAX_EP_CUDA", "CUDACXX")}
    env["PATH"] = str(tmp_path)
    out = subprocess.run(
        [sys.executable, "-S", "-m", "_cuda_build"], cwd=ROOT / "jax_ep", env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "nvcc: None; CUDA extension: no; NCCL wheel: None"


def test_the_version_is_written_once():
    """jax_ep/__init__.py holds the version; pyproject.toml reads it (no static version) and CHANGELOG.md's newest
    versioned entry names it (an "Unreleased" section above it collects what comes next)."""
    import re

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" not in project["project"] and "version" in project["project"]["dynamic"]
    regex = project["tool"]["scikit-build"]["metadata"]["version"]
    assert regex["provider"] == "scikit_build_core.metadata.regex" and regex["input"] == "jax_ep/__init__.py"
    newest = re.search(r"^## (?!Unreleased\b)(\S+)", (ROOT / "CHANGELOG.md").read_text(), re.MULTILINE).group(1)
    assert newest == jax_ep.__version__
