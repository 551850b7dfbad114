"""The benchmark scripts end to end on CPU (xla backend, emulated ragged_all_to_all), and their parsers."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_cpu_dry_run_writes_every_number_and_the_plot(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    command = [sys.executable, "-m", "bench.exchange", str(out), "--platform", "cpu", "--backends", "xla"]
    command += ["--tokens", "64", "--hidden", "128", "--sweep-tokens", "16,32", "--sweep-hidden", "64,128"]
    command += ["--iters", "2", "--decode-capacity", "4"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m bench.exchange")
    assert result["ranks"] == 2 and result["platform"] == "cpu"
    training = result["training"]["xla"]
    for key in ("dispatch_us", "combine_us", "dispatch_gbps"):
        assert training[key] > 0, key
    assert not {"routing_only_us", "local_layout_us"} & set(training)  # no layout-only step any more
    fp8 = result["training"]["fp8"]  # H=128: 128 e4m3 bytes and one float32 scale, padded to 144
    assert fp8["row_bytes_bfloat16"] == 256 and fp8["row_bytes_fp8"] == 144
    assert fp8["remote_bytes_per_rank"] * 256 == fp8["remote_bytes_per_rank_bfloat16"] * 144
    assert fp8["remote_bytes_per_rank_bfloat16"] == result["training"]["remote_bytes_per_rank"] > 0
    assert fp8["xla"]["dispatch_us"] > 0 and fp8["xla"]["dispatch_gbps"] > 0
    assert result["decode"]["xla"]["dispatch_us"] > 0
    assert [(p["tokens"], p["hidden"]) for p in result["sweep"]] == [(16, 64), (32, 64), (16, 128), (32, 128)]
    assert all(p["xla"]["combine_us"] > 0 for p in result["sweep"])
    assert list(result["ragged_all_to_all"]["one_shot"]) == ["emulated"]  # XLA's flag means nothing on CPU
    runs = result["ragged_all_to_all"]["one_shot"]["emulated"]
    assert sorted(runs) == ["16", "32", "64"]
    assert all(run["correct"] and run["roundtrip_us"] > 0 for run in runs.values())
    assert (tmp_path / "bench.png").stat().st_size > 10_000
    assert re.search(r"^\[ *\d+\.\d s\] training shape: T=64, H=128$", done.stdout, re.MULTILINE), done.stdout
    assert "EP group: 2 of the 2 cpu devices" in done.stdout
    assert "peer copy of" in done.stdout and "not measured (needs 2 GPUs)" in done.stdout and "nan" not in done.stdout
    assert result["training"]["peer_copy_us"] is None and result["training"]["xla"]["dispatch_pct_of_copy"] is None


def test_bench_defaults_follow_the_platform(monkeypatch):
    """A CPU dry run gets small shapes unless told otherwise; the GPU keeps the DeepSeek-like ones."""
    from bench import exchange as bench

    monkeypatch.setattr(sys, "argv", ["bench", "out.json", "--platform", "cpu", "--hidden", "128"])
    args = bench.parse_args()
    assert (args.tokens, args.hidden, args.sweep_tokens, args.iters) == (64, 128, "16,32,64", 5)
    monkeypatch.setattr(sys, "argv", ["bench", "out.json"])
    args = bench.parse_args()
    assert (args.tokens, args.hidden, args.iters, args.ranks) == (4096, 7168, 50, None)


@pytest.mark.multiprocess
def test_multiprocess_bench_cpu_dry_run(tmp_path):
    """Two processes under jax.distributed run the same timing loops together (xla backend, gloo on CPU)."""
    out = tmp_path / "multiprocess.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    command = [sys.executable, "-m", "bench.multiprocess", str(out), "--platform", "cpu"]
    command += ["--backends", "xla", "--tokens", "64", "--hidden", "128", "--iters", "20", "--timeout", "240"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["processes"] == 2 and len(result["devices"]) == 2
    assert result["command"].startswith("python -m bench.multiprocess")
    assert set(result["xla"]) >= {"dispatch_us", "combine_us", "dispatch_gbps", "combine_gbps"}
    assert "process 1, xla" in done.stdout and "process 0, xla" in done.stdout


def test_the_performance_page_opens_with_the_table_and_plot_made_from_the_results(tmp_path, capsys):
    """docs/performance.md's first table is the one bench/plot_performance.py makes from the committed results
    files, line for line, and the page shows the plot, which the script draws from the same files."""
    from bench import plot_performance

    page = (ROOT / "docs" / "performance.md").read_text()
    table = plot_performance.table()
    assert "\n".join(table) in page
    assert "|---" not in page[: page.index(table[0])], "the headline table must be the page's first"
    assert "not yet measured" in table[-1] and "two or more GPUs" in table[-1]
    assert "](performance.png)" in page and (ROOT / "docs" / "performance.png").stat().st_size > 20_000

    assert plot_performance.main([str(tmp_path / "plot.png")]) == 0
    assert (tmp_path / "plot.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "plot.png").stat().st_size > 20_000
    assert capsys.readouterr().out.splitlines() == table


def test_bench_results_holds_the_files_the_docs_cite():
    """bench/results keeps only results files that a doc cites, at most 30; a doc that cites a file the tree no
    longer holds says, on the same line, that it is in git history."""
    pages = [ROOT / "README.md", ROOT / "BUILD.md", *sorted((ROOT / "docs").rglob("*.md"))]
    pages += [ROOT / "bench" / "README.md", ROOT / "tools" / "README.md"]
    lines = [line for page in pages for line in page.read_text().splitlines()]
    name = re.compile(r"\b\w+_h[12]00x\d\.json|\breliability_fuzz_cpu\.json")
    cited = {found for line in lines for found in name.findall(line)}
    held = {path.name for path in (ROOT / "bench" / "results").iterdir()}
    assert len(held) <= 30 and held <= cited, f"not cited by any doc: {sorted(held - cited)}"
    gone = [line for line in lines if any(f not in held for f in name.findall(line)) and "in git history" not in line]
    assert gone == [], "cites a file that bench/results no longer holds"


def test_speedups_are_per_suite_and_shape():
    from bench.exchange import speedups

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


def test_time_backend_times_the_ops_it_is_asked_for(monkeypatch):
    """time_backend's dispatch sends rows as ``wire_dtype`` and its combine sums in ``partial_dtype``, each passed
    only when set (so that older builds' ops, without them, time with the same method), and it reports each step's
    seconds per call as µs. The loops are traced, not timed (the CPU dry runs time them)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from bench import timing

    calls = {"dispatch": [], "combine": []}
    real = {op: getattr(jax_ep, op) for op in calls}

    def spy(op):
        def call(*args, **kwargs):
            calls[op].append({k: kwargs[k] for k in ("wire_dtype", "partial_dtype") if k in kwargs})
            return real[op](*args, **kwargs)

        return call

    def traced(step, args, iters, adaptive):
        body = jax.shard_map(lambda *a: step(jnp.int32(1), *a)[None], in_specs=P("ep"), out_specs=P("ep"))
        assert jax.eval_shape(body, *args).dtype == jnp.float32
        return 2e-6

    for op in calls:
        monkeypatch.setattr(jax_ep, op, spy(op))
    monkeypatch.setattr(timing, "seconds_per_call", traced)
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("cpu")[:1])
    x, idx, w, _ = timing.make_inputs(1, 8, 128)
    with jax.set_mesh(mesh):
        timed = timing.time_backend("xla", x, idx, w, partial_dtype=jnp.float32)
        assert timed == {"dispatch_us": pytest.approx(2.0), "combine_us": pytest.approx(2.0)}
        assert calls["dispatch"] and all(kw == {} for kw in calls["dispatch"])
        assert calls["combine"] and all(kw == {"partial_dtype": jnp.float32} for kw in calls["combine"])
        calls["dispatch"].clear(), calls["combine"].clear()
        timing.time_backend("xla", x, idx, w, wire_dtype=jnp.float8_e4m3fn)
    assert calls["dispatch"] and all(kw == {"wire_dtype": jnp.float8_e4m3fn} for kw in calls["dispatch"])
    assert calls["combine"] and all(kw == {} for kw in calls["combine"])


