"""The training shape with one process per GPU (jax.distributed on localhost), next to one process for all GPUs.

    python -m bench.multiprocess OUT.json [--tokens 4096 --hidden 7168] [--transport nccl] [--p2p-off]

Starts one worker per GPU; each calls ``jax.distributed.initialize`` and ``jax_ep.initialize`` over the mesh
of all processes' GPUs (buffers mapped by CUDA IPC), then times dispatch and combine of both backends as
``python -m bench.exchange`` does. Worker 0 writes the JSON. --transport and --p2p-off are as there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def checkout_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` with this checkout last on PYTHONPATH, for a child started as ``python -m bench.…``, ``tools.…`` or
    ``tests.…`` from any folder. It imports jax_ep as its parent would from the same folder: an installed build put
    first on PYTHONPATH (bench/device_run_one_gpu.sh) stays first."""
    paths = [path for path in env.get("PYTHONPATH", "").split(os.pathsep) if path]
    return {**env, "PYTHONPATH": os.pathsep.join([*paths, str(ROOT)])}


def run_session(command: list[str], timeout: float, env: Mapping[str, str]) -> tuple[int | None, str, str]:
    """Runs ``command`` in a session of its own: its exit code (None once ``timeout`` seconds pass, when the whole
    session is killed, a program run under a wrapper such as compute-sanitizer too), stdout and stderr. The session
    is killed as well when the wait is interrupted (KeyboardInterrupt from a time limit outside, say)."""
    child = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(env), start_new_session=True
    )
    try:
        stdout, stderr = child.communicate(timeout=timeout)
        return child.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        stdout, stderr = child.communicate()
        return None, stdout, stderr
    finally:
        if child.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
            child.wait()


def run_workers(
    command: Callable[[int, int], list[str]],
    count: int,
    timeout: float,
    env: dict[str, str] | None = None,
    logs: list[Path] | None = None,
) -> list[int] | None:
    """Runs ``command(port, i)`` for i < count, with a free localhost port for jax.distributed's coordinator.

    The workers find this checkout on PYTHONPATH (:func:`checkout_env`) and run with NVLink multicast off and
    without GPU memory preallocation (they share the GPUs), plus ``env``. Worker i writes to ``logs[i]`` when given
    (a file, so a full pipe cannot stall it), else to our output. Returns the exit codes, or None once ``timeout``
    seconds pass. A worker still running when it returns or raises (KeyboardInterrupt from a time limit outside,
    say) is killed, so that none is left holding the GPU.
    """
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = checkout_env({**os.environ, "NCCL_NVLS_ENABLE": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", **(env or {})})
    workers = []
    for i in range(count):
        with open(logs[i], "w") if logs else contextlib.nullcontext() as sink:
            stderr = subprocess.STDOUT if logs else None
            workers.append(subprocess.Popen(command(port, i), env=env, stdout=sink, stderr=stderr))
    deadline = time.monotonic() + timeout
    try:
        return [worker.wait(timeout=max(1.0, deadline - time.monotonic())) for worker in workers]
    except subprocess.TimeoutExpired:
        return None
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.kill()
                worker.wait()


def launch(args: argparse.Namespace) -> int:
    """Runs the workers and waits for them; returns the first nonzero exit code, or 0."""
    env = {
        "JAX_EP_COMMAND": os.environ.get("JAX_EP_COMMAND") or "python -m bench.multiprocess " + " ".join(sys.argv[1:])
    }
    command = [sys.executable, "-m", "bench.multiprocess", str(args.out.resolve()), "--tokens", str(args.tokens)]
    command += ["--hidden", str(args.hidden), "--iters", str(args.iters), "--processes", str(args.processes)]
    command += ["--backends", args.backends, "--platform", args.platform, "--transport", args.transport]
    if args.p2p_off:
        env["NCCL_P2P_DISABLE"] = "1"
    codes = run_workers(lambda port, i: [*command, "--worker", f"{port},{i}"], args.processes, args.timeout, env)
    if codes is None:
        print(f"bench.multiprocess: no result within {args.timeout} s", flush=True)
        return 1
    return next((code for code in codes if code), 0)


def work(args: argparse.Namespace) -> None:
    """One worker: its GPU is local device ``process_id``."""
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    port, process_id = (int(v) for v in args.worker.split(","))
    on_gpu = args.platform == "gpu"
    if not on_gpu:  # a dry run: one CPU device per process, XLA's CPU collectives over gloo
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        f"localhost:{port}",
        num_processes=args.processes,
        process_id=process_id,
        local_device_ids=[process_id] if on_gpu else None,
    )
    import jax_ep
    from bench.copy_timing import peer_copy_seconds
    from bench.record import provenance
    from bench.timing import (
        EXPERTS,
        TOPK,
        make_inputs,
        progress,
        time_backend,
        transport_facts,
        with_rates,
    )

    ranks = args.processes
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,))
    sizes = dict(num_tokens=args.tokens, hidden=args.hidden, topk=TOPK, num_experts=EXPERTS)
    backends = args.backends.split(",")
    group = jax_ep.initialize(mesh, "ep", **sizes, transport=args.transport) if "cuda" in backends else None
    *arrays, remote = make_inputs(ranks, args.tokens, args.hidden)  # the same in every process (fixed seed)
    sharding = NamedSharding(mesh, P("ep"))
    x, idx, w = (
        jax.make_array_from_callback(a.shape, sharding, lambda index, a=a: a[index])
        for a in (np.asarray(array) for array in arrays)
    )
    # GPUs 0 and 1 are visible to every worker (local_device_ids only picks JAX's device).
    copy_us = float("nan")
    if on_gpu and process_id == 0:
        copy_us = peer_copy_seconds(0, 1, remote, 20) * 1e6
    result = {
        **provenance("python -m bench.multiprocess"),
        "processes": ranks,
        "ranks": ranks,
        "cuda_kernel_sms": None if group is None else group.num_sms,
        **transport_facts(args.transport),
        "tokens": args.tokens,
        "hidden": args.hidden,
        "topk": TOPK,
        "experts": EXPERTS,
        "remote_bytes_per_rank": remote,
        "peer_copy_us": copy_us,
        "timing": "as python -m bench.exchange with a fixed count of iters calls per loop, measured in process 0",
    }
    with jax.set_mesh(mesh):
        for backend in backends:
            timings = time_backend(backend, x, idx, w, iters=args.iters, adaptive=False)
            result[backend] = with_rates(timings, remote, copy_us)
            progress(f"process {process_id}, {backend}: {result[backend]}")
    if process_id == 0:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.out}", flush=True)
    if group is not None:
        group.finalize()
    jax.distributed.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.multiprocess", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--backends", default="cuda,xla")
    parser.add_argument("--platform", default="gpu", help="cpu: a dry run of the xla backend")
    parser.add_argument("--timeout", type=float, default=300, help="seconds before the workers are killed")
    parser.add_argument("--transport", default="auto", choices=("auto", "nccl"), help="jax_ep.initialize's")
    parser.add_argument("--p2p-off", action="store_true", help="NCCL_P2P_DISABLE=1 in every worker")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        work(args)
    else:
        sys.exit(launch(args))


if __name__ == "__main__":
    main()
