"""The bookkeeping of bench/device_run.sh's multi-GPU suite: each step's PASS/FAIL/SKIP, then suite.json and a table.

    python -m bench.suite_report step STEPS.jsonl NAME RC SECONDS LIMIT LOG [--json RESULT] [--skip REASON]
    python -m bench.suite_report finish STEPS.jsonl OUT/suite.json --gpus N --command CMD [--deadline S]

``step`` judges one step from its exit code (``timeout``'s 124 and 137: stopped at its limit; 77: skipped, the
reason on the log's last ``SKIP:`` line), its log and its result file where it wrote one (bench/gpu_tests.py's
outcomes, a tools/fuzz.py report, a bench/exchange.py result), appends the verdict to STEPS.jsonl as one JSON line and
prints it (``PASS name (12 s of 60): reason``). A test step whose every test skipped is a SKIP with pytest's reason;
one stopped at its limit is a FAIL that says how far it got. ``--skip`` records a step the suite did not start.

``finish`` writes suite.json: each step (name, status, seconds, limit, reason, log, result file), the GPU count the
suite planned for, the devices nvidia-smi lists, the commit (JAX_EP_COMMIT, else git's HEAD, marked so), the hash of
the library's sources (bench/record.py's source_hash, which imports no jax), the command and the wall
time; then prints the table last. Its exit status is 1 when a step failed. Standard library only, so it reports
even where jax or the build is broken.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOISE = re.compile(r"^\s*(@ 0x|$)|cuda_executor|Source Location|external/xla")


def _tail(log: Path, lines: int = 1) -> str:
    """The log's last meaningful lines, joined by ' | '."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    kept = [line.strip() for line in text if not NOISE.search(line)]
    return " | ".join(kept[-lines:])[-300:]


def _load(path: Path | None) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


def _skip_reasons(log: Path) -> list[str]:
    """pytest's -ra summary lines 'SKIPPED [n] file:line: reason', as 'reason (n tests)', the same reasons merged."""
    try:
        text = log.read_text(errors="replace")
    except OSError:
        return []
    counts: dict[str, int] = {}
    for m in re.finditer(r"^SKIPPED \[(\d+)\] [^:]+:\d+: (.*)$", text, re.M):
        counts[m.group(2).strip()] = counts.get(m.group(2).strip(), 0) + int(m.group(1))
    return [f"{reason} ({n} tests)" for reason, n in counts.items()]


def judge(rc: int, limit: int, log: Path, result: dict | None) -> tuple[str, str]:
    """(status, reason) of a step that ran."""
    stopped = rc in (124, 137)
    if result is not None and "summary" in result and "tests" in result:  # bench/gpu_tests.py
        s = result["summary"]
        counts = f"{s['passed']} passed, {s['failure'] + s['error']} failed, {s['skipped']} skipped"
        bad = [c["test"].split("/")[-1] for c in result["tests"] if c["outcome"] in ("failure", "error")]
        if stopped:
            return "FAIL", f"stopped at its limit of {limit} s after {counts}" + (f"; failed: {bad[:3]}" if bad else "")
        if bad:
            return "FAIL", f"{counts}; failed: {', '.join(bad[:4])}" + (" ..." if len(bad) > 4 else "")
        if rc not in (0, 5):
            return "FAIL", f"pytest exit {rc} ({counts}): {_tail(log)}"
        if s["passed"] == 0:
            reasons = _skip_reasons(log)
            return "SKIP", ("; ".join(reasons[:3]) if reasons else "no test ran") + f" [{counts}]"
        return "PASS", counts
    if stopped:
        return "FAIL", f"stopped at its limit of {limit} s (a hang, or too slow); last output: {_tail(log)}"
    if rc == 77:
        try:
            lines = log.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        said = [line.split("SKIP:", 1)[1].strip() for line in lines if "SKIP:" in line]
        return "SKIP", said[-1] if said else "exit 77"
    if result is not None and "mismatching_cases" in result:  # tools/fuzz.py
        cases, bad = result.get("cases", 0), result["mismatching_cases"]
        wall = result.get("time", {}).get("wall_s")
        summary = f"{cases} cases, {bad} mismatching ({wall} s of cases)"
        if rc != 0 or bad:
            seeds = [m["seed"] for m in result.get("mismatches", [])][:3]
            return "FAIL", summary + (
                f"; replay: python -m tools.fuzz --replay {seeds[0]} (seeds {seeds})" if seeds else ""
            )
        return ("PASS", summary) if cases else ("FAIL", "no case ran (no time after starting?)")
    if rc != 0:
        return "FAIL", f"exit {rc}: {_tail(log, 2)}"
    if result is not None and "training" in result:  # python -m bench.exchange
        t = result["training"]
        cells = [f"peer copy {t['peer_copy_us']:.0f} us" if t.get("peer_copy_us") else "no peer copy (one GPU)"]
        for backend in ("cuda", "xla"):
            if backend in t:
                cells.append(
                    f"{backend} dispatch {t[backend]['dispatch_us']:.0f} + combine {t[backend]['combine_us']:.0f} us"
                )
        return "PASS", f"{result.get('ranks')} ranks, T={t['tokens']} H={t['hidden']}: " + ", ".join(cells)
    if result is not None and result and all(isinstance(v, dict) for v in result.values()):  # a ragged child's
        cells = [
            f"T={k}: {v.get('roundtrip_us', 0):.0f} us round trip, correct={v.get('correct')}"
            for k, v in result.items()
        ]
        wrong = any(v.get("correct") is False for v in result.values())
        return ("FAIL" if wrong else "PASS"), "; ".join(cells)[:300]
    return "PASS", _tail(log)