def _ncu_csv(path: Path, calls: list[list[tuple]]) -> None:
    """An ncu --csv --print-units base log of these kernels, after a line of ncu's own: each kernel is
    ``(name, µs)`` or ``(name, µs, {metric: value})``."""
    columns = ["ID", "Kernel Name", "Block Size", "Grid Size", "Section Name", "Metric Name", "Metric Unit"]
    lines = ["==PROF== Connected to process 1", ",".join(f'"{c}"' for c in [*columns, "Metric Value"])]
    kernels = [k for call in calls for k in call]
    for i, (name, us, *more) in enumerate(kernels):
        metrics = {"gpu__time_duration.sum": f"{us * 1000:,.0f}", **(more[0] if more else {})}
        for metric, value in metrics.items():
            cells = [str(i), name, "(1024, 1, 1)", "(132, 1, 1)", "Command line profiler metrics"]
            cells += [metric, "", value]
            lines.append(",".join(f'"{c}"' for c in cells))
    path.write_text("\n".join(lines) + "\n")


ROUTING = "void jax_ep::(anonymous namespace)::RoutingKernel<8>(jax_ep::Params)"
DISPATCH = "void jax_ep::<unnamed>::DispatchKernel<__nv_bfloat16, 8, true>(jax_ep::Params)"
COMBINE = "jax_ep::<unnamed>::CombineKernel<float>"


def test_profile_summary_splits_the_last_call_by_kernel_name(tmp_path):
    from bench import profile_kernels as profile

    assert profile.function_name(DISPATCH) == "DispatchKernel"
    assert profile.function_name(ROUTING) == "RoutingKernel"
    assert profile.function_name("loop_add_fusion") == "loop_add_fusion"
    call = [("input_concatenate_fusion", 2.0), (ROUTING, 5.0), (DISPATCH, 100.0), ("loop_select_fusion", 3.0)]
    call += [(COMBINE, 80.0), ("wrapped_copy", 1.0)]
    last = [(name, us * 2) for name, us in call]  # the last call is told apart by its times
    marker = [("wrapped_cbrt", 0.5)]
    _ncu_csv(tmp_path / "k.csv", [[("convert_fusion", 7.0)], call, call, marker, last])
    profile.summarize(tmp_path / "k.csv", tmp_path / "k.json", 128, 7168)

    result = json.loads((tmp_path / "k.json").read_text())
    assert result["missing"] == [] and result["calls_seen"] == 3 and result["jax_ep_kernels_per_call"] == [3, 3, 3]
    assert "marker" in result["boundary"]
    dispatch, combine = result["ops"]["dispatch"], result["ops"]["combine"]
    assert (dispatch["kernels"], dispatch["us"]) == (2, 210.0)
    assert [k["name"] for k in dispatch["list"]] == ["RoutingKernel", "DispatchKernel"]
    assert (combine["kernels"], combine["us"]) == (1, 160.0)
    xla = result["xla_kernels"]
    assert [(k["name"], k["us"], k["after"]) for k in xla["list"]] == [
        ("input_concatenate_fusion", 4.0, None),
        ("loop_select_fusion", 6.0, "DispatchKernel"),
        ("wrapped_copy", 2.0, "CombineKernel"),
    ]
    assert xla["us"] == 12.0

    # Without the marker, the call before's trailing XLA kernels are taken in, and the JSON says so.
    _ncu_csv(tmp_path / "k.csv", [call, call, last])
    profile.summarize(tmp_path / "k.csv", tmp_path / "k.json", 128, 7168)
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["boundary"].startswith("no marker") and result["ops"]["dispatch"]["us"] == 210.0
    assert [k["name"] for k in result["xla_kernels"]["list"]][:2] == ["wrapped_copy", "input_concatenate_fusion"]


