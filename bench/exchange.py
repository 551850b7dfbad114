"""Time dispatch and combine next to a plain CUDA peer copy of the same bytes and a ragged_all_to_all baseline.

    python -m bench.exchange OUT.json [--suite all | --suite training,decode,sweep,sms] [--ranks N]
    python -m bench.exchange OUT.json --platform cpu --backends xla   # a dry run: 8 simulated CPU devices, small shapes

The EP group is the first --ranks devices of the platform (default: all of them). The shapes below are the GPU
defaults; with --platform cpu they default to T=64, H=256, a sweep of T in {16, 32, 64} x H in {128, 256} and 5
iterations, and the CPU platform gets 8 simulated devices unless XLA_FLAGS sizes it: a dry run of every suite
in a few minutes on 2 cores, whose times say nothing about GPUs.

training: T=4096 tokens per rank, H=7168, K=8, E=256, bf16, ragged layout, capacity=None, uniform routing;
          cuda and xla backends, the MaxText-style ragged_all_to_all round trip (ragged_baseline.py) with
          XLA's one-shot kernel flag true and false (false also allows its NCCL send/recv path, which XLA
          otherwise refuses), and a cudaMemcpyPeerAsync of the remote bytes.
decode:   T=128, expert layout, --decode-capacity rows per local expert.
sweep:    T in {128, 512, 2048, 4096, 8192} x H in {2048, 4096, 7168}; also writes OUT.png (GB/s vs tokens).
sms:      the training shape with the cuda kernels limited to --sms SMs (jax_ep.initialize(num_sms=...)).

--transport nccl sends jax_ep's rows between the GPUs through NCCL instead of peer stores (jax_ep.initialize's
transport); --p2p-off sets NCCL_P2P_DISABLE=1 before jax starts, so jax_ep and XLA's own collectives both go
through NCCL without P2P (through host memory on one node), as between GPUs that cannot reach each other.

Each op runs inside a jitted ``fori_loop`` of static trip count (the routing shifts every iteration, so nothing
is loop-invariant); time per call = (wall(1 + n calls) - wall(1 call)) / n, so Python's dispatch overhead cancels;
n is --iters, raised once when the n calls take under 20 ms. XLA still launches each iteration's kernels from the
host (the FFI calls are not marked command-buffer compatible), so where launching takes longer than running them
(small shapes), these times are launch-bound.
GB/s counts the remote bytes: deduplicated (token, remote rank) pairs x H x 2.
This module is the command line; the measuring tools are in bench/timing.py, the peer copy in bench/copy_timing.py.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

RAGGED_FLAG = "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel"
# Without the one-shot kernel, XLA 0.11 on GPUs refuses ragged_all_to_all unless its NCCL send/recv path is allowed.
NCCL_FALLBACK_FLAG = "--xla_gpu_allow_ragged_all_to_all_nccl_send_recv_fallback=true"


def _early_option(name: str) -> str | None:
    """An option's value read before argparse runs, for settings that must precede jax's start."""
    for i, arg in enumerate(sys.argv):
        if arg == name and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if arg.startswith(f"{name}="):
            return arg.split("=", 1)[1]
    return None


if _early_option("--ragged-flag"):  # a child run for one value of XLA's flag: set it before jax starts a backend
    flag = _early_option("--ragged-flag")
    on_gpu = _early_option("--platform") in (None, "gpu")
    extra = f"{RAGGED_FLAG}={flag}" + (f" {NCCL_FALLBACK_FLAG}" if flag == "false" and on_gpu else "")
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {extra}"
if "--p2p-off" in sys.argv:
    os.environ["NCCL_P2P_DISABLE"] = "1"
if _early_option("--platform") == "cpu" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # the ragged children share the GPUs with us

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import jax_ep  # noqa: E402
from bench.copy_timing import peer_copy_seconds  # noqa: E402
from bench.ragged_baseline import emulated_ragged_all_to_all  # noqa: E402
from bench.record import provenance, write  # noqa: E402
from bench.timing import (  # noqa: E402
    EXPERTS,
    TOPK,
    make_inputs,
    progress,
    time_backend,
    time_ragged,
    transport_facts,
    with_rates,
)


def ragged_in_children(args, tokens_list, hidden) -> dict:
    """Run the ragged baseline once per value of XLA's one-shot flag, each in a fresh process; on CPU, where the
    exchange is emulated and the flag means nothing, once, under the key "emulated"."""
    results = {}
    flags = {"true": "true", "false": "false"} if args.platform == "gpu" else {"emulated": "true"}
    with tempfile.TemporaryDirectory() as scratch:  # the children's JSON, merged into ours
        for flag, value in flags.items():
            part = Path(scratch) / f"ragged_{flag}.json"
            command = [sys.executable, "-m", "bench.exchange", str(part), "--ragged-flag", value]
            command += ["--hidden", str(hidden), "--ragged-tokens", ",".join(map(str, tokens_list))]
            command += ["--platform", args.platform] + (["--ranks", str(args.ranks)] if args.ranks else [])
            progress(f"ragged_all_to_all, {RAGGED_FLAG}={flag}: {' '.join(command)}")
            try:
                done = subprocess.run(command, check=False, timeout=args.ragged_timeout)
            except subprocess.TimeoutExpired:
                results[flag] = {"error": f"no result within {args.ragged_timeout} s"}
                continue
            failed = {"error": f"exit {done.returncode}"}
            results[flag] = json.loads(part.read_text()) if done.returncode == 0 else failed
    return results


PLATFORM_DEFAULTS = {
    "gpu": dict(
        tokens=4096, hidden=7168, sweep_tokens="128,512,2048,4096,8192", sweep_hidden="2048,4096,7168", iters=50
    ),
    "cpu": dict(tokens=64, hidden=256, sweep_tokens="16,32,64", sweep_hidden="128,256", iters=5),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.exchange", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="JSON results (and OUT.png with the sweep)")
    parser.add_argument("--suite", default="all", help="all, or a comma list of training, decode, sweep, sms")
    gpu, cpu = PLATFORM_DEFAULTS["gpu"], PLATFORM_DEFAULTS["cpu"]

    def default(name: str) -> str:
        return f"GPU: {gpu[name]}; CPU: {cpu[name]}"

    parser.add_argument("--tokens", type=int, help=f"tokens per rank of the training shape ({default('tokens')})")
    parser.add_argument("--hidden", type=int, help=f"H of the training and decode shapes ({default('hidden')})")
    parser.add_argument("--sweep-tokens", help=default("sweep_tokens"))
    parser.add_argument("--sweep-hidden", help=default("sweep_hidden"))
    parser.add_argument("--ranks", type=int, help="devices in the EP group (default: all of the platform's)")
    parser.add_argument("--sms", default="8,16,32,64", help="SM budgets of the sms suite (plus all SMs)")
    parser.add_argument("--decode-capacity", type=int, default=32, help="rows per local expert at T=128")
    parser.add_argument("--iters", type=int, help=f"calls per timing loop ({default('iters')})")
    parser.add_argument("--backends", default="cuda,xla")
    parser.add_argument("--ragged-timeout", type=float, default=150, help="seconds for each ragged baseline run")
    parser.add_argument("--no-ragged", action="store_true", help="skip the ragged_all_to_all baseline")
    parser.add_argument("--platform", default="gpu", help="cpu: a dry run (xla backend, emulated ragged exchange)")
    parser.add_argument("--transport", default="auto", choices=("auto", "nccl"), help="jax_ep.initialize's")
    parser.add_argument("--p2p-off", action="store_true", help="NCCL_P2P_DISABLE=1 for jax_ep and XLA")
    parser.add_argument("--ragged-flag", choices=("true", "false"), help=argparse.SUPPRESS)
    parser.add_argument("--ragged-tokens", help=argparse.SUPPRESS)
    args = parser.parse_args()
    for name, value in PLATFORM_DEFAULTS["cpu" if args.platform == "cpu" else "gpu"].items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def fp8_row_bytes(hidden: int) -> int:
    """Bytes of one dispatched row with ``wire_dtype=float8_e4m3fn``: ``hidden`` e4m3 values and one float32 scale
    per 128 of them, padded to a multiple of 16 bytes (docs/api.md, FP8 dispatch)."""
    return -(-(hidden + 4 * (hidden // 128)) // 16) * 16


def fp8_wire_bytes(hidden: int, remote_bf16: int) -> dict:
    """Bytes on the wire of dispatch's rows in bfloat16 and as FP8, per row and for this rank's remote rows."""
    rows = remote_bf16 // (hidden * 2)
    packed = fp8_row_bytes(hidden)
    return {
        "row_bytes_bfloat16": hidden * 2,
        "row_bytes_fp8": packed,
        "remote_bytes_per_rank": rows * packed,
        "remote_bytes_per_rank_bfloat16": remote_bf16,
    }


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> None:
    args = parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    available = jax.devices(args.platform)
    if args.ranks is not None and not 1 <= args.ranks <= len(available):
        raise SystemExit(f"--ranks must be in [1, {len(available)}] ({args.platform} devices here), got {args.ranks}")
    devices = available[: args.ranks or len(available)]
    ranks = len(devices)
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    exchange = jax.lax.ragged_all_to_all if args.platform == "gpu" else emulated_ragged_all_to_all
    if not args.ragged_flag:
        progress(f"EP group: {ranks} of the {len(available)} {args.platform} devices")

    if args.ragged_flag:  # child: only the ragged baseline
        out = {}
        with jax.set_mesh(mesh):
            for tokens in ints(args.ragged_tokens):
                x, idx, w, _ = make_inputs(ranks, tokens, args.hidden)
                out[tokens] = time_ragged(x, idx, w, exchange=exchange, iters=2)  # slow: 2 calls exceed 20 ms
                progress(f"  T={tokens}: {out[tokens]}")
        args.out.write_text(json.dumps(out))
        return

    backends = args.backends.split(",")
    known = ("training", "decode", "sweep", "sms")
    suites = known if args.suite == "all" else tuple(args.suite.split(","))
    if not set(suites) <= set(known):
        raise SystemExit(f"--suite must be 'all' or a comma list of {known}, got {args.suite!r}")
    sweep_tokens, sweep_hidden = ints(args.sweep_tokens), ints(args.sweep_hidden)
    if "sweep" not in suites:
        sweep_tokens, sweep_hidden = [], []
    max_tokens = max([*sweep_tokens, args.tokens, 128])
    max_hidden = max([*sweep_hidden, args.hidden])
    cuda_sizes = dict(
        num_tokens=max_tokens, hidden=max_hidden, topk=TOPK, num_experts=EXPERTS, transport=args.transport
    )
    all_sms = jax_ep.initialize(mesh, "ep", **cuda_sizes).num_sms if "cuda" in backends else None

    def peer_copy_us(nbytes: int) -> float | None:
        if args.platform != "gpu" or ranks < 2:  # one GPU: no peer to copy to (bench/one_gpu_targets.py)
            return None
        ids = (devices[0].local_hardware_id, devices[1].local_hardware_id)
        return peer_copy_seconds(*ids, nbytes, args.iters) * 1e6

    payload = {
        **provenance("python -m bench.exchange " + " ".join(sys.argv[1:])),
        "ranks": ranks,
        "platform": args.platform,
        "routing": "uniform random top-k, distinct experts, shifted by the iteration index",
        "topk": TOPK,
        "experts": EXPERTS,
        "dtype": "bfloat16",
        "timing": "per call: (wall(1 + n calls in one jitted fori_loop of static trip count) - wall(1 call)) / n, "
        "n = iters, raised once to take ~25 ms when under 20 ms; launch-bound where XLA launches slower than "
        "the GPU runs",
        "iters": args.iters,
        "cuda_kernel_sms": all_sms,
        **transport_facts(args.transport),
    }
    with jax.set_mesh(mesh):
        if "training" in suites or "sms" in suites:
            x, idx, w, remote = make_inputs(ranks, args.tokens, args.hidden)
            copy_us = peer_copy_us(remote)
        if "training" in suites:
            progress(f"training shape: T={args.tokens}, H={args.hidden}")
            training = {"tokens": args.tokens, "hidden": args.hidden, "remote_bytes_per_rank": remote}
            training["peer_copy_us"] = copy_us
            for backend in backends:
                timings = time_backend(backend, x, idx, w, iters=args.iters)
                training[backend] = with_rates(timings, remote, copy_us)
                progress(f"  {backend}: {training[backend]}")
            if args.hidden % 128 == 0:  # dispatch with FP8 rows: the same tokens, fewer bytes
                wire = fp8_wire_bytes(args.hidden, remote)
                training["fp8"] = wire
                for backend in backends:
                    timings = time_backend(backend, x, idx, w, wire_dtype=jnp.float8_e4m3fn, iters=args.iters)
                    training["fp8"][backend] = with_rates(timings, wire["remote_bytes_per_rank"], copy_us)
                    progress(f"  {backend}, FP8 rows: {training['fp8'][backend]}")
            payload["training"] = training
        if "sms" in suites and "cuda" in backends:
            progress(f"SM budget at the training shape, of {all_sms} SMs per GPU")
            budgets = []
            for num_sms in [*ints(args.sms), all_sms]:
                used = jax_ep.initialize(mesh, "ep", **cuda_sizes, num_sms=num_sms).num_sms
                timings = with_rates(time_backend("cuda", x, idx, w, iters=args.iters), remote, copy_us)
                budgets.append({"num_sms": used, "sms_left_for_compute": all_sms - used, **timings})
                progress(f"  num_sms={used}: {budgets[-1]}")
            payload["sms"] = {"tokens": args.tokens, "hidden": args.hidden, "peer_copy_us": copy_us, "runs": budgets}
        if "decode" in suites:
            progress(f"decode shape: T=128, H={args.hidden}, expert layout, capacity {args.decode_capacity}")
            x, idx, w, remote = make_inputs(ranks, 128, args.hidden)
            decode = {"tokens": 128, "hidden": args.hidden, "capacity": args.decode_capacity}
            for backend in backends:
                decode[backend] = time_backend(
                    backend, x, idx, w, layout="expert", capacity=args.decode_capacity, iters=args.iters
                )
                progress(f"  {backend}: {decode[backend]}")
            payload["decode"] = decode
        points = []
        for hidden in sweep_hidden:
            for tokens in sweep_tokens:
                x, idx, w, remote = make_inputs(ranks, tokens, hidden)
                copy_us = peer_copy_us(remote)
                point = {"tokens": tokens, "hidden": hidden, "remote_bytes_per_rank": remote, "peer_copy_us": copy_us}
                for backend in backends if hidden == max(sweep_hidden) else backends[:1]:
                    point[backend] = with_rates(time_backend(backend, x, idx, w, iters=args.iters), remote, copy_us)
                progress(f"  sweep T={tokens} H={hidden}: {point}")
                points.append(point)
        if points:
            payload["sweep"] = points

    if ("training" in suites or points) and not args.no_ragged:
        hidden = max(sweep_hidden) if points else args.hidden
        tokens = sorted({*sweep_tokens, *((args.tokens,) if "training" in suites else ())})
        payload["ragged_all_to_all"] = {"hidden": hidden, "one_shot": ragged_in_children(args, tokens, hidden)}
    payload["speedups"] = speedups(payload)
    write(args.out, payload)
    if points:
        plot(payload, args.out.with_suffix(".png"))
    summary(payload)


def plot(payload: dict, path: Path) -> None:
    """GB/s of dispatch + combine (remote bytes each way) against tokens per rank at the largest hidden size."""
    from matplotlib.figure import Figure

    hidden = max(p["hidden"] for p in payload["sweep"])
    points = [p for p in payload["sweep"] if p["hidden"] == hidden]
    tokens = [p["tokens"] for p in points]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    series = {
        f"jax_ep {b} (dispatch + combine)": [
            2 * p["remote_bytes_per_rank"] / (p[b]["dispatch_us"] + p[b]["combine_us"]) / 1e3 for p in points
        ]
        for b in points[0]
        if b in ("cuda", "xla")
    }
    if all(p["peer_copy_us"] for p in points):
        series["peer copy (cudaMemcpyPeerAsync)"] = [
            p["remote_bytes_per_rank"] / p["peer_copy_us"] / 1e3 for p in points
        ]
    for flag, runs in payload.get("ragged_all_to_all", {}).get("one_shot", {}).items():
        if all(str(t) in runs for t in tokens):
            label = "(emulated on CPU)" if flag == "emulated" else f"one-shot={flag}"
            series[f"ragged_all_to_all round trip {label}"] = [
                2 * p["remote_bytes_per_rank"] / runs[str(p["tokens"])]["roundtrip_us"] / 1e3 for p in points
            ]
    for name, values in series.items():
        ax.plot(tokens, values, marker="o", label=name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="tokens per rank",
        ylabel="GB/s of remote bytes",
        title=f"{payload['ranks']} {payload['platform']} devices, H={hidden}, K={TOPK}, E={EXPERTS}, bf16",
    )
    ax.set_xticks(tokens, labels=[str(t) for t in tokens])
    ax.tick_params(axis="x", which="minor", bottom=False, labelbottom=False)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    print(f"wrote {path}")


def speedups(payload: dict) -> dict:
    """Dispatch + combine of backend cuda against xla and the ragged_all_to_all round trip, per measured shape."""
    out = {}
    shapes = [{**payload.get("training", {}), "suite": "training"}, *payload.get("sweep", [])]
    ragged = payload.get("ragged_all_to_all", {})
    for shape in shapes:
        if "cuda" not in shape:
            continue
        cuda_us = shape["cuda"]["dispatch_us"] + shape["cuda"]["combine_us"]
        ratios = {}
        if "xla" in shape:
            ratios["xla"] = (shape["xla"]["dispatch_us"] + shape["xla"]["combine_us"]) / cuda_us
        if shape["hidden"] == ragged.get("hidden"):
            for flag, runs in ragged["one_shot"].items():
                run = runs.get(str(shape["tokens"]), {})
                if "roundtrip_us" in run:
                    ratios[f"ragged_all_to_all_one_shot_{flag}"] = run["roundtrip_us"] / cuda_us
        if ratios:
            out[f"{shape.get('suite', 'sweep')} T={shape['tokens']},H={shape['hidden']}"] = ratios
    return out


def summary(payload: dict) -> None:
    """The headline numbers, last in the output."""
    training = payload.get("training")
    if training:
        copy, remote_mb = training["peer_copy_us"], training["remote_bytes_per_rank"] / 1e6
        print(f"peer copy of {remote_mb:.1f} MB: " + (f"{copy:.1f} us" if copy else "not measured (needs 2 GPUs)"))
        for backend in ("cuda", "xla"):
            if backend in training:
                r = training[backend]
                cells = []
                for op in ("dispatch", "combine"):
                    share = f", {r[f'{op}_pct_of_copy']:5.1f}% of copy" if copy else ""
                    cells.append(f"{op} {r[f'{op}_us']:8.1f} us ({r[f'{op}_gbps']:7.2f} GB/s{share})")
                print(f"{backend:6} " + "  ".join(cells))
        fp8 = training.get("fp8")
        if fp8:
            print(
                f"FP8 rows: {fp8['row_bytes_fp8']} bytes each against {fp8['row_bytes_bfloat16']} in bfloat16, "
                f"{fp8['remote_bytes_per_rank'] / 1e6:.1f} MB remote per rank"
            )
            for backend in ("cuda", "xla"):
                if backend in fp8:
                    print(f"{backend:6} dispatch with FP8 rows {fp8[backend]['dispatch_us']:8.1f} us")
    for run in payload.get("sms", {}).get("runs", []):
        print(f"num_sms={run['num_sms']:4}: dispatch {run['dispatch_us']:8.1f} us  combine {run['combine_us']:8.1f} us")
    decode = payload.get("decode", {})
    for backend in ("cuda", "xla"):
        if backend in decode:
            print(
                f"decode {backend}: dispatch {decode[backend]['dispatch_us']:.1f} us  combine "
                f"{decode[backend]['combine_us']:.1f} us"
            )
    for flag, runs in payload.get("ragged_all_to_all", {}).get("one_shot", {}).items():
        print(f"ragged_all_to_all one-shot={flag}: {runs}")
    for shape, ratios in payload.get("speedups", {}).items():
        faster = ", ".join(f"{k} {v:.1f}x" for k, v in ratios.items())
        print(f"cuda dispatch + combine at {shape} against: {faster}")


if __name__ == "__main__":
    main()
