"""backend="cuda" with one process per rank (jax.distributed on localhost): peers' buffers by CUDA IPC."""

import sys
from pathlib import Path

import pytest

from tests.gpu import require_cuda

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


def _run_pair(
    mode: str, timeout: float, tmp_path: Path, env: dict[str, str] | None = None, processes: int = 2
) -> list[tuple[int, str]]:
    """Every worker's exit code and output (two workers, or ``processes``)."""
    from bench.multiprocess import run_workers

    logs = [tmp_path / f"{mode}_{i}.log" for i in range(processes)]
    codes = run_workers(
        lambda port, i: [sys.executable, "-m", "tools.multiprocess_worker", str(port), str(i), mode, str(processes)],
        processes,
        timeout,
        env={"XLA_FLAGS": "", **(env or {})},
        logs=logs,
    )
    if codes is None:
        tails = "".join(f"\n--- worker {i} ---\n{log.read_text()[-3000:]}" for i, log in enumerate(logs))
        pytest.fail(f"{mode}: a worker did not finish within {timeout} s:{tails}")
    results = [(code, log.read_text()) for code, log in zip(codes, logs, strict=True)]
    for i, (code, out) in enumerate(results):
        lines = [line for line in out.splitlines() if not line.lstrip().startswith("@ 0x")]
        print(f"--- worker {i} (exit {code}) ---\n" + "\n".join(lines)[-3000:])
    return results


@require_cuda(min_gpus=2)
@pytest.mark.parametrize("p2p", ["peer_stores", "nccl"])
def test_one_process_per_gpu_matches_xla(tmp_path, p2p):
    """With P2P, rows go by peer stores into IPC-mapped buffers; with NCCL_P2P_DISABLE=1, through NCCL."""
    env = {"NCCL_P2P_DISABLE": "1"} if p2p == "nccl" else {}
    for i, (code, out) in enumerate(_run_pair("compare", timeout=300, tmp_path=tmp_path, env=env)):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert out.count("cuda == xla") == 3
        assert f"NCCL ranks: {[1 - i] if p2p == 'nccl' else []}" in out


@require_cuda(min_gpus=1)
@pytest.mark.parametrize("processes", [2, 4])
def test_processes_sharing_one_gpu_match_the_reference(tmp_path, processes):
    """Every rank on GPU 0, each in its own process: every row goes by peer stores into the others' buffers."""
    # R=2 takes about 7 s on one H100; the limit leaves a suite step time to report the workers' output.
    for code, out in _run_pair("compare_shared", timeout=150, tmp_path=tmp_path, processes=processes):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert out.count("cuda == reference") == 3
        assert "NCCL ranks: []" in out


@require_cuda(min_gpus=1)
def test_a_late_rank_fails_and_never_reads_stale_data(tmp_path):
    """Process 1 stalls on the host past timeout_s: both fail with errors naming rank 1, never pairing data of
    different calls, and both are right again after jax_ep.initialize."""
    for i, (code, out) in enumerate(_run_pair("late_shared", timeout=240, tmp_path=tmp_path)):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert f"process {i}: outputs are NaN" in out
        assert out.count("failed as expected") == 2
        assert "after initialize again: cuda == reference" in out


@require_cuda(min_gpus=1)
def test_the_first_call_waits_out_a_compile_skew(tmp_path):
    """Process 1 makes the group's first call timeout_s + 2 s late: it waits the set-up timeout, not timeout_s."""
    for code, out in _run_pair("skew_shared", timeout=240, tmp_path=tmp_path):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert "first call after a skew: cuda == reference" in out


@require_cuda(min_gpus=1)
def test_the_first_call_of_a_later_compiled_function_waits_out_a_skew(tmp_path):
    """Process 1 reaches the first call of a function compiled after the group's first calls timeout_s + 2 s late:
    the first call of every compiled call waits the set-up timeout, not timeout_s."""
    for code, out in _run_pair("skew_later_shared", timeout=240, tmp_path=tmp_path):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert "the first call of a later compiled function after a skew: cuda == reference" in out


@require_cuda(min_gpus=1)
def test_calls_of_different_call_sites_at_one_position_fail_on_both_ranks(tmp_path):
    """Rank 0 alone runs an extra dispatch in a lax.cond branch: the ranks' calls at one position come from two
    call sites, so both fail (NaN outputs, errors naming the sites) instead of pairing their data."""
    for i, (code, out) in enumerate(_run_pair("branch_shared", timeout=180, tmp_path=tmp_path)):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert f"process {i}: outputs are NaN" in out and "check failed as expected" in out


@require_cuda(min_gpus=1)
def test_a_mesh_in_another_device_order_is_an_error(tmp_path):
    """The group's ranks follow the mesh given to initialize; a call over the reversed mesh fails on both."""
    for code, out in _run_pair("wrong_rank_shared", timeout=180, tmp_path=tmp_path):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert "check failed as expected" in out


@require_cuda(min_gpus=1)
@pytest.mark.parametrize("split", ["0", "1"])
def test_a_training_scan_under_command_buffers_with_two_processes(tmp_path, split):
    """tools/command_buffer_scan.py's 200 steps with XLA command buffers on, two processes sharing GPU 0, with
    the whole ops and with the split ops (a matmul between dispatch_start and dispatch_finish)."""
    from tools.command_buffer_scan import COMMAND_BUFFER_FLAGS

    env = {"XLA_FLAGS": COMMAND_BUFFER_FLAGS, "JAX_EP_SCAN_SPLIT": split}
    for code, out in _run_pair("scan_shared", timeout=300, tmp_path=tmp_path, env=env):
        assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
        assert "captured:" in out and "matches the reference" in out


@require_cuda(min_gpus=2)
def test_a_peer_that_never_arrives_gives_a_clear_error_not_a_hang(tmp_path):
    (code, out), _ = _run_pair("peer_hangs", timeout=180, tmp_path=tmp_path)
    assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
    assert "second call failed as expected" in out


@require_cuda()
def test_a_process_that_dies_gives_its_peer_a_clear_error(tmp_path):
    """Two processes share GPU 0; process 1 exits once both have compiled. Process 0's call gives up after the
    group's timeout with NaN outputs, and its next call and Group.check name rank 1: no hang, no stale data."""
    (code, out), (code_1, out_1) = _run_pair("dies_shared", timeout=180, tmp_path=tmp_path)
    assert code_1 == 3 and "dying" in out_1, out_1[-2000:]
    assert code == 0 and out.rstrip().endswith("OK"), out[-4000:]
    assert "outputs are NaN" in out and "next call failed as expected" in out and "check failed as expected" in out
