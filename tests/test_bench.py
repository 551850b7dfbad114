"""``python -m jax_ep.bench`` runs every suite end to end on CPU (xla backend, emulated ragged_all_to_all)."""

import json
import os
import re
import subprocess
import sys


def test_bench_cpu_dry_run_writes_every_number_and_the_plot(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    command = [sys.executable, "-m", "jax_ep.bench", str(out), "--platform", "cpu", "--backends", "xla"]
    command += ["--tokens", "64", "--hidden", "128", "--sweep-tokens", "16,32", "--sweep-hidden", "64,128"]
    command += ["--iters", "2", "--decode-capacity", "4"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m jax_ep.bench")
    assert result["ranks"] == 2 and result["platform"] == "cpu"
    training = result["training"]["xla"]
    for key in ("dispatch_us", "combine_us", "routing_only_us", "local_layout_us", "dispatch_gbps"):
        assert training[key] > 0, key
    assert result["decode"]["xla"]["dispatch_us"] > 0
    assert [(p["tokens"], p["hidden"]) for p in result["sweep"]] == [(16, 64), (32, 64), (16, 128), (32, 128)]
    assert all(p["xla"]["combine_us"] > 0 for p in result["sweep"])
    for flag in ("true", "false"):
        runs = result["ragged_all_to_all"]["one_shot"][flag]
        assert sorted(runs) == ["16", "32", "64"]
        assert all(run["correct"] and run["roundtrip_us"] > 0 for run in runs.values())
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert re.search(r"^\[ *\d+\.\d s\] training shape: T=64, H=128$", done.stdout, re.MULTILINE), done.stdout


def test_multiprocess_bench_cpu_dry_run(tmp_path):
    """Two processes under jax.distributed run the same timing loops together (xla backend, gloo on CPU)."""
    out = tmp_path / "multiprocess.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = [sys.executable, "-m", "jax_ep.bench.multiprocess", str(out), "--platform", "cpu"]
    command += ["--backends", "xla", "--tokens", "64", "--hidden", "128", "--iters", "20", "--timeout", "240"]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and len(result["devices"]) == 2
    assert result["command"].startswith("python -m jax_ep.bench.multiprocess")
    assert set(result["xla"]) >= {"dispatch_us", "combine_us", "dispatch_gbps", "combine_gbps"}
    assert "process 1, xla" in done.stdout and "process 0, xla" in done.stdout


def test_speedups_are_per_suite_and_shape():
    from jax_ep.bench.__main__ import speedups

    def timed(dispatch, combine):
        return {"dispatch_us": dispatch, "combine_us": combine}

    payload = {
        "training": {"tokens": 4096, "hidden": 7168, "cuda": timed(1, 1), "xla": timed(2, 2)},
        "sweep": [{"tokens": 4096, "hidden": 7168, "cuda": timed(1, 3), "xla": timed(2, 2)}],
        "ragged_all_to_all": {"hidden": 7168, "one_shot": {"true": {"4096": {"roundtrip_us": 100}}, "false": {}}},
    }
    assert speedups(payload) == {
        "training T=4096,H=7168": {"xla": 2.0, "ragged_all_to_all_one_shot_true": 50.0},
        "sweep T=4096,H=7168": {"xla": 1.0, "ragged_all_to_all_one_shot_true": 25.0},
    }