def step(args: argparse.Namespace) -> int:
    log, result_path = Path(args.log), Path(args.json) if args.json else None
    if args.skip is not None:
        status, reason = "SKIP", args.skip
    else:
        status, reason = judge(args.rc, args.limit, log, _load(result_path))
    out = Path(args.steps)
    base = out.parent.parent  # the steps file lies in OUT/logs/: paths in the record are relative to OUT
    record = {
        "name": args.name,
        "status": status,
        "seconds": args.seconds,
        "limit_s": args.limit,
        "exit": None if args.skip is not None else args.rc,
        "reason": reason,
        "log": os.path.relpath(log, base) if log.exists() else None,
        "result": os.path.relpath(result_path, base) if result_path and result_path.exists() else None,
    }
    with open(out, "a") as f:
        f.write(json.dumps(record) + "\n")
    took = "not started" if args.skip is not None else f"{args.seconds} s of {args.limit}"
    print(f"{status} {args.name} ({took})" + (f": {reason}" if reason else ""), flush=True)
    return 0


def _devices() -> list[str]:
    try:
        done = subprocess.run(
            ["nvidia-smi", "--query-gpu=index,name,pci.bus_id,driver_version,memory.total", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.SubprocessError):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def _commit() -> str:
    if os.environ.get("JAX_EP_COMMIT"):
        return os.environ["JAX_EP_COMMIT"]
    try:
        done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    except OSError:
        return "unknown"
    head = done.stdout.strip()
    return f"{head} (git HEAD; JAX_EP_COMMIT unset: a copied tree may differ)" if done.returncode == 0 else "unknown"


def _sources() -> str:
    """bench/record.py's source_hash of this checkout (bench.record imports neither jax nor jax_ep)."""
    try:
        from bench.record import source_hash

        return source_hash(ROOT) or "unknown"
    except Exception as error:  # noqa: BLE001  (a report must still come out)
        return f"unknown ({error})"


def finish(args: argparse.Namespace) -> int:
    steps = []
    if Path(args.steps).is_file():
        steps = [json.loads(line) for line in Path(args.steps).read_text().splitlines() if line.strip()]
    counts = {status: sum(s["status"] == status for s in steps) for status in ("PASS", "FAIL", "SKIP")}
    payload = {
        "suite": "bench/device_run.sh",
        "command": args.command,
        "commit": _commit(),
        "sources": _sources(),
        "gpu_count": args.gpus,
        "devices": _devices(),
        "host": socket.gethostname(),
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "wall_s": args.wall,
        "deadline_s": args.deadline,
        "counts": counts,
        "ok": counts["FAIL"] == 0,
        "logs": "logs.tar.gz holds logs/<step>.log and each step's result file (the paths below)",
        "steps": steps,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(payload, indent=1) + "\n")
    print(
        f"\nwrote {out}: {args.gpus} GPU(s) {payload['devices'][:1]}, commit {payload['commit']}, "
        f"{args.wall} s of {args.deadline}"
    )
    width = max([4, *(len(s["name"]) for s in steps)])
    print(f"{'step':<{width}}  status  seconds  limit  reason")
    for s in steps:
        reason = s["reason"] if len(s["reason"]) <= 110 else s["reason"][:107] + "..."
        print(f"{s['name']:<{width}}  {s['status']:<6}  {s['seconds']:>7}  {s['limit_s']:>5}  {reason}")
    print(f"{counts['PASS']} passed, {counts['FAIL']} failed, {counts['SKIP']} skipped")
    return 0 if payload["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="what", required=True)
    one = sub.add_parser("step", help="judge and record one step")
    one.add_argument("steps")
    one.add_argument("name")
    one.add_argument("rc", type=int)
    one.add_argument("seconds", type=int)
    one.add_argument("limit", type=int)
    one.add_argument("log")
    one.add_argument("--json", help="the step's result file")
    one.add_argument("--skip", help="the step was not started: why")
    end = sub.add_parser("finish", help="write suite.json and print the table")
    end.add_argument("steps")
    end.add_argument("out")
    end.add_argument("--gpus", type=int, required=True)
    end.add_argument("--command", default="bash bench/device_run.sh")
    end.add_argument("--wall", type=int, default=0)
    end.add_argument("--deadline", type=int, default=0)
    args = parser.parse_args(argv)
    return step(args) if args.what == "step" else finish(args)


if __name__ == "__main__":
    sys.exit(main())