def test_profile_compare_lists_the_metrics_that_differ(tmp_path):
    """bench/profile_kernels.py compare: per kernel function (its first instance), the metrics that differ by more
    than 2% between the files, or as text; equal ones and those within 2% are left out."""
    from bench import profile_kernels as profile

    a = [(DISPATCH, 17.0, {"smsp__inst_executed.sum": "1,000", "launch__grid_size": "132", "note": "x"})]
    a += [(COMBINE, 15.0), (DISPATCH, 99.0)]
    b = [(DISPATCH, 18.9, {"smsp__inst_executed.sum": "1,010", "launch__grid_size": "132", "note": "y"})]
    _ncu_csv(tmp_path / "a.csv", [a])
    _ncu_csv(tmp_path / "b.csv", [b])
    lines = profile.compare([tmp_path / "a.csv", tmp_path / "b.csv"])
    assert lines[0] == "compare: a.csv | b.csv"
    assert lines[1:] == [
        "DispatchKernel gpu__time_duration.sum: 1.7e+04 | 1.89e+04",
        "DispatchKernel note: x | y",
        "CombineKernel gpu__time_duration.sum: 1.5e+04 | -",
    ]


def test_profile_summary_of_training_steps(tmp_path):
    """A training step's kernels: combine's backward kernel is an op of its own; the xla step has no jax_ep kernel
    and is told apart by the marker alone."""
    from bench import profile_kernels as profile

    backward = "void jax_ep::<unnamed>::CombineBackwardKernel<__nv_bfloat16>(jax_ep::BackwardParams, jax_ep::GroupView)"
    call = [(DISPATCH, 15.0), ("loop_convert_fusion", 11.0), (COMBINE, 11.0), (backward, 17.0), (COMBINE, 11.5)]
    _ncu_csv(tmp_path / "k.csv", [call, call, [("wrapped_cbrt", 0.5)], call])
    profile.summarize(tmp_path / "k.csv", tmp_path / "k.json", 128, 7168, "training")
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["missing"] == ["RoutingKernel"] and "warning" not in result
    assert result["ops"]["combine"]["us"] == 22.5 and result["ops"]["combine_backward"]["us"] == 17.0
    assert result["xla_kernels"]["us"] == 11.0

    xla_call = [("loop_convert_fusion", 3.0), ("input_reduce_fusion", 1.0)]
    _ncu_csv(tmp_path / "x.csv", [xla_call, xla_call, [("wrapped_cbrt", 0.5)], [(n, 2 * us) for n, us in xla_call]])
    profile.summarize(tmp_path / "x.csv", tmp_path / "x.json", 128, 7168, "training_xla")
    result = json.loads((tmp_path / "x.json").read_text())
    assert result["ops"] == {} and result["missing"] == [] and "warning" not in result and "error" not in result
    assert result["xla_kernels"]["us"] == 8.0 and result["xla_kernels"]["kernels"] == 2


def test_profile_summary_says_what_is_missing_instead_of_failing(tmp_path):
    from bench import profile_kernels as profile

    _ncu_csv(tmp_path / "k.csv", [[(ROUTING, 5.0), ("fusion", 1.0), (DISPATCH, 9.0)]] * 2)
    profile.summarize(tmp_path / "k.csv", tmp_path / "k.json", 128, 7168)
    result = json.loads((tmp_path / "k.json").read_text())
    assert result["missing"] == ["CombineKernel"] and result["ops"]["combine"]["kernels"] == 0
    assert "2 calls" in result["warning"]

    _ncu_csv(tmp_path / "none.csv", [[("fusion", 1.0)]])
    profile.summarize(tmp_path / "none.csv", tmp_path / "none.json", 128, 7168)
    result = json.loads((tmp_path / "none.json").read_text())
    assert "no jax_ep kernel" in result["error"] and result["profiled_kernels_tail"][0]["name"] == "fusion"

    profile.summarize(tmp_path / "absent.csv", tmp_path / "absent.json", 128, 7168)
    assert "no profile read" in json.loads((tmp_path / "absent.json").read_text())["error"]


@pytest.mark.slow
def test_gpu_tests_records_every_outcome(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "import pytest\n"
        "def test_ok(): pass\n"
        "def test_bad(): assert False\n"
        "@pytest.mark.skip(reason='no')\n"
        "def test_skip(): pass\n"
        "@pytest.fixture\n"
        "def broken(): raise RuntimeError('setup')\n"
        "def test_error(broken): pass\n"
    )
    command = [sys.executable, "-m", "bench.gpu_tests", str(tmp_path / "out.json"), "test_sample.py"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}  # run from another folder, as on a GPU machine
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["complete"] and result["pytest_exit"] == 1 and "interrupted" not in result
    assert result["summary"] == {"passed": 1, "failure": 1, "error": 1, "skipped": 1}
    outcomes = {case["test"].split("::")[-1]: case["outcome"] for case in result["tests"]}
    assert outcomes == {"test_ok": "passed", "test_bad": "failure", "test_skip": "skipped", "test_error": "error"}
    # run from another folder, as on a GPU machine: the hash is still the checkout's that holds the script
    from bench.record import source_hash

    assert result["sources"] == source_hash(ROOT)


