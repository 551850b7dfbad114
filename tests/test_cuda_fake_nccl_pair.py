"""The transfer kernels of a two-rank group whose second rank is reached through NCCL, on one GPU with the swap
faked (tests/cuda/fake_nccl_pair.cu; NCCL puts no two ranks on one GPU):

* a region that arrives without its call's tag fails the call and poisons its outputs;
* float32 partial sums of bf16 rows leave in whole 32-byte sectors (Nsight Compute's sectors per store request).
"""

import csv
import pathlib
import shutil
import subprocess

import pytest

from tests.gpu import build_harness, gpu_devices, require_cuda

ROOT = pathlib.Path(__file__).resolve().parents[1]
HARNESS = ROOT / "tests/cuda/fake_nccl_pair.cu"


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    return build_harness(HARNESS, tmp_path_factory.mktemp("fake_nccl_pair"))


@pytest.mark.slow  # nvcc builds the four kernel files: about 40 s on 2 cores
def test_the_harness_links_with_the_kernels_and_fails_loudly_without_a_gpu(harness):
    """The harness builds against launch.h and links with the kernels' objects, so a launcher whose declaration
    and definition disagree fails here, on machines without a GPU too; and it never reports success without
    running: with no GPU it stops at cudaSetDevice, exit 1."""
    assert harness.is_file()
    if gpu_devices() or pathlib.Path("/dev/nvidiactl").exists():
        pytest.skip("a GPU is here: the tests below run the harness")
    done = subprocess.run([str(harness)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stdout + done.stderr
    assert done.stdout.startswith("FAILED: cudaSetDevice(0): ") and "OK" not in done.stdout, done.stdout


@require_cuda(min_gpus=1)
def test_a_region_of_another_call_fails_the_call_and_poisons_its_outputs(harness):
    done = subprocess.run([str(harness)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.rstrip().endswith("OK"), done.stdout + done.stderr
    assert done.stdout.count("ok: ") == 8, done.stdout


@require_cuda(min_gpus=1)
def test_float32_partials_are_stored_in_whole_sectors(harness, tmp_path):
    """16 bytes per lane, lanes adjacent: 512 bytes, 16 sectors, per store request (32 when each lane stored two
    16-byte chunks 32 bytes apart)."""
    ncu = shutil.which("ncu")
    if ncu is None:
        pytest.skip("ncu not found")
    metrics = "l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum,l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"
    log = tmp_path / "stores.csv"
    command = [ncu, "--kernel-name", "regex:CombineKernel", "--launch-count", "1", "--metrics", metrics]
    command += ["--csv", "--print-units", "base", "--log-file", str(log), str(harness), "stores"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "OK" in done.stdout, done.stdout + done.stderr
    text = log.read_text()
    values = {
        row["Metric Name"]: float(row["Metric Value"].replace(",", ""))
        for row in csv.DictReader(text[text.index('"ID"') :].splitlines())
    }
    sectors = values["l1tex__t_sectors_pipe_lsu_mem_global_op_st.sum"]
    requests = values["l1tex__t_requests_pipe_lsu_mem_global_op_st.sum"]
    print(f"send launch: {sectors:.0f} store sectors in {requests:.0f} requests: {sectors / requests:.2f} per request")
    assert requests > 1024 and sectors / requests <= 16.5, (sectors, requests)
