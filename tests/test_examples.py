"""The examples run to completion and report success."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def run_example(name: str, *args: str, cwd: Path) -> str:
    """Run ``examples/<name>`` with the repository importable; its stdout."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false",  # this pytest process may already hold most GPU memory
    }
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_moe_layer(tmp_path):
    out = run_example("moe_layer.py", cwd=tmp_path)
    assert out.rstrip().endswith("PASS"), out


def test_train_moe(tmp_path):
    pytest.importorskip("flax")
    out = run_example("train_moe.py", "--steps", "30", cwd=tmp_path)
    initial, final = (float(re.search(rf"{name} loss (\S+)", out).group(1)) for name in ("initial", "final"))
    assert final < initial - 0.5, out
    assert (tmp_path / "moe_loss.png").stat().st_size > 0