@pytest.mark.slow
def test_gpu_tests_in_shards_runs_each_test_once_in_its_phase(tmp_path):
    """--shards 2: the parallel tests split over two processes; after them the multi-process and serial-file tests
    over two more, one each; last the whole-GPU file and the test marked whole_gpu alone. Each test once, merged
    into one file with every outcome and part, pytest's worst exit code."""
    body = "import pytest\n" + "".join(f"def test_ok{i}(): pass\n" for i in range(5)) + "def test_bad(): assert False\n"
    body += "@pytest.mark.multiprocess\ndef test_peers(): pass\n@pytest.mark.whole_gpu\ndef test_big(): pass\n"
    (tmp_path / "test_sample.py").write_text(body)
    (tmp_path / "test_cuda_finalize.py").write_text("def test_timers(): pass\n")
    (tmp_path / "test_cuda_reliability.py").write_text("def test_whole_gpu(): pass\n")
    command = [sys.executable, "-m", "bench.gpu_tests", str(tmp_path / "out.json"), "--shards", "2"]
    command += ["test_sample.py", "test_cuda_finalize.py", "test_cuda_reliability.py", "-p", "no:cacheprovider"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads((tmp_path / "out.json").read_text())
    assert result["complete"] and result["pytest_exit"] == 1
    assert result["parts"] == ["shard0", "shard1", "serial0", "serial1", "alone"]
    assert result["summary"] == {"passed": 9, "failure": 1, "error": 0, "skipped": 0}
    phases = {case["test"].split("::")[-1]: case["phase"] for case in result["tests"]}
    assert len(result["tests"]) == len(phases) == 10
    assert sorted([phases["test_peers"], phases["test_timers"]]) == ["serial0", "serial1"]
    assert phases["test_whole_gpu"] == phases["test_big"] == "alone"
    shards = [name for name, phase in phases.items() if phase.startswith("shard")]
    assert sorted(shards) == sorted([f"test_ok{i}" for i in range(5)] + ["test_bad"])
    assert {phases[name] for name in shards} == {"shard0", "shard1"}
    assert sorted(path.name for path in tmp_path.glob("out.json*")) == ["out.json", "out.json.log"]
    assert "test_peers PASSED" in (tmp_path / "out.json.log").read_text()


def test_sources_hash_names_the_code_that_ran(tmp_path):
    """A copy of a commit's sources hashes like its checkout, whatever its git says; caches, built extensions and
    files outside the sources do not count; any change to a source file's content or name does."""
    from bench.record import SOURCES, checkout_root, source_hash

    repo, copy = tmp_path / "repo", tmp_path / "copy"
    for folder in (repo / "jax_ep", repo / "ffi" / "kernels", copy):
        folder.mkdir(parents=True)
    (repo / "jax_ep" / "a.py").write_text("x = 1\n")
    (repo / "ffi" / "kernels" / "k.cu").write_text("// kernel\n")
    (repo / "CMakeLists.txt").write_text("project(x)\n")
    (repo / "pyproject.toml").write_text("[project]\n")
    (repo / "README.md").write_text("not a source\n")

    def git(*args):
        return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True).stdout

    git("init", "-q")
    git("add", ".")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "sources")
    subprocess.run(["tar", "-x", "-C", str(copy)], input=git("archive", "HEAD", *SOURCES), check=True)
    base = source_hash(repo)
    assert base is not None and source_hash(copy) == base

    (repo / "jax_ep" / "__pycache__").mkdir()
    (repo / "jax_ep" / "__pycache__" / "a.cpython-312.pyc").write_bytes(b"\0")
    (repo / "jax_ep" / "_ext.so").write_bytes(b"\0")
    (repo / "README.md").write_text("changed\n")
    assert source_hash(repo) == base
    (copy / "ffi" / "kernels" / "k.cu").write_text("// kernel, changed\n")
    assert source_hash(copy) not in (base, None)
    (copy / "ffi" / "kernels" / "k.cu").write_text("// kernel\n")
    assert source_hash(copy) == base
    (copy / "ffi" / "kernels" / "k.cu").rename(copy / "ffi" / "kernels" / "l.cu")
    assert source_hash(copy) not in (base, None)

    assert checkout_root(repo / "ffi" / "kernels" / "k.cu") == repo.resolve()
    assert checkout_root(tmp_path) is None and source_hash(tmp_path) is None


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["cpu"])
def test_one_gpu_targets_cpu_dry_run_and_the_device_summary(tmp_path, platform):
    out = tmp_path / "targets.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "bench.one_gpu_targets", str(out), "--platform", platform]
    command += ["--tokens", "32,128", "--hidden", "128", "--iters", "2"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    result = json.loads(out.read_text())
    assert result["complete"] and result["errors"] == [] and result["tokens"] == [128, 32]
    assert result["script_command"].startswith("python -m bench.one_gpu_targets")
    assert "skipped" in result["copy"] and result["cuda"]["used"] is False
    assert result["checked"] is False  # xla against itself checks nothing
    assert result["check"]["128"]["passed"] and result["check"]["32"]["dispatch_bitwise"]
    decode = result["decode"]
    assert decode["backend"] == "xla" and decode["dispatch_us"] > 0 and decode["combine_us"] > 0
    assert decode["delivered_rows"] == 128 * 8
    assert decode["dispatch_floor_bytes"] == 128 * 128 * 2 + 1024 * 128 * 2 + 1024 * 4
    assert decode["dispatch_floor_us"] is None and decode["dispatch_ratio"] is None
    assert result["tokens_32"]["combine_us"] > 0
    steps = result["training_step"]
    assert steps["128"]["xla_us"] > 0 and steps["32"]["xla_us"] > 0 and "skipped" in steps
    assert done.stdout.rstrip().splitlines()[-1].startswith("checked: false (xla against xla;")

    from bench import profile_kernels as profile

    _ncu_csv(tmp_path / "k.csv", [[(ROUTING, 5.0), (DISPATCH, 9.0), (COMBINE, 4.0)]] * 3)
    profile.summarize(tmp_path / "k.csv", tmp_path / "kernels_128.json", 128, 7168)
    (tmp_path / "gpu_tests.json").write_text(json.dumps({"pytest_exit": 0, "summary": {"passed": 3}, "tests": []}))
    from bench import one_gpu_targets

    lines = one_gpu_targets.summarize(tmp_path)
    assert lines[0] == "GPU tests (complete, pytest exit 0): {'passed': 3}"
    assert lines[1].startswith("ncu T=128 dispatch: 2 kernels,     14.0 us")
    assert any(line.startswith("training step T=  128: xla") for line in lines)


def test_floors_count_hbm_bytes():
    from bench import one_gpu_targets as targets

    floors = targets.floors(4096, 7168, 4096 * 8, 4e12)
    row = 7168 * 2
    assert floors["dispatch_floor_bytes"] == 4096 * row + 32768 * row + 32768 * 4
    assert floors["combine_floor_bytes"] == floors["dispatch_floor_bytes"]
    assert floors["dispatch_floor_us"] == pytest.approx(floors["dispatch_floor_bytes"] / 4e12 * 1e6)
    assert "dispatch_write_floor_us" not in floors
    written = targets.floors(4096, 7168, 4096 * 8, 4e12, fill=2e12)
    assert written["dispatch_write_floor_us"] == pytest.approx((32768 * row + 32768 * 4) / 2e12 * 1e6)
    assert written["combine_write_floor_us"] == pytest.approx(4096 * row / 2e12 * 1e6)
    assert targets.role(4096) == "training" and targets.role(128) == "decode" and targets.role(64) == "tokens_64"


def test_sanitizer_reports_are_counted_by_their_first_line_and_function():
    """bench/sanitize.py counts each kind of report in each device function, and keeps where it was seen first,
    even from a cut-short run."""
    output = "\n".join(
        [
            "========= COMPUTE-SANITIZER",
            "========= Uninitialized __global__ memory read of size 4 bytes",
            "=========     at jax_ep::DispatchKernel(jax_ep::Params)+0x1a0 in dispatch.cu:120",
            "=========     by thread (3,0,0) in block (0,0,0)",
            "=========     Host Frame: PjitFunction::Call [0x7c2fee8] in libjax_common.so",
            "probe ragged float32 H=256 capacity=None: cuda matches xla",
            "========= Uninitialized __global__ memory read of size 4 bytes",
            "=========     at jax_ep::DispatchKernel(jax_ep::Params)+0x1b0 in dispatch.cu:121",
            "========= Uninitialized __global__ memory read of size 4 bytes",
            "=========     at loop_multiply_fusion+0x90",
            "========= Host API memory access error at 0x7f00 in cudaMemcpyAsync",
            "=========     Host Frame: cudaMemcpyAsync [0x1] in libcudart.so",
            "=========     Host Frame: Publish in group.cc:245",
            "========= ERROR SUMMARY: 4 errors",
        ]
    )
    from bench import sanitize

    found = sanitize.reports(output)
    read = "Uninitialized __global__ memory read of size 4 bytes"
    kernel = "jax_ep::DispatchKernel(jax_ep::Params)"
    host = ["PjitFunction::Call [0x7c2fee8] in libjax_common.so"]
    assert found == [
        dict(report=read, where=kernel, count=2, first_at=f"{kernel}+0x1a0 in dispatch.cu:120", first_host_frames=host),
        dict(report=read, where="loop_multiply_fusion", count=1, first_at="loop_multiply_fusion+0x90")
        | dict(first_host_frames=[]),
        dict(
            report="Host API memory access error at 0x… in cudaMemcpyAsync",
            where=None,
            count=1,
            first_at=None,
            first_host_frames=["cudaMemcpyAsync [0x1] in libcudart.so", "Publish in group.cc:245"],
        ),
    ]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
def test_write_patterns_program_compiles(tmp_path):
    """bench/write_patterns.cu is a standalone program outside the extension's build: CI compiles it here."""
    source = ROOT / "bench" / "write_patterns.cu"
    command = ["nvcc", "-arch=sm_90", "-O3", "-std=c++17", "-o", str(tmp_path / "write_patterns"), str(source)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.skipif(not (os.environ.get("CUDACXX") or shutil.which("nvcc")), reason="needs nvcc")
def test_copy_timing_is_built_on_first_use_and_reports_cuda_errors(tmp_path, monkeypatch):
    """The benchmarks' copy and fill yardsticks ship in no wheel: bench/copy_timing.cu is compiled by nvcc into a
    cache on first use and loaded. On a GPU they time a copy; without one the CUDA runtime's error, naming the call,
    comes back as a RuntimeError, never as a number."""
    import jax

    from bench import copy_timing

    monkeypatch.setattr(copy_timing, "CACHE", tmp_path)
    copy_timing._library.cache_clear()
    with pytest.raises(ValueError, match="iters must be at least 1, got 0"):
        copy_timing.fill_seconds(0, 1 << 20, 0)
    assert not copy_timing.library_path().exists()  # checked before anything is built
    try:
        try:
            gpus = jax.devices("gpu")
        except RuntimeError:
            gpus = []
        if gpus:
            assert copy_timing.peer_copy_seconds(0, 0, 1 << 24, 3) > 0
            assert copy_timing.fill_seconds(0, 1 << 24, 3) > 0
        else:
            with pytest.raises(RuntimeError, match=r"jax_ep_bench_fill_seconds: cudaSetDevice: \S"):
                copy_timing.fill_seconds(0, 1 << 20, 3)
            with pytest.raises(RuntimeError, match=r"jax_ep_bench_peer_copy_seconds: cudaSetDevice: \S"):
                copy_timing.peer_copy_seconds(0, 0, 1 << 20, 3)
    finally:
        copy_timing._library.cache_clear()
    assert copy_timing.library_path().is_file() and list(tmp_path.iterdir()) == [copy_timing.library_path()]


@pytest.mark.slow
def test_split_steps_compute_what_the_whole_steps_do():
    """bench/profile_kernels.py's steps of bench/feature_costs.py, on the xla backend: each split step gives the
    whole step's value, so the two versions that are set side by side do the same work."""
    import jax
    import jax.numpy as jnp

    from bench import profile_kernels as profile
    from bench.timing import make_inputs

    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:1])
    x, idx, w, _ = make_inputs(1, 16, 128)
    with jax.set_mesh(mesh):
        values = {}
        for name in profile.STEPS[1:]:
            call, operands = profile._split_step(name, x, jnp.asarray(idx), w, 128, backend="xla")
            values[name] = float(call(*operands)[0])
    assert all(jnp.isfinite(v) and v != 0.0 for v in values.values()), values
    assert values["dispatch_split"] == values["dispatch"] and values["combine_split"] == values["combine"], values


