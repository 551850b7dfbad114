"""Time dispatch and combine next to a plain CUDA peer copy of the same bytes and a ragged_all_to_all baseline.

    python bench/bench_dispatch.py OUT.json [--suite training|decode|sweep|all]

training: T=4096 tokens per rank, H=7168, K=8, E=256, bf16, ragged layout, capacity=None, uniform routing;
          cuda and xla backends, the MaxText-style ragged_all_to_all round trip (bench/ragged_baseline.py)
          with XLA's one-shot kernel flag true and false, and a cudaMemcpyPeerAsync of the remote bytes.
decode:   T=128, expert layout, --decode-capacity rows per local expert.
sweep:    T in {128, 512, 2048, 4096, 8192} x H in {2048, 4096, 7168}; also writes OUT.png (GB/s vs tokens).

Each op runs ``iters`` times inside one jitted ``fori_loop`` (the routing shifts every iteration, so nothing
is loop-invariant); time per call = (wall(1 + iters calls) - wall(1 call)) / iters, so host overhead cancels.
GB/s counts the remote bytes: deduplicated (token, remote rank) pairs x H x 2.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

RAGGED_FLAG = "--xla_gpu_unsupported_use_ragged_all_to_all_one_shot_kernel"
if "--ragged-flag" in sys.argv:  # a child run for one value of XLA's flag: set it before jax starts
    flag = sys.argv[sys.argv.index("--ragged-flag") + 1]
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {RAGGED_FLAG}={flag}"
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from ragged_baseline import emulated_ragged_all_to_all, ragged_roundtrip  # noqa: E402
from record import provenance, write  # noqa: E402

import jax_ep  # noqa: E402
from jax_ep import _backends  # noqa: E402

TOPK, EXPERTS = 8, 256


def _wall(fn, args) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def seconds_per_call(step, args, iters: int) -> float:
    """Device seconds of one ``step(i, *args)`` (returns a float32 scalar), from jitted loops."""

    def looped(count):
        def body(*args):
            zero = jax.lax.pcast(jnp.zeros((), jnp.float32), ("ep",), to="varying")
            total = jax.lax.fori_loop(0, count, lambda i, acc: acc + step(i, *args), zero)
            return total[None]

        return jax.jit(jax.shard_map(body, in_specs=P("ep"), out_specs=P("ep")))

    return (_wall(looped(1 + iters), args) - _wall(looped(1), args)) / iters


def make_inputs(ranks: int, tokens: int, hidden: int, seed: int = 0):
    """Uniform random top-k routing (distinct experts per token), bf16 tokens, and the remote bytes per rank."""
    rng = np.random.default_rng(seed)
    idx = np.argsort(rng.random((ranks * tokens, EXPERTS)), axis=1)[:, :TOPK].astype(np.int32)
    x = jnp.asarray(rng.standard_normal((ranks * tokens, hidden)), jnp.bfloat16)
    w = jnp.asarray(rng.random((ranks * tokens, TOPK)), jnp.float32)
    source = np.repeat(np.arange(ranks), tokens)
    local = EXPERTS // ranks
    pairs = [(np.any(idx // local == d, axis=1) & (source != d)).sum() for d in range(ranks)]
    return x, idx, w, int(max(pairs)) * hidden * 2


def time_backend(backend, x, idx, w, *, layout="ragged", capacity=None, detail=False, iters=20) -> dict:
    """Device µs of dispatch and combine (and, with detail, the routing part and the layout step)."""
    ranks = jax.sharding.get_abstract_mesh().shape["ep"]
    t = x.shape[0] // ranks
    kw = dict(num_experts=EXPERTS, axis_name="ep", layout=layout, capacity=capacity, backend=backend)

    def dispatch(i, x, idx, w):
        return jax_ep.dispatch(x, (idx + i) % EXPERTS, w, **kw)

    def dispatch_step(i, x, idx, w):
        d = dispatch(i, x, idx, w)
        flat = d.x.reshape(-1, d.x.shape[-1])
        row = i % flat.shape[0]
        return jnp.sum(flat[row].astype(jnp.float32)) + d.weights.reshape(-1)[row]

    def made(x, idx, w):
        d = dispatch(0, x, idx, w)
        return d.x, d.weights, d.handle

    y, y_weights, handle = jax.jit(jax.shard_map(made, in_specs=P("ep"), out_specs=P("ep")))(x, idx, w)

    def combine_step(i, y, handle, weights):
        out = jax_ep.combine(y, handle, weights=weights * (1.0 + i.astype(jnp.float32) * 0.0))
        return jnp.sum(out[i % t].astype(jnp.float32))

    steps = [("dispatch_us", dispatch_step, (x, idx, w)), ("combine_us", combine_step, (y, handle, y_weights))]
    if detail:

        def routing_step(i, x, idx, w):  # d.x is dead code: routing and weights only
            return dispatch(i, x, idx, w).weights.reshape(-1)[i]

        def layout_step(i, idx):
            layout = _backends.module(backend).local_layout((idx + i) % EXPERTS, EXPERTS, ranks)
            return layout.slot_rank[i % t, 0].astype(jnp.float32)

        steps += [("routing_only_us", routing_step, (x, idx, w)), ("local_layout_us", layout_step, (idx,))]
    return {name: seconds_per_call(step, args, iters) * 1e6 for name, step, args in steps}


def time_ragged(x, idx, w, *, exchange, iters=20) -> dict:
    """Device µs of the ragged_all_to_all round trip (dispatch + combine), checked against the exact result."""

    def roundtrip(i, x, idx, w):
        out = ragged_roundtrip(x, (idx + i) % EXPERTS, w, num_experts=EXPERTS, axis_name="ep", exchange=exchange)
        return out, jnp.sum(out[i % out.shape[0]])

    once = jax.jit(jax.shard_map(lambda x, idx, w: roundtrip(0, x, idx, w)[0], in_specs=P("ep"), out_specs=P("ep")))
    got = np.asarray(once(x, idx, w))
    want = np.asarray(w).sum(1, keepdims=True) * np.asarray(x.astype(jnp.float32))
    error = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    us = seconds_per_call(lambda i, x, idx, w: roundtrip(i, x, idx, w)[1], (x, idx, w), iters) * 1e6
    return {"roundtrip_us": us, "max_relative_error": error, "correct": error < 1e-2}


def ragged_in_children(args, tokens_list, hidden) -> dict:
    """Run the ragged baseline once per value of XLA's one-shot flag, each in a fresh process."""
    results = {}
    for flag in ("true", "false"):
        part = args.out.with_suffix(f".ragged_{flag}.json")
        command = [sys.executable, __file__, str(part), "--ragged-flag", flag, "--hidden", str(hidden)]
        command += ["--ragged-tokens", ",".join(map(str, tokens_list)), "--iters", str(args.iters)]
        command += ["--platform", args.platform]
        print(f"ragged_all_to_all, {RAGGED_FLAG}={flag}: {' '.join(command)}", flush=True)
        done = subprocess.run(command, check=False)
        results[flag] = json.loads(part.read_text()) if done.returncode == 0 else {"error": f"exit {done.returncode}"}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--suite", default="training", choices=("training", "decode", "sweep", "all"))
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--sweep-tokens", default="128,512,2048,4096,8192")
    parser.add_argument("--sweep-hidden", default="2048,4096,7168")
    parser.add_argument("--decode-capacity", type=int, default=32, help="rows per local expert at T=128")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backends", default="cuda,xla")
    parser.add_argument("--platform", default="gpu", help="cpu: a dry run (xla backend, emulated ragged exchange)")
    parser.add_argument("--ragged-flag", choices=("true", "false"), help=argparse.SUPPRESS)
    parser.add_argument("--ragged-tokens", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    sweep_tokens = [int(v) for v in args.sweep_tokens.split(",")]
    sweep_hidden = [int(v) for v in args.sweep_hidden.split(",")]

    devices = jax.devices(args.platform)[:2]
    ranks = len(devices)
    mesh = jax.make_mesh((ranks,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=devices)
    exchange = jax.lax.ragged_all_to_all if args.platform == "gpu" else emulated_ragged_all_to_all

    if args.ragged_flag:  # child: only the ragged baseline
        out = {}
        with jax.set_mesh(mesh):
            for tokens in map(int, args.ragged_tokens.split(",")):
                x, idx, w, _ = make_inputs(ranks, tokens, args.hidden)
                out[tokens] = time_ragged(x, idx, w, exchange=exchange, iters=args.iters)
                print(f"  T={tokens}: {out[tokens]}", flush=True)
        args.out.write_text(json.dumps(out))
        return

    backends = args.backends.split(",")
    suites = ("training", "decode", "sweep") if args.suite == "all" else (args.suite,)
    sweep = args.suite in ("sweep", "all")
    max_tokens = max(sweep_tokens + [args.tokens, 128])
    max_hidden = max(sweep_hidden + [args.hidden]) if sweep else args.hidden
    if "cuda" in backends:
        jax_ep.initialize(mesh, "ep", num_tokens=max_tokens, hidden=max_hidden, topk=TOPK, num_experts=EXPERTS)

    def peer_copy_us(nbytes: int) -> float:
        if args.platform != "gpu":
            return float("nan")
        ids = (devices[0].local_hardware_id, devices[1].local_hardware_id)
        return jax_ep._cuda._extension.peer_copy_seconds(*ids, nbytes, args.iters) * 1e6

    payload = {
        **provenance("python " + " ".join(sys.argv)),
        "ranks": ranks,
        "platform": args.platform,
        "routing": "uniform random top-k, distinct experts, shifted by the iteration index",
        "topk": TOPK,
        "experts": EXPERTS,
        "dtype": "bfloat16",
        "timing": "device time per call: (wall(1 + iters calls in one jitted fori_loop) - wall(1 call)) / iters",
        "kernel_grid": "each CUDA kernel uses up to 264 blocks of 256 threads (2 per SM of the 132); not a parameter",
    }
    with jax.set_mesh(mesh):
        if "training" in suites:
            print(f"training shape: T={args.tokens}, H={args.hidden}", flush=True)
            x, idx, w, remote = make_inputs(ranks, args.tokens, args.hidden)
            training = {"tokens": args.tokens, "hidden": args.hidden, "remote_bytes_per_rank": remote}
            training["peer_copy_us"] = peer_copy_us(remote)
            for backend in backends:
                training[backend] = time_backend(backend, x, idx, w, detail=True, iters=args.iters)
                print(f"  {backend}: {training[backend]}", flush=True)
            payload["training"] = training
        if "decode" in suites:
            print(f"decode shape: T=128, H={args.hidden}, expert layout, capacity {args.decode_capacity}", flush=True)
            x, idx, w, remote = make_inputs(ranks, 128, args.hidden)
            decode = {"tokens": 128, "hidden": args.hidden, "capacity": args.decode_capacity}
            for backend in backends:
                decode[backend] = time_backend(
                    backend, x, idx, w, layout="expert", capacity=args.decode_capacity, iters=args.iters
                )
                print(f"  {backend}: {decode[backend]}", flush=True)
            payload["decode"] = decode
        if sweep:
            points = []
            for hidden in sweep_hidden:
                for tokens in sweep_tokens:
                    x, idx, w, remote = make_inputs(ranks, tokens, hidden)
                    point = {"tokens": tokens, "hidden": hidden, "remote_bytes_per_rank": remote}
                    point["peer_copy_us"] = peer_copy_us(remote)
                    for backend in backends if hidden == max(sweep_hidden) else backends[:1]:
                        point[backend] = time_backend(backend, x, idx, w, iters=args.iters)
                    print(f"  sweep T={tokens} H={hidden}: {point}", flush=True)
                    points.append(point)
            payload["sweep"] = points

    if "training" in suites or sweep:
        hidden = max(sweep_hidden) if sweep else args.hidden
        tokens = sorted({*(sweep_tokens if sweep else ()), *((args.tokens,) if "training" in suites else ())})
        payload["ragged_all_to_all"] = {"hidden": hidden, "one_shot": ragged_in_children(args, tokens, hidden)}
    write(args.out, payload)
    if sweep:
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
        f"jax_ep {b}": [
            2 * p["remote_bytes_per_rank"] / (p[b]["dispatch_us"] + p[b]["combine_us"]) / 1e3 for p in points
        ]
        for b in points[0]
        if b in ("cuda", "xla")
    }
    series["peer copy"] = [p["remote_bytes_per_rank"] / p["peer_copy_us"] / 1e3 for p in points]
    for flag, runs in payload.get("ragged_all_to_all", {}).get("one_shot", {}).items():
        if all(str(t) in runs for t in tokens):
            series[f"ragged_all_to_all one-shot={flag}"] = [
                2 * p["remote_bytes_per_rank"] / runs[str(p["tokens"])]["roundtrip_us"] / 1e3 for p in points
            ]
    for name, values in series.items():
        ax.plot(tokens, values, marker="o", label=name)
    ax.set(
        xscale="log",
        xlabel="tokens per rank",
        ylabel="GB/s of remote bytes",
        title=f"{payload['ranks']} {payload['platform']} devices, H={hidden}, K={TOPK}",
    )
    ax.legend()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def summary(payload: dict) -> None:
    training = payload.get("training")
    if training:
        copy = training["peer_copy_us"]
        print(f"peer copy of {training['remote_bytes_per_rank'] / 1e6:.1f} MB: {copy:.1f} us")
        for backend in ("cuda", "xla"):
            if backend in training:
                r = training[backend]
                print(
                    f"{backend:6} dispatch {r['dispatch_us']:8.1f} us ({100 * copy / r['dispatch_us']:5.1f}% of copy)"
                    f"  combine {r['combine_us']:8.1f} us ({100 * copy / r['combine_us']:5.1f}% of copy)"
                )
    for flag, runs in payload.get("ragged_all_to_all", {}).get("one_shot", {}).items():
        print(f"ragged_all_to_all one-shot={flag}: {runs}")


if __name__ == "__main__":
    main()
