"""backend="cuda" with one process per GPU (jax.distributed on localhost): peers' buffers by CUDA IPC."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from gpu import require_cuda

pytestmark = require_cuda(min_gpus=2)

WORKER = Path(__file__).with_name("multiprocess_worker.py")


def _run_pair(mode: str, timeout: float) -> list[str]:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    procs = [
        subprocess.Popen(
            [sys.executable, str(WORKER), str(port), str(i), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{mode}: a worker did not finish within {timeout} s")
        outputs.append(out)
        print(out[-4000:])
    return [(proc.returncode, out) for proc, out in zip(procs, outputs, strict=True)]


def test_one_process_per_gpu_matches_xla():
    for code, out in _run_pair("compare", timeout=300):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert out.count("cuda == xla") == 3


def test_a_dead_peer_process_gives_a_clear_error_not_a_hang():
    (code, out), _ = _run_pair("peer_dies", timeout=180)
    assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
    assert "second call failed as expected" in out
