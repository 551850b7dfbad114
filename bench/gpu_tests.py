"""Run GPU test files and record each test's outcome as JSON with its provenance.

python -m bench.gpu_tests OUT.json [--shards N] tests/test_cuda_backend.py [more pytest args]

OUT.json is rewritten after every test with ``"complete": false``, so a run cut short by a time limit still
leaves the outcomes so far; once pytest returns it says ``"complete": true`` and pytest's exit code
(``"interrupted": true`` when pytest stopped on SIGINT, e.g. from ``timeout -s INT``). It runs every tier of the
files it is given (``-m ""``, before the args: a ``-m`` among them still chooses), the slow and multi-process tests too.

``--shards N`` (N > 1) runs the tests in three phases of pytest processes on the same GPU (each without XLA's
memory preallocation), their time mostly XLA compiling on the host's cores:
1. N shards at once: test ``i`` of the other tests goes to shard ``i % N``;
2. once they end, N serial processes at once: the tests that wait for peers on timers (marked ``multiprocess``, or
   in :data:`SERIAL_FILES`), test ``i`` of them to process ``i % N``, so no two of one process overlap;
3. then one process for the tests that measure or need the whole GPU (:data:`ALONE_FILES`: its memory, XLA's
   overlap, free SMs; and tests marked ``whole_gpu``, whose memory would not fit beside the shards).
Each process writes ``OUT.json`` with the suffix ``.shard<i>``, ``.serial<i>`` or ``.alone``; the parent merges
them into OUT.json (each case says its ``phase``) while they run and once they end, passes SIGINT on to them, and
at the end keeps OUT.json and the parts' pytest output in OUT.json.log only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KINDS = ("passed", "failure", "error", "skipped")
# Tests that wait for peers on timers: a --shards run gives them processes of their own, after the shards.
SERIAL_FILES = ("test_cuda_finalize.py",)
# Tests that measure or need the whole GPU (nvidia-smi's memory in use, XLA's overlap of a collective, SMs left
# free beside a stand-in collective): run last, alone.
ALONE_FILES = ("test_cuda_concurrency.py", "test_cuda_coresidency.py", "test_cuda_reliability.py")
_PART = "JAX_EP_GPU_TESTS_PART"  # a child's part of a --shards run: "shard <i>/<N>", "serial <i>/<N>" or "alone"


def _phase(item) -> str:
    if item.path.name in ALONE_FILES or item.get_closest_marker("whole_gpu") is not None:
        return "alone"
    if item.get_closest_marker("multiprocess") is not None or item.path.name in SERIAL_FILES:
        return "serial"
    return "shard"


class Recorder:
    """A pytest plugin that rewrites OUT.json after every test."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = out, command
        self.cases: list[dict] = []
        self.info: dict | None = None
        self.interrupted = False

    def pytest_collection_modifyitems(self, config, items) -> None:
        part = os.environ.get(_PART)
        if not part:
            return
        phase, _, share = part.partition(" ")
        kept = [item for item in items if _phase(item) == phase]
        if share:
            index, count = (int(v) for v in share.split("/"))
            kept = kept[index::count]
        config.hook.pytest_deselected(items=[item for item in items if item not in kept])
        items[:] = kept

    def pytest_runtest_logreport(self, report) -> None:
        if report.when != "call" and report.outcome == "passed":
            return  # a setup or teardown that passed: the call's report tells
        if report.outcome in ("passed", "skipped"):
            outcome = report.outcome
        else:  # as in JUnit XML: a failing test is a failure, a failing setup or teardown an error
            outcome = "failure" if report.when == "call" else "error"
        case = {"test": report.nodeid, "outcome": outcome, "seconds": round(float(report.duration), 3)}
        if report.when != "call":
            case["phase"] = report.when
        if report.failed:
            case["message"] = report.longreprtext[-800:]
        self.cases.append(case)
        self.save(complete=False)

    def pytest_collectreport(self, report) -> None:
        if report.failed:  # a test file that does not import: none of its tests runs
            case = {"test": report.nodeid, "outcome": "error", "seconds": 0.0, "phase": "collect"}
            self.cases.append({**case, "message": report.longreprtext[-800:]})
            self.save(complete=False)

    def pytest_keyboard_interrupt(self, excinfo) -> None:
        self.interrupted = excinfo.type is KeyboardInterrupt  # not pytest's own stop after collection errors

    def summary(self) -> dict:
        return {kind: sum(case["outcome"] == kind for case in self.cases) for kind in KINDS}

    def save(self, *, complete: bool, status: int | None = None) -> None:
        if self.info is None:  # first called after collection: the tests' conftest has set jax up
            from bench.record import provenance

            self.info = provenance(self.command)
        payload = {**self.info, "complete": complete, "pytest_exit": status, "summary": self.summary()}
        if self.interrupted:
            payload["interrupted"] = True
        payload["tests"] = self.cases
        self.out.parent.mkdir(parents=True, exist_ok=True)
        partial = self.out.with_name(self.out.name + ".partial")
        partial.write_text(json.dumps(payload, indent=2) + "\n")
        os.replace(partial, self.out)  # a reader never sees half a file


