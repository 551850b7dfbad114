"""Two ranks of one EP group on one GPU, their kernels at the same time on their own streams, next to a stand-in for
an XLA collective that one rank's call waits behind (tests/cuda/two_ranks_one_gpu.cu): the call finishes only if
each rank's kernels leave SMs free (the SM budget of a group of several GPUs) and a rank progresses with fewer
resident blocks than its grid (the send work's shares). Either protection reverted, the call times out."""

import subprocess
from pathlib import Path

from tests.gpu import build_harness, require_cuda

HARNESS = Path(__file__).resolve().parent / "cuda" / "two_ranks_one_gpu.cu"


@require_cuda(min_gpus=1)
def test_ranks_progress_beside_a_collective_that_needs_an_sm(tmp_path):
    program = build_harness(HARNESS, tmp_path)
    done = subprocess.run([str(program)], capture_output=True, text=True, timeout=120)
    print(done.stdout, done.stderr)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("OK"), done.stdout + done.stderr
    assert done.stdout.count("ok: ") == 4, done.stdout