@pytest.mark.slow
def test_feature_costs_cpu_dry_run(tmp_path):
    out = tmp_path / "costs.json"
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    command = [sys.executable, "-m", "bench.feature_costs", str(out), "--platform", "cpu"]
    command += ["--backend", "xla", "--hidden", "128", "--tokens", "16", "--iters", "2"]
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["command"].startswith("python -m bench.feature_costs") and result["backend"] == "xla"
    row = result["results"]["16"]
    for op in ("dispatch", "combine"):
        split = row["split"][op]
        assert split["whole_us"] > 0 and split["split_us"] > 0
        assert split["ratio"] == split["split_us"] / split["whole_us"]
    assert row["fp8"]["bf16_dispatch_us"] > 0 and row["fp8"]["fp8_dispatch_us"] > 0
    assert "split + mm us" in done.stdout


def test_grouped_matmul_ncu_summary_pairs_each_op_with_its_einsum(tmp_path):
    """bench/grouped_matmul_ncu.py: the kernels after each marker are one op of one side, in run()'s order; every
    metric is read; a profile with a marker missing is an error, not a shifted table."""
    from bench import grouped_matmul_ncu as ncu

    tensor = ncu.METRICS["tensor_active_pct"][1]
    stall = "smsp__warp_issue_stalled_barrier_per_warp_active.pct"
    marker = [("wrapped_cbrt", 0.5)]
    calls = [[("random_bits_fusion", 9.0)]]
    for op, (ours, theirs) in {"fwd": (1500.0, 1300.0), "dx": (1650.0, 1310.0), "dw": (1750.0, 1320.0)}.items():
        calls += [marker, [("memset", 2.0), (f"mosaic_{op}", ours, {tensor: "71.5", stall: "12.5"})]]
        calls += [marker, [(f"nvjet_{op}", theirs, {tensor: "88.25", "Grid Size": "132"})]]
    _ncu_csv(tmp_path / "k.csv", calls)
    assert ncu.summarize(tmp_path / "k.csv", tmp_path / "k.json", (32768, 7168, 2048, 32)) == 0

    result = json.loads((tmp_path / "k.json").read_text())
    fwd = result["ops"]["fwd"]
    assert fwd["jax_ep"]["us"] == 1502.0 and [k["name"] for k in fwd["jax_ep"]["kernels"]] == ["memset", "mosaic_fwd"]
    assert fwd["jax_ep"]["main_kernel"]["tensor_active_pct"] == 71.5
    assert fwd["jax_ep"]["main_kernel"]["stalls_pct"] == {"barrier": 12.5}
    assert fwd["jax_ep"]["tflops"] == 2 * 32768 * 7168 * 2048 / 1502e6
    assert fwd["einsum"]["main_kernel"]["name"] == "nvjet_fwd" and fwd["einsum"]["main_kernel"]["grid"] == 132.0
    assert result["ops"]["dw"]["einsum"]["us"] == 1320.0

    # The metrics asked for: what the chip lists, the first tensor-pipe metric it has, its stall reasons.
    query = "sm__throughput  x\nsm__pipe_tensor_cycles_active  y\nsmsp__warp_issue_stalled_barrier_per_warp_active z"
    assert ncu.metric_list(query) == [
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__throughput.avg.pct_of_peak_sustained_elapsed",
        stall,
    ]

    _ncu_csv(tmp_path / "k.csv", calls[2:])  # the first marker lost
    assert ncu.summarize(tmp_path / "k.csv", tmp_path / "k.json", (32768, 7168, 2048, 32)) == 1
    assert "marker" in json.loads((tmp_path / "k.json").read_text())["error"]


