"""compute-sanitizer over the cuda backend's kernels, on one GPU (an EP group of one GPU).

    python -m bench.sanitize OUT.json [--tools memcheck,racecheck,synccheck,initcheck] [--timeout 120]
    python -m bench.sanitize probe    # what each tool runs: every op and gradient on a few shapes

The probe runs jitted dispatch -> combine and its gradients (which call all four kernels: routing, dispatch,
combine, combine's backward), whole and through the split ops (each kernel's send and receive launches apart, and
the combine of dispatch_start's backward pass, which stages this rank's own sums), for both layouts, float32 and
bfloat16, H aligned (256) and not (1001), with alignment padding, drops (a small capacity), invalid ids and -1
slots, then checks each result against backend "xla" so that a sanitizer run which changed the results fails too.
memcheck, racecheck and synccheck check only kernels whose name holds ``jax_ep`` (``--kernel-name kns=jax_ep``):
XLA's own kernels are not ours to fix, and checking them takes most of the time. initcheck checks every kernel: it
sees only the writes of the kernels it instruments, so with the filter every value an XLA kernel wrote (say ``y`` of
a combine) reads as uninitialized (55,042 such reports in one filtered run at ``1b7a7c3``). OUT.json records, per
tool: the command, its exit status, the sanitizer's error summary, each kind of report it printed (its first line
and device function, how many, the first one's location and host frames) and the tail of its output.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.multiprocess import run_session

TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
CASES = [  # layout, dtype, hidden, capacity, alignment
    ("ragged", "float32", 256, None, 4),
    ("ragged", "bfloat16", 1001, 40, 1),
    ("expert", "bfloat16", 256, 12, 1),
    ("expert", "float32", 1001, None, 1),
]


def probe() -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jax_ep

    tokens, topk, experts = 64, 4, 16
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("gpu")[:1])
    jax_ep.initialize(mesh, "ep", num_tokens=tokens, hidden=1001, topk=topk, num_experts=experts, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    idx = rng.integers(0, experts, (tokens, topk)).astype(np.int32)
    idx[rng.random(idx.shape) < 0.1] = -1
    idx[rng.random(idx.shape) < 0.05] = experts + 3
    weights = jnp.asarray(rng.random((tokens, topk)).astype(np.float32) + 0.1)
    for layout, dtype, hidden, capacity, alignment in CASES:
        x = jnp.asarray(rng.standard_normal((tokens, hidden)).astype(np.float32) + 0.5, dtype)

        def step(x, w, backend, split, layout=layout, capacity=capacity, alignment=alignment):
            def body(x, idx, w):
                kw = dict(layout=layout, capacity=capacity, expert_alignment=alignment, backend=backend)
                kw.update(num_experts=experts, axis_name="ep")
                if not split:
                    d = jax_ep.dispatch(x, idx, w, **kw)
                    return jax_ep.combine(jnp.tanh(d.x) * 1.5, d.handle, weights=d.weights)
                d = jax_ep.dispatch_finish(jax_ep.dispatch_start(x, idx, w, **kw))
                return jax_ep.combine_finish(jax_ep.combine_start(jnp.tanh(d.x) * 1.5, d.handle, weights=d.weights))

            out = jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep"))(x, jnp.asarray(idx), w)
            return jnp.sum(jnp.sin(out.astype(jnp.float32)))

        run = jax.jit(jax.value_and_grad(step, argnums=(0, 1)), static_argnums=(2, 3))
        with jax.set_mesh(mesh):
            want = run(x, weights, "xla", False)
            for split in (False, True):
                got = run(x, weights, "cuda", split)
                for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
                    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
                    tol = 1e-4 if dtype == "float32" else 3e-2
                    np.testing.assert_allclose(a, b, rtol=tol, atol=tol * max(1.0, float(np.abs(b).max())))
        print(f"probe {layout} {dtype} H={hidden} capacity={capacity}: cuda matches xla, whole and split", flush=True)
    jax_ep.finalize()
    print("probe done", flush=True)


def reports(output: str, most: int = 20) -> list[dict]:
    """compute-sanitizer's reports, by their first line and the function of their first "at ..." line: how many
    of each, and for the first one that line and its first host frames (where a host API call came from), so
    that a run cut short still says what it found and where."""
    found: dict[tuple, dict] = {}
    report: list[str] = []  # the report being read: its first line, then its indented lines

    def close() -> None:
        if not report:
            return
        at = next((line[3:][:200] for line in report[1:] if line.startswith("at ")), None)
        where = None if at is None else re.sub(r"\+0x[0-9a-f]+.*$", "", at)
        frames = [line.split("Host Frame:", 1)[1].strip()[:120] for line in report if "Host Frame:" in line][:12]
        entry = dict(report=report[0], where=where, count=0, first_at=at, first_host_frames=frames)
        found.setdefault((report[0], where), entry)["count"] += 1
        report.clear()

    for line in output.splitlines():
        if not line.startswith("========= "):
            continue
        text = line[len("========= ") :]
        if text and not text[0].isspace():
            close()
            if not text.startswith(("COMPUTE-SANITIZER", "ERROR SUMMARY", "LEAK SUMMARY", "RACECHECK SUMMARY")):
                report.append(re.sub(r"0x[0-9a-f]+", "0x…", text.strip())[:200])
        elif report:
            report.append(text.strip())
    close()
    return sorted(found.values(), key=lambda r: -r["count"])[:most]


def run_tool(tool: str, timeout: float) -> dict:
    only_ours = [] if tool == "initcheck" else ["--kernel-name", "kns=jax_ep"]
    command = ["compute-sanitizer", "--tool", tool, *only_ours, "--print-limit", "1000000", "--error-exitcode", "17"]
    command += [sys.executable, "-m", "bench.sanitize", "probe"]
    start = time.time()
    status, stdout, stderr = run_session(command, timeout, os.environ)
    output = stdout + stderr
    # "ERROR SUMMARY: 0 errors" (memcheck, synccheck, initcheck); "SUMMARY: 0 hazards displayed (0 errors," (racecheck)
    summary = re.findall(r"SUMMARY:.*?(\d+) errors?", output)
    lines = [line for line in output.splitlines() if "@ 0x" not in line]
    return {
        "command": " ".join(command[:-3] + ["python", "bench/sanitize.py", "probe"]),
        "exit_status": status,
        "timed_out": status is None,
        "seconds": round(time.time() - start, 1),
        "errors": int(summary[-1]) if summary else None,
        "probe_finished": "probe done" in output,
        "reports": reports(output),
        "output_tail": "\n".join(lines[-25:]),
    }


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "probe":
        probe()
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out")
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    results = {
        "command": "python -m bench.sanitize OUT.json --tools " + args.tools,
        "commit": os.environ.get("JAX_EP_COMMIT", "unknown"),
        "cases": [dict(zip(("layout", "dtype", "hidden", "capacity", "alignment"), c, strict=True)) for c in CASES],
        "tools": {},
    }
    query = ["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"]
    try:  # not through jax: this process must leave the GPU's memory to the probes
        results["devices"] = subprocess.run(query, capture_output=True, text=True, timeout=30).stdout.splitlines()
    except (OSError, subprocess.TimeoutExpired) as err:
        results["devices"] = [f"unknown ({err})"]
    for tool in args.tools.split(","):
        results["tools"][tool] = run_tool(tool, args.timeout)
        Path(args.out).write_text(json.dumps(results, indent=1))
    for tool, r in results["tools"].items():
        clean = r["errors"] == 0 and r["exit_status"] == 0 and r["probe_finished"]
        verdict = "clean" if clean else "NOT clean"
        print(f"{tool:10s} errors {r['errors']}  exit {r['exit_status']}  {r['seconds']:6.1f} s  {verdict}")
        for report in r["reports"]:
            print(f"    {report['count']:5d} x {report['report']}  (in {report['where'] or 'no device function'})")


if __name__ == "__main__":
    main()
