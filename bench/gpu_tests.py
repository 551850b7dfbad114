"""Run GPU test files and record each test's outcome as JSON with its provenance.

python -m bench.gpu_tests OUT.json tests/test_cuda_backend.py [more pytest args]

OUT.json is rewritten after every test with ``"complete": false``, so a run cut short by a time limit still
leaves the outcomes so far; once pytest returns it says ``"complete": true`` and pytest's exit code
(``"interrupted": true`` when pytest stopped on SIGINT, e.g. from ``timeout -s INT``). It runs every tier of the
files it is given (``-m ""``, before the args: a ``-m`` among them still chooses), the slow and multi-process tests too.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

KINDS = ("passed", "failure", "error", "skipped")


class Recorder:
    """A pytest plugin that rewrites OUT.json after every test."""

    def __init__(self, out: Path, command: str):
        self.out, self.command = out, command
        self.cases: list[dict] = []
        self.info: dict | None = None
        self.interrupted = False

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


def main() -> int:
    out, args = Path(sys.argv[1]), sys.argv[2:]
    recorder = Recorder(out, "python " + " ".join(sys.argv))
    status = int(pytest.main(["-m", "", *args, "-v"], plugins=[recorder]))
    recorder.save(complete=True, status=status)
    print(f"wrote {out}")
    print(recorder.summary())
    return status


if __name__ == "__main__":
    sys.exit(main())