@pytest.mark.parametrize("groups", [32, 256])
def test_grouped_matmul_bench_prints_every_op_it_times(groups):
    """Each of the grouped-matmul bench's timed functions has a row in its printed table (OPS)."""
    import jax
    import jax.numpy as jnp

    from bench import grouped_matmul as bench
    from jax_ep.gmm import grouped_matmul as gm

    x = jax.ShapeDtypeStruct((32768, 7168), jnp.bfloat16)
    w = jax.ShapeDtypeStruct((groups, 7168, 2048), jnp.bfloat16)
    plan = gm.plan_for(x.shape, w.shape, x.dtype, w.dtype)
    fns = bench.gmm_fns(plan, x, w)
    timed = set(fns) | set(bench.padded_fns(192)) | set(bench.padded_fns(192, "_step16"))
    assert {"dw_pipelined", "dw_specialized", "fwd_beyond", "dx_beyond", "dw_beyond"} <= timed
    assert timed <= set(bench.OPS), timed - set(bench.OPS)
    dy = jax.ShapeDtypeStruct((32768, 2048), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((groups,), jnp.int32)
    operands = {"fwd": (x, w, sizes), "dx": (dy, w, sizes), "dw": (x, dy, sizes)}
    for name, fn in fns.items():  # each traces (on CPU too: the kernels' branch is traced, not run)
        fn.trace(*operands[name.split("_")[0]])


@pytest.mark.parametrize("groups", [32, 256])
def test_grouped_matmul_bench_group_sizes_reach_their_skews(groups, capsys):
    """Every kind of group sizes sums to M; max:R puts R times the mean in the largest group, outsized one group of
    2 M/G + 6 rows; a bad name fails; the skew table prints a line per kind with its largest group over the mean."""
    import numpy as np

    from bench import grouped_matmul as bench

    m = 32768
    for kind in bench.KINDS + bench.SKEWS:
        sizes = bench.group_sizes(kind, m, groups)
        assert sizes.shape == (groups,) and sizes.dtype == np.int32 and sizes.min() >= 0, kind
        assert sizes.sum() == m, kind
        np.testing.assert_array_equal(sizes, bench.group_sizes(kind, m, groups), err_msg=kind)
    for ratio in (2, 4, 10):
        summary = bench.sizes_summary(bench.group_sizes(f"max:{ratio}", m, groups))
        assert abs(summary["max"] - ratio * m / groups) <= 1, summary
    outsized = bench.group_sizes("outsized", m, groups)
    assert outsized[0] == 2 * m // groups + 6 and outsized[1:].max() <= m // groups
    assert bench.sizes_summary(bench.group_sizes("dirichlet:4", m, groups))["max_over_mean"] > 1.5
    with pytest.raises(ValueError, match="unknown group sizes"):
        bench.group_sizes("lopsided", m, groups)
    with pytest.raises(ValueError, match="1 <= R <= G"):
        bench.group_sizes(f"max:{groups + 1}", m, groups)

    kinds = ("random", "max:4")
    row = {"M": m, "K": 64, "N": 32, "G": groups, "fwd_over_tokamax": {"max:4": 1.25}}
    row["sizes"] = {kind: bench.sizes_summary(bench.group_sizes(kind, m, groups)) for kind in kinds}
    row["ratio_vs_einsum"] = {f"gmm_{op}_{kind}": 0.5 for op in ("fwd", "dx", "dw") for kind in kinds}
    bench.print_skews([row])
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 + len(kinds), lines
    assert lines[-1].split()[-9:] == ["4.00", "0.50", "0.50", "0.50", "-", "-", "-", "-", "1.25"], lines[-1]


def test_moe_layer_bench_skews_the_router_to_its_target():
    """bench/skewed_routing.py (the layer bench's and profile's skews): the shift that bisection finds gives the
    router's busiest expert at least the target load and not much more; target 1 keeps the tokens."""
    import jax
    import jax.numpy as jnp

    from bench import skewed_routing as bench

    x = jax.random.normal(jax.random.key(0), (512, 64)).astype(jnp.bfloat16)
    w_router = jax.random.normal(jax.random.key(1), (64, 16)) / 8
    same, routing = bench.skewed_tokens(x, w_router, 2, 1.0)
    assert same is x and routing["shift"] == 0
    for target in (2.0, 5.0):
        shifted, routing = bench.skewed_tokens(x, w_router, 2, target)
        assert shifted.shape == x.shape and shifted.dtype == x.dtype and routing["shift"] > 0
        assert target <= routing["max_over_mean"] <= 1.1 * target, routing
        assert routing == {"shift": routing["shift"], **bench.load(shifted, w_router, 2)}
    with pytest.raises(ValueError, match="at most E/K"):  # 16 experts, top-2: one expert gets 8 times the mean
        bench.skewed_tokens(x, w_router, 2, 8.5)


@pytest.mark.slow
def test_grouped_matmul_bench_checks_its_skews_before_it_needs_a_gpu(tmp_path):
    """bench/grouped_matmul.py's defaults pass its check of the skews against the shapes, and a skew a shape cannot
    have (max:10 of 8 groups) fails there, before anything is timed (on CPU: before it asks for a Hopper GPU)."""
    command = [sys.executable, "-m", "bench.grouped_matmul", str(tmp_path / "gm.json")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    default = subprocess.run(command, cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert default.returncode != 0 and "needs a Hopper GPU" in default.stderr, default.stderr[-2000:]
    small = subprocess.run(
        command + ["--shapes", "64,64,64,8"], cwd=ROOT, env=env, timeout=300, capture_output=True, text=True
    )
    assert "max:R needs 1 <= R <= G=8" in small.stderr and "Hopper" not in small.stderr, small.stderr[-2000:]


@pytest.mark.slow
def test_moe_layer_bench_cpu_dry_run_times_every_row_at_every_skew(tmp_path):
    """The layer bench end to end on CPU (backend xla, small shapes): a row per skew, each with the layer, its
    ablations, the dense floor and the recipe with jax_ep's grouped matmul, and the layer against its time at the
    first skew; a skew above E/K is listed as skipped."""
    out = tmp_path / "layer.json"
    command = [sys.executable, "-m", "bench.moe_layer_baselines", str(out), "--experts", "8", "--skews", "1", "3", "5"]
    command += ["--tokens", "256", "--hidden", "128", "--intermediate", "64", "--topk", "2", "--iters", "1"]
    command += ["--ablate"]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    subprocess.run(command, cwd=ROOT, env=env, check=True, timeout=300, capture_output=True)
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [(r["experts"], r["skew"]) for r in rows] == [(8, 1.0), (8, 3.0)]
    assert result["skipped"] == [{"experts": 8, "skew": 5.0, "why": "above E/K = 4"}]
    for row in rows:
        ablations = {"moe_per_op", "moe_one_size", "moe_no_beyond", "moe_past_per_op", "moe_beyond_64"}
        assert {"moe", "dense", "sort_jax_ep", *ablations} <= set(row["ms"])
        assert min(row["ms"].values()) > 0
    assert rows[0]["moe_over_first_skew"] == 1.0 and rows[1]["routing"]["max_over_mean"] >= 3.0


@pytest.mark.slow
@pytest.mark.parametrize("skews", [["3"], ["1", "3"]], ids=["one_skew", "two_skews"])
def test_moe_layer_profile_cpu_dry_run_skews_the_routing(tmp_path, skews):
    """The layer profile on CPU (backend xla, small shapes) with --skew 3: the busiest expert gets three times the
    mean load, recorded beside the step's kernel time by scope, the experts' among it. With two skews, one compile
    serves both, each skew is a record of "runs", and a table of both ends the output."""
    out = tmp_path / "profile.json"
    command = [sys.executable, "-m", "bench.moe_layer_profile", str(out), "--tokens", "256", "--hidden", "128"]
    command += ["--intermediate", "64", "--experts", "8", "--topk", "2", "--shared", "0", "--backend", "xla"]
    command += ["--steps", "1", "--skew", *skews]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run(command, cwd=ROOT, env=env, timeout=300, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(out.read_text())
    runs = result["runs"] if len(skews) > 1 else [result]
    assert [run["skew"] for run in runs] == [float(s) for s in skews]
    for run in runs:
        assert abs(run["routing"]["max_over_mean"] - run["skew"]) < 0.1 or run["skew"] == 1.0
        assert run["kernel_us_per_step"]["by_scope"]["experts"] > 0
    assert runs[-1]["routing"]["shift"] > 0
    assert done.stdout.count("] compiled\n") == 1
    table = done.stdout.strip().splitlines()[-len(skews) - 1 :]
    assert table[0].startswith("skew | max/mean | step | kernels") and [row.split(" | ")[0] for row in table[1:]] == [
        f"{float(s):g}" for s in skews
    ]


def test_run_session_returns_the_exit_code_and_kills_the_whole_session_on_timeout(tmp_path):
    """bench/multiprocess.py's run_session: the exit code and both outputs; past its timeout, None, and no process
    of the session lives on (a child of the command, as Python is of compute-sanitizer, included)."""
    from bench.multiprocess import run_session

    assert run_session(["bash", "-c", "echo out; echo err >&2; exit 3"], 30, os.environ) == (3, "out\n", "err\n")
    marker = tmp_path / "outlived"
    status, stdout, _ = run_session(
        ["bash", "-c", f"echo started; (sleep 3; touch {marker}) & sleep 60"], 1, os.environ
    )
    assert (status, stdout) == (None, "started\n")
    time.sleep(4)
    assert not marker.exists()


def test_run_session_kills_the_session_when_interrupted(tmp_path, monkeypatch):
    """run_session, its wait interrupted (KeyboardInterrupt): the whole session dies, a child of the command too."""
    from bench.multiprocess import run_session

    marker = tmp_path / "outlived"
    communicate = subprocess.Popen.communicate

    def interrupted(self, input=None, timeout=None):  # the wait is interrupted; the read after a kill is not
        if timeout is not None:
            time.sleep(1)  # the command has started its child
            raise KeyboardInterrupt
        return communicate(self, input)

    monkeypatch.setattr(subprocess.Popen, "communicate", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_session(["bash", "-c", f"(sleep 3; touch {marker}) & sleep 60"], 30, os.environ)
    monkeypatch.undo()
    time.sleep(4)
    assert not marker.exists()


def test_run_workers_leaves_no_worker_running_when_interrupted(tmp_path, monkeypatch):
    """bench/multiprocess.py's run_workers: the exit codes; past its timeout, None; and when the wait is interrupted
    (KeyboardInterrupt, as from a time limit around pytest), no worker lives on to hold the GPU."""
    from bench import multiprocess

    logs = [tmp_path / f"{i}.log" for i in range(2)]
    assert multiprocess.run_workers(lambda port, i: ["bash", "-c", f"exit {i + 2}"], 2, 30, logs=logs) == [2, 3]
    assert multiprocess.run_workers(lambda port, i: ["sleep", "60"], 2, 1, logs=logs) is None

    started = []
    popen, wait = subprocess.Popen, subprocess.Popen.wait

    def recorded(*args, **kwargs):
        started.append(popen(*args, **kwargs))
        return started[-1]

    def interrupted(self, timeout=None):  # the wait for the workers is interrupted; a wait after a kill is not
        if timeout is not None:
            raise KeyboardInterrupt
        return wait(self)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    monkeypatch.setattr(subprocess, "Popen", recorded)
    with pytest.raises(KeyboardInterrupt):
        multiprocess.run_workers(lambda port, i: ["sleep", "60"], 2, 30, logs=logs)
    monkeypatch.undo()
    assert len(started) == 2
    for worker in started:
        assert worker.wait(timeout=10) == -signal.SIGKILL


def _suite_plan(gpus: int, **env: str) -> subprocess.CompletedProcess:
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SUITE_")},
        "SUITE_GPUS": str(gpus),
        **env,
    }
    return subprocess.run(["bash", "bench/device_run.sh", "plan"], cwd=ROOT, env=env, capture_output=True, text=True)


def _planned_steps(plan: str) -> dict[str, str]:
    """Step name -> "runs", "cut", "no time" (its status when every step takes its limit) or the SKIP reason."""
    steps = {}
    for line in plan.splitlines():
        name = line.split()[0] if line.strip() else ""
        if not re.fullmatch(r"[a-z0-9_]+", name) or name in ("step", "plan", "ends"):
            continue
        if "SKIP:" in line:
            steps[name] = line.split("SKIP:", 1)[1].strip()
        else:
            steps[name] = "no time" if line.endswith("no time") else line.split()[-1]
    return steps


def test_the_suite_gives_its_build_a_floor_and_a_cap():
    """The build's limit is what the deadline leaves after the steps' reserves, but never below SUITE_BUILD_MIN_S
    (a deadline that left it 25 s stopped a fresh machine's build at that limit) and never above SUITE_BUILD_S."""

    def build_limit(**env: str) -> int:
        done = _suite_plan(1, **env)
        assert done.returncode == 0, done.stderr
        return int(re.search(r"^build: limit (\d+) s$", done.stdout, re.M).group(1))

    tight = dict(SUITE_ONLY="tests tests_backend", SUITE_DEADLINE_S="225")
    assert build_limit(**tight) == 90
    assert build_limit(**tight, SUITE_BUILD_MIN_S="30") == 30
    assert build_limit(**tight, SUITE_BUILD_MIN_S="0") == 25  # 225 - 120 - 60 reserved - 10 report - 10 grace
    assert build_limit() == 130  # 540 - 390 reserved (part 1) - 10 report - 10 grace
    assert build_limit(SUITE_DEADLINE_S="900") == 240
    assert build_limit(SUITE_BUILD_S="60") == 60


def test_the_one_gpu_suite_runs_every_step_in_one_of_two_calls():
    """On one GPU the suite's steps do not fit one call: SUITE_PART 1 and 2 each plan half of them within the
    deadline, and every step that one GPU can run is in exactly one part. tests_gpu gets its whole nominal limit,
    which covers its expected time (its whole_gpu tests run last)."""
    parts, plans = [], []
    for part in ("1", "2"):
        done = _suite_plan(1, SUITE_PART=part)
        assert done.returncode == 0, done.stderr
        parts.append(_planned_steps(done.stdout))
        plans.append(done.stdout)
    assert parts[0].keys() == parts[1].keys() and "tests" in parts[0] and "fuzz_shared8" in parts[1]
    assert parts[1]["tests_gpu"] == "runs"  # the GPU tests outside tests/test_cuda_*.py
    nominal, expected, limit = re.search(r"^tests_gpu +(\d+) +\d+ +(\d+) \| +\d+ +(\d+)", plans[1], re.M).groups()
    assert int(limit) == int(nominal) >= int(expected)
    for name in parts[0]:
        planned = [steps[name] for steps in parts if steps[name] in ("runs", "cut")]
        if "needs" in parts[0][name]:  # a step of 2+ GPUs: skipped in both, saying why
            assert not planned and "needs" in parts[1][name], name
        else:
            assert len(planned) == 1, (name, parts[0][name], parts[1][name])
    assert not any(status == "no time" for steps in parts for status in steps.values())
    assert _suite_plan(1).stdout == _suite_plan(1, SUITE_PART="1").stdout  # part 1 by default
    wrong = _suite_plan(1, SUITE_PART="3")
    assert wrong.returncode == 2 and "SUITE_PART must be 1 or 2" in wrong.stderr
    two = _suite_plan(2).stdout  # two GPUs: one call, no part
    assert "other part" not in two and _planned_steps(two)["tests"] == "runs"
    assert "left to the one-GPU suite" in _planned_steps(two)["tests_gpu"]