def merge(out: Path, parts: list[Path], command: str, interrupted: bool = False) -> dict:
    """The parts' results as one, written to ``out``: every case with its part as ``phase``, summed summaries, the
    worst pytest exit code (5, no test collected, only when no part collected one), complete when every part is."""
    results = [(path, json.loads(path.read_text())) for path in parts if path.exists()]
    cases = [{**case, "phase": path.suffix[1:]} for path, result in results for case in result["tests"]]
    statuses = [result["pytest_exit"] for _, result in results]
    merged = {**(results[0][1] if results else {}), "command": command, "parts": [path.suffix[1:] for path in parts]}
    merged["complete"] = len(results) == len(parts) and all(result["complete"] for _, result in results)
    ran = [s for s in statuses if s is not None and s != pytest.ExitCode.NO_TESTS_COLLECTED]
    merged["pytest_exit"] = max(ran) if ran else max((s for s in statuses if s is not None), default=None)
    merged["summary"] = {kind: sum(case["outcome"] == kind for case in cases) for kind in KINDS}
    merged.pop("interrupted", None)
    if interrupted or any(result.get("interrupted") for _, result in results):
        merged["interrupted"] = True
    merged["tests"] = cases
    partial = out.with_name(out.name + ".partial")
    partial.write_text(json.dumps(merged, indent=2) + "\n")
    os.replace(partial, out)
    return merged


def run_sharded(out: Path, shards: int, args: list[str], command: str) -> int:
    """The tests of ``args`` in the three phases of the module's docstring; merged into ``out``."""
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "JAX_EP_COMMAND": command}
    phases = [
        [(out.with_name(f"{out.name}.{kind}{i}"), f"{kind} {i}/{shards}") for i in range(shards)]
        for kind in ("shard", "serial")
    ]
    phases.append([(out.with_name(f"{out.name}.alone"), "alone")])
    paths = [path for phase in phases for path, _ in phase]
    for path in paths:
        path.unlink(missing_ok=True)
    interrupted = False
    for phase in phases:
        children = []
        for path, part in phase:
            with open(path.with_name(path.name + ".log"), "w") as log:
                child = [sys.executable, "-m", "bench.gpu_tests", str(path), *args]
                children.append(subprocess.Popen(child, env={**env, _PART: part}, stdout=log, stderr=subprocess.STDOUT))
        try:
            while any(child.poll() is None for child in children):
                time.sleep(5)
                merge(out, paths, command)
        except KeyboardInterrupt:
            interrupted = True
            for child in children:
                child.send_signal(signal.SIGINT)
            for child in children:
                try:
                    child.wait(timeout=8)  # within `timeout -k 10`, which kills this process
                except subprocess.TimeoutExpired:
                    child.kill()
            break
    merged = merge(out, paths, command, interrupted)
    with open(out.with_name(out.name + ".log"), "w") as log:  # the parts' pytest output, one file
        for path in paths:
            part_log = path.with_name(path.name + ".log")
            if part_log.exists():
                log.write(f"===== {path.suffix[1:]} =====\n{part_log.read_text()}")
                part_log.unlink()
            path.unlink(missing_ok=True)
    print(f"wrote {out} and {out.name}.log")
    print(merged["summary"])
    return 2 if interrupted else (merged["pytest_exit"] or 0)


def main() -> int:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    command = "python -m bench.gpu_tests " + " ".join(sys.argv[1:])
    if args[:1] == ["--shards"]:
        shards, args = int(args[1]), args[2:]
        if shards > 1:
            return run_sharded(out, shards, args, command)
    recorder = Recorder(out, command)
    status = int(pytest.main(["-m", "", *args, "-v"], plugins=[recorder]))
    recorder.save(complete=True, status=status)
    print(f"wrote {out}")
    print(recorder.summary())
    return status


if __name__ == "__main__":
    sys.exit(main())
