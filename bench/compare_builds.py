"""Time backend "cuda" of several builds of jax_ep in one run, each build in a fresh process, rounds interleaved.

    python -m bench.compare_builds OUT.json NAME=SITE [NAME=SITE ...] [--tokens 4096,8192] [--rounds 2] [--xla NAME]

SITE is a folder holding one build's jax_ep package with its extension (``pip install --target SITE SOURCE``).
Every build times the same shapes on the same GPUs (the first two: the EP group) with this checkout's benchmark
method (``time_backend`` of ``bench/timing.py``, through jax_ep's public API): dispatch and combine. Rounds run
the builds in turn (A B C A B C), so drift between rounds shows as the spread of one build's numbers; ``--xla NAME``
also times backend "xla" in NAME's first process. ``--platform cpu`` is a dry run: backend "xla" only, on up to two
CPU devices.
Each build's process runs in SITE with SITE and this checkout on PYTHONPATH, in that order: jax_ep comes from
SITE, bench/ from the checkout. A build installed with --target finds libnccl.so.2 only through LD_LIBRARY_PATH
(its rpath points into SITE); bench/device_run_one_gpu.sh sets it.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "compare_builds result: "


def child(site: str, tokens: list[int], hidden: int, backends: list[str], iters: int, platform: str) -> dict:
    """One build's timings, in this process (its jax_ep must come from ``site``)."""
    import jax

    import jax_ep

    if not Path(jax_ep.__file__).resolve().is_relative_to(Path(site).resolve()):
        raise SystemExit(f"jax_ep was imported from {jax_ep.__file__}, not from {site}")
    from bench.timing import EXPERTS, TOPK, make_inputs, time_backend

    devices = jax.devices(platform)[:2]
    ranks = len(devices)
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    if "cuda" in backends:
        jax_ep.initialize(mesh, "ep", num_tokens=max(tokens), hidden=hidden, topk=TOPK, num_experts=EXPERTS)
    out = {"ranks": ranks}
    with jax.set_mesh(mesh):
        for t in tokens:
            x, idx, w, _ = make_inputs(ranks, t, hidden)
            point = {backend: time_backend(backend, x, idx, w, iters=iters) for backend in backends}
            out[str(t)] = point
            print(f"  T={t}: {point}", file=sys.stderr, flush=True)
    if "cuda" in backends:
        jax_ep.finalize()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("builds", nargs="+", help="NAME=SITE")
    parser.add_argument("--tokens", default="4096,8192")
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--xla", default="", help="the build whose first process also times backend xla")
    parser.add_argument("--platform", default="gpu", choices=("gpu", "cpu"), help="cpu: a dry run of backend xla")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tokens = [int(v) for v in args.tokens.split(",")]
    if args.child:
        backends = ["cuda", "xla"] if args.xla == "yes" else ["cuda"]
        if args.platform == "cpu":
            backends = ["xla"]
        result = child(args.child, tokens, args.hidden, backends, args.iters, args.platform)
        print(MARK + json.dumps(result), flush=True)
        return

    builds = dict(b.split("=", 1) for b in args.builds)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}
    runs: dict[str, list[dict]] = {name: [] for name in builds}
    for round_index in range(args.rounds):
        for name, site in builds.items():
            xla = "yes" if name == args.xla and round_index == 0 else "no"
            command = [
                sys.executable,
                "-m",
                "bench.compare_builds",
                "unused",
                "unused",
                "--child",
                site,
                "--tokens",
                args.tokens,
            ]
            command += ["--hidden", str(args.hidden), "--iters", str(args.iters), "--xla", xla]
            command += ["--platform", args.platform]
            print(f"round {round_index}, build {name}", flush=True)
            child_env = {**env, "PYTHONPATH": os.pathsep.join((site, str(ROOT)))}
            done = subprocess.run(command, cwd=site, env=child_env, capture_output=True, text=True)
            sys.stderr.write(done.stderr[-3000:])
            lines = [line for line in done.stdout.splitlines() if line.startswith(MARK)]
            if done.returncode != 0 or not lines:
                raise SystemExit(f"build {name} failed (exit {done.returncode})")
            runs[name].append(json.loads(lines[-1][len(MARK) :]))

    from bench.record import provenance, write

    payload = {
        **provenance("python -m bench.compare_builds " + " ".join(sys.argv[1:])),
        "builds": builds,
        "hidden": args.hidden,
        "tokens": tokens,
        "platform": args.platform,
        "timing": "time_backend (bench.timing) of each build; one entry per round",
        "runs": runs,
    }
    write(args.out, payload)
    shown = "cuda" if args.platform == "gpu" else "xla"
    for t in tokens:
        for name, rounds in runs.items():
            cells = []
            for key in ("dispatch_us", "combine_us"):
                values = [r[str(t)][shown][key] for r in rounds if key in r[str(t)][shown]]
                if values:
                    cells.append(f"{key} " + "/".join(f"{v:.1f}" for v in values))
            print(f"T={t:5} {name:>10}: " + "  ".join(cells))


if __name__ == "__main__":
    main()
