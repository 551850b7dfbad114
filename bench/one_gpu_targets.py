"""The targets of the cuda backend on ONE GPU (an EP group of one GPU, mesh axis "ep"), in one process and one run.

    python -m bench.one_gpu_targets OUT.json [--tokens 128,4096] [--iters 50]
    python -m bench.one_gpu_targets OUT.json --platform cpu [--hidden 256 --tokens 64,128]   # a dry run, backend xla
    python -m bench.one_gpu_targets summarize DIR   # one table of DIR's gpu_tests.json, kernels_*.json, targets.json

Shapes: H=7168 (--hidden), K=8, E=256, bf16, ragged layout, capacity=None, uniform random routing with distinct
experts per token (``bench.timing.make_inputs``: normal tokens, uniform weights). OUT.json holds:

* ``copy``: the GPU's device-to-device copy bandwidth, measured in this run: ``cudaMemcpyPeerAsync`` of 1 GiB from
  the GPU to itself (``bench/copy_timing.py``'s ``peer_copy_seconds``), bandwidth = 2 * bytes / seconds (read +
  write), best of 5 measurements of 20 copies each; and its write-only bandwidth, ``cudaMemsetAsync`` of 1 GiB the
  same way (``fill``, bandwidth = bytes / seconds).
* ``check``, ``checked``: on one set of inputs per T, before any timing: backend "cuda" against "xla": dispatch's
  ``x`` and ``weights`` equal bit for bit on the specified rows (``row < sum(group_sizes)``), ``group_sizes`` and
  the counts equal; combine (``weights=d.weights`` of row-dependent expert outputs) within one bf16 ulp; the loss and
  gradients of the training step within 1e-2 of the largest magnitude.
* ``training`` (T=4096) and ``decode`` (T=128; any other T: ``tokens_T``): device µs of one dispatch and one
  combine (``time_backend`` of ``bench.timing``: jitted ``fori_loop``, routing shifted every iteration;
  the times include the loop's small XLA ops: shifting the routing, reading one row, making combine's weights
  loop-variant), and their HBM floors. Dispatch reads x once and writes the delivered rows and their weights:
  ``T*H*2 + D*H*2 + D*4`` bytes; combine reads the delivered rows and weights and writes the tokens:
  ``D*H*2 + D*4 + T*H*2``, with D = delivered rows (the valid slots, T*K for distinct routing at R=1).
  floor_us = bytes / copy bandwidth; ratio = time / floor (target: at most 1.2). Beside it, for reading only:
  ``{op}_write_floor_us``, the op's written bytes alone at the fill bandwidth. At decode size these loop times
  are secondary: the primary decode numbers are the kernels' device time from Nsight Compute
  (bench/profile_kernels.py).
* ``training_step``: forward and backward of dispatch -> elementwise expert -> combine(weights=d.weights) ->
  ``sum(out * c)``, gradients w.r.t. x, topk_weights and a per-rank scale, for backend "cuda" and "xla" in this
  run; ratio = cuda / xla (target: at most 0.7). The routing shifts every iteration and each step sums every
  gradient, so neither pass is loop-invariant or dead code.

With ``--platform cpu`` the copy and every cuda part are skipped (the JSON says so) and backend "xla" stands in,
so that every code path runs; its numbers mean nothing. The table is printed last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

TOPK, EXPERTS, HIDDEN = 8, 256, 7168
COPY_BYTES = 1 << 30
COPY_ITERS, COPY_REPEATS = 20, 5
FLOOR_RATIO_MAX = 1.2  # dispatch and combine: device time over the HBM floor
STEP_RATIO_MAX = 0.7  # training step: cuda over xla
GRAD_TOLERANCE = 1e-2  # of the largest magnitude


def role(tokens: int) -> str:
    """The JSON key of the dispatch and combine timings at T tokens."""
    return {4096: "training", 128: "decode"}.get(tokens, f"tokens_{tokens}")


def floors(tokens: int, hidden: int, delivered: int, bandwidth: float | None, fill: float | None = None) -> dict:
    """HBM bytes that dispatch and combine must move at least (bf16 rows, float32 weights), and their µs.

    ``fill``: the write-only bandwidth; with it, each op's written bytes alone at that bandwidth.
    """
    row = hidden * 2
    written = {"dispatch": delivered * row + delivered * 4, "combine": tokens * row}
    dispatch = tokens * row + written["dispatch"]
    combine = delivered * row + delivered * 4 + written["combine"]
    out = {"delivered_rows": delivered, "dispatch_floor_bytes": dispatch, "combine_floor_bytes": combine}
    for op, nbytes in (("dispatch", dispatch), ("combine", combine)):
        out[f"{op}_floor_us"] = nbytes / bandwidth * 1e6 if bandwidth else None
        if fill:
            out[f"{op}_write_floor_us"] = written[op] / fill * 1e6
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.one_gpu_targets", description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the JSON results")
    parser.add_argument("--tokens", default="128,4096", help="tokens per rank, a comma list")
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    parser.add_argument("--iters", type=int, default=50, help="calls per timing loop (raised when under 20 ms)")
    parser.add_argument("--platform", default="gpu", choices=("gpu", "cpu"), help="cpu: a dry run, backend xla only")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    tokens_list = sorted({int(v) for v in args.tokens.split(",") if v}, reverse=True)  # the training shape first
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from bench import timing, training_step
    from bench.copy_timing import fill_seconds, peer_copy_seconds
    from bench.record import provenance, write
    from bench.timing import make_inputs, progress, seconds_per_call, time_backend
    from jax_ep.ep import group as _group

    assert (TOPK, EXPERTS) == (timing.TOPK, timing.EXPERTS), "make_inputs routes to other shapes"
    on_gpu = args.platform == "gpu"
    device = jax.devices(args.platform)[0]
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=[device])
    command = "python -m bench.one_gpu_targets " + " ".join(argv)
    payload = {
        **provenance(command),
        "script_command": command,
        "platform": args.platform,
        "device": str(device),
        "ranks": 1,
        "tokens": tokens_list,
        "hidden": args.hidden,
        "topk": TOPK,
        "experts": EXPERTS,
        "dtype": "bfloat16",
        "layout": "ragged",
        "capacity": None,
        "routing": "uniform random top-k, distinct experts per token, shifted by the iteration index in loops",
        "timing": "per call: (wall(1 + n calls in one jitted fori_loop of static trip count) - wall(1 call)) / n, "
        "n = iters, raised once to take ~25 ms when under 20 ms",
        "iters": args.iters,
        "targets": {
            "dispatch_floor_ratio_max": FLOOR_RATIO_MAX,
            "combine_floor_ratio_max": FLOOR_RATIO_MAX,
            "training_step_cuda_over_xla_max": STEP_RATIO_MAX,
        },
        "complete": False,
    }
    cuda_reason = ""
    if not on_gpu:
        cuda_reason = "--platform cpu: a dry run; the copy and every cuda part are skipped, backend xla stands in"
    elif not _group.available():
        cuda_reason = f"no cuda backend: {_group.unavailable_reason()}"
    errors = []
    group = None
    if not cuda_reason:
        try:
            group = jax_ep.initialize(
                mesh, "ep", num_tokens=max(tokens_list), hidden=args.hidden, topk=TOPK, num_experts=EXPERTS
            )
        except Exception as error:  # go on with backend xla, and say why
            traceback.print_exc()
            errors.append("initialize")
            cuda_reason = f"jax_ep.initialize failed: {type(error).__name__}: {error}"[:3000]
    use_cuda = not cuda_reason
    payload["cuda"] = {"used": use_cuda, **({"skipped": cuda_reason} if cuda_reason else {})}
    if group is not None:
        payload["cuda"]["num_sms"] = group.num_sms
    ops_backend = "cuda" if use_cuda else "xla"

    def section(name, fn):
        progress(name)
        try:
            result = fn()
            if group is not None:
                group.check()  # an error a kernel recorded
        except Exception as error:  # record it and go on with the next section
            traceback.print_exc()
            errors.append(name)
            result = {**(payload.get(name) or {}), "error": f"{type(error).__name__}: {error}"[:3000]}
        payload[name] = result
        write(args.out, payload)  # what is done so far, in case the run is cut short
        return result

    # copy bandwidth
    def copy():
        if not use_cuda:
            return {"skipped": cuda_reason}
        ordinal = device.local_hardware_id
        seconds = [peer_copy_seconds(ordinal, ordinal, COPY_BYTES, COPY_ITERS) for _ in range(COPY_REPEATS)]
        return {
            "method": f"cudaMemcpyPeerAsync of {COPY_BYTES} bytes from GPU {ordinal} to itself, mean of "
            f"{COPY_ITERS} copies by CUDA events, {COPY_REPEATS} times; bandwidth = 2 * bytes / best seconds",
            "bytes": COPY_BYTES,
            "seconds": seconds,
            "bandwidth_bytes_per_s": 2 * COPY_BYTES / min(seconds),
            "bandwidth_gbps": 2 * COPY_BYTES / min(seconds) / 1e9,
            "median_bandwidth_gbps": 2 * COPY_BYTES / float(np.median(seconds)) / 1e9,
            "fill": fill(ordinal),
        }

    def fill(ordinal):
        """Write-only bandwidth, apart: a failure here (an older extension) must not cost the copy floor."""
        try:
            fills = [fill_seconds(ordinal, COPY_BYTES, COPY_ITERS) for _ in range(COPY_REPEATS)]
        except (AttributeError, RuntimeError) as error:
            return {"error": f"{type(error).__name__}: {error}"}
        return {
            "method": f"cudaMemsetAsync of {COPY_BYTES} bytes, mean of {COPY_ITERS} by CUDA events, "
            f"{COPY_REPEATS} times; bandwidth = bytes / best seconds",
            "seconds": fills,
            "bandwidth_bytes_per_s": COPY_BYTES / min(fills),
            "bandwidth_gbps": COPY_BYTES / min(fills) / 1e9,
        }

    copy_result = section("copy", copy)
    bandwidth = copy_result.get("bandwidth_bytes_per_s")
    fill_bandwidth = copy_result.get("fill", {}).get("bandwidth_bytes_per_s")

    inputs = {}
    for tokens in tokens_list:
        x, idx, w, _ = make_inputs(1, tokens, args.hidden)
        rng = np.random.default_rng(tokens)
        c = jnp.asarray(rng.standard_normal((tokens, args.hidden)), jnp.float32)  # the loss's fixed weights
        inputs[tokens] = (x, idx, w, jnp.full((1,), 0.75, jnp.float32), c)

    def dispatch_combine(backend):
        """One dispatch and one combine of row-dependent expert outputs, as global arrays."""

        def f(x, idx, w):
            d = jax_ep.dispatch(x, idx, w, num_experts=EXPERTS, axis_name="ep", backend=backend)
            rows = jnp.arange(d.x.shape[0], dtype=jnp.float32)[:, None]
            y = (d.x.astype(jnp.float32) * (1.0 + jnp.mod(rows, 7.0) / 8.0)).astype(d.x.dtype)
            out = jax_ep.combine(y, d.handle, weights=d.weights)
            return d.x, d.weights, d.group_sizes, d.num_dropped[None], d.num_invalid[None], out

        return jax.jit(jax.shard_map(f, in_specs=P("ep"), out_specs=P("ep")))

    def gradients(backend):
        return jax.jit(jax.shard_map(training_step.once(backend), in_specs=P("ep"), out_specs=P("ep")))

    @jax.jit
    def compare_dispatch(got, want):
        x, weights, sizes, dropped, invalid, _ = got
        x_want, weights_want, sizes_want, dropped_want, invalid_want, _ = want
        specified = jnp.arange(x.shape[0]) < jnp.sum(sizes_want)
        bits = jax.lax.bitcast_convert_type
        x_differ = jnp.any(bits(x, jnp.uint16) != bits(x_want, jnp.uint16), axis=1) & specified
        w_differ = (bits(weights, jnp.uint32) != bits(weights_want, jnp.uint32)) & specified
        return {
            "specified_rows": jnp.sum(sizes_want),
            "rows_differing": jnp.sum(x_differ),
            "weights_differing": jnp.sum(w_differ),
            "group_sizes_differing": jnp.sum(sizes != sizes_want),
            "num_dropped": dropped[0],
            "num_dropped_want": dropped_want[0],
            "num_invalid": invalid[0],
            "num_invalid_want": invalid_want[0],
        }

    @jax.jit
    def compare_combine(out, out_want):
        a, b = out.astype(jnp.float32), out_want.astype(jnp.float32)
        diff = jnp.abs(a - b)
        ulp = 2.0**-7 * jnp.maximum(jnp.abs(a), jnp.abs(b))  # one bf16 ulp, or more
        return {
            "elements_over_one_ulp": jnp.sum(~(diff <= ulp)),  # NaN counts
            "max_abs_diff": jnp.max(diff),
            "max_abs": jnp.max(jnp.abs(b)),
        }

    def relative(got, want):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        return float(np.max(np.abs(got - want)) / max(float(np.max(np.abs(want))), 1e-30))

    def check_tokens(tokens):
        """cuda (or, in a dry run, xla) against xla on one set of inputs of T tokens."""
        x, idx, w, scale, c = inputs[tokens]
        got = jax.block_until_ready(dispatch_combine(ops_backend)(x, idx, w))
        want = jax.block_until_ready(dispatch_combine("xla")(x, idx, w))
        result = {k: int(v) for k, v in compare_dispatch(got, want).items()}
        result.update({k: float(v) for k, v in compare_combine(got[5], want[5]).items()})
        result["valid_slots"] = int(np.sum((idx >= 0) & (idx < EXPERTS)))
        del got, want
        grads_got = jax.block_until_ready(gradients(ops_backend)(x, idx, w, scale, c))
        grads_want = gradients("xla")(x, idx, w, scale, c)
        names = ("loss_relative_error", "grad_x_relative_error", "grad_topk_weights_relative_error")
        names += ("grad_scale_relative_error",)
        for name, a, b in zip(names, grads_got, grads_want, strict=True):
            result[name] = relative(a, b)
        result["dispatch_bitwise"] = (
            result["rows_differing"] == result["weights_differing"] == result["group_sizes_differing"] == 0
            and result["num_dropped"] == result["num_dropped_want"]
            and result["num_invalid"] == result["num_invalid_want"]
            and result["specified_rows"] == result["valid_slots"]  # every valid slot delivered
        )
        result["combine_within_one_bf16_ulp"] = result["elements_over_one_ulp"] == 0
        result["grads_close"] = all(result[name] <= GRAD_TOLERANCE for name in names)
        result["passed"] = result["dispatch_bitwise"] and result["combine_within_one_bf16_ulp"]
        result["passed"] = result["passed"] and result["grads_close"]
        return result

    def check():
        out = {"backend": ops_backend, "against": "xla"}
        if not use_cuda:
            out["dry_run"] = "xla against itself: only runs the code path"
        payload["check"] = out  # kept if a later T fails
        for tokens in tokens_list:
            try:
                out[str(tokens)] = check_tokens(tokens)
            except Exception as error:  # record it and check the next T
                traceback.print_exc()
                errors.append(f"check T={tokens}")
                out[str(tokens)] = {"error": f"{type(error).__name__}: {error}"[:3000], "passed": False}
            progress(f"  check T={tokens}: {out[str(tokens)]}")
        out["passed"] = all(out[str(tokens)]["passed"] for tokens in tokens_list)
        return out

    with jax.set_mesh(mesh):
        check_result = section("check", check)
        payload["checked"] = bool(use_cuda and check_result.get("passed"))
        write(args.out, payload)

        for tokens in tokens_list:

            def ops(tokens=tokens):
                x, idx, w, _, _ = inputs[tokens]
                delivered = int(np.sum((idx >= 0) & (idx < EXPERTS)))  # R=1, capacity=None: every valid slot
                result = {"tokens": tokens, "backend": ops_backend}
                result.update(time_backend(ops_backend, x, idx, w, iters=args.iters))
                result.update(floors(tokens, args.hidden, delivered, bandwidth, fill_bandwidth))
                for op in ("dispatch", "combine"):
                    floor = result[f"{op}_floor_us"]
                    result[f"{op}_ratio"] = result[f"{op}_us"] / floor if floor else None
                    result[f"{op}_met"] = None if floor is None else result[f"{op}_ratio"] <= FLOOR_RATIO_MAX
                if tokens <= 512:
                    result["note"] = "loop times, launch-bound; the primary decode numbers come from ncu"
                progress(f"  T={tokens}: {result}")
                return result

            section(role(tokens), ops)

        steps = {} if use_cuda else {"skipped": f"backend cuda: {cuda_reason}"}
        payload["training_step"] = steps
        for tokens in tokens_list:
            x, idx, w, scale, c = inputs[tokens]
            point = {"tokens": tokens}
            for backend in ("cuda", "xla") if use_cuda else ("xla",):
                progress(f"training step T={tokens}, {backend}")
                try:
                    step = training_step.step(backend)
                    point[f"{backend}_us"] = seconds_per_call(step, (x, idx, w, scale, c), args.iters) * 1e6
                    if group is not None:
                        group.check()
                except Exception as error:  # record it and go on
                    traceback.print_exc()
                    errors.append(f"training_step {backend} T={tokens}")
                    point[f"{backend}_error"] = f"{type(error).__name__}: {error}"[:3000]
            if "cuda_us" in point and "xla_us" in point:
                point["ratio"] = point["cuda_us"] / point["xla_us"]
                point["met"] = point["ratio"] <= STEP_RATIO_MAX
            progress(f"  training step T={tokens}: {point}")
            steps[str(tokens)] = point
            write(args.out, payload)

    if group is not None:
        group.finalize()
    payload["errors"] = errors
    payload["complete"] = True
    write(args.out, payload)
    for line in table(payload):
        print(line)
    return 1 if errors else 0


def table(payload: dict) -> list[str]:
    """The targets in a few lines."""
    lines = []
    copy = payload.get("copy", {})
    if "bandwidth_gbps" in copy:
        lines.append(f"copy on the GPU: {copy['bandwidth_gbps']:.0f} GB/s (read + write, {copy['bytes'] / 1e9:.2f} GB)")
        if "bandwidth_gbps" in copy.get("fill", {}):
            lines.append(f"fill on the GPU: {copy['fill']['bandwidth_gbps']:.0f} GB/s (write only)")
    else:
        lines.append(f"copy: {copy.get('skipped') or copy.get('error') or 'not measured'}")
    for tokens in payload.get("tokens", []):
        result = payload.get(role(tokens), {})
        if "error" in result:
            lines.append(f"T={tokens:5}: error {result['error'][:200]}")
        for op in ("dispatch", "combine"):
            if f"{op}_us" not in result:
                continue
            cells = f"T={tokens:5} {result['backend']} {op:8} {result[f'{op}_us']:8.1f} us"
            if result.get(f"{op}_floor_us"):
                cells += f"  floor {result[f'{op}_floor_us']:7.1f} us  ratio {result[f'{op}_ratio']:5.2f}"
                cells += f" (target <= {FLOOR_RATIO_MAX}: {'met' if result[f'{op}_met'] else 'NOT met'})"
            if result.get(f"{op}_write_floor_us"):
                cells += f"  writes alone at the fill rate {result[f'{op}_write_floor_us']:.1f} us"
            if result.get("note"):
                cells += "  [loop time; ncu's is primary]"
            lines.append(cells)
    steps = payload.get("training_step", {})
    for tokens in payload.get("tokens", []):
        point = steps.get(str(tokens))
        if not point:
            continue
        cells = [f"{b} {point[f'{b}_us']:8.1f} us" for b in ("cuda", "xla") if f"{b}_us" in point]
        cells += [f"{b} error" for b in ("cuda", "xla") if f"{b}_error" in point]
        if "ratio" in point:
            met = "met" if point["met"] else "NOT met"
            cells.append(f"cuda/xla {point['ratio']:.2f} (target <= {STEP_RATIO_MAX}: {met})")
        lines.append(f"training step T={tokens:5}: " + "  ".join(cells))
    if "error" in steps:
        lines.append(f"training step: error {steps['error'][:200]}")
    check = payload.get("check", {})
    verdicts = []
    for tokens in payload.get("tokens", []):
        result = check.get(str(tokens))
        if result and "error" in result:
            verdicts.append(f"T={tokens}: error {result['error'][:200]}")
        elif result:
            verdicts.append(
                f"T={tokens}: dispatch {'bitwise' if result['dispatch_bitwise'] else 'DIFFERS'}, combine "
                f"{'within 1 ulp' if result['combine_within_one_bf16_ulp'] else 'DIFFERS'}, grads "
                f"{'close' if result['grads_close'] else 'DIFFER'}"
            )
    if "error" in check:
        verdicts.append(f"error {check['error'][:200]}")
    against = f"{check.get('backend')} against {check.get('against')}" if check else "not run"
    lines.append(f"checked: {str(payload.get('checked')).lower()} ({against}; {'; '.join(verdicts)})")
    if payload.get("errors"):
        lines.append(f"errors in: {', '.join(payload['errors'])}")
    if not payload.get("complete"):
        lines.append("the run did not complete: these are partial results")
    return lines


def summarize(folder: Path) -> list[str]:
    """One table of a device run's results: GPU tests, kernels by op (ncu), the targets."""
    lines = []

    def load(name):
        path = folder / name
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError) as error:
            lines.append(f"{name}: not read ({type(error).__name__})")
            return None

    tests = load("gpu_tests.json")
    if tests is not None:
        state = "complete" if tests.get("complete", True) else "cut short"
        lines.append(f"GPU tests ({state}, pytest exit {tests.get('pytest_exit')}): {tests.get('summary')}")
        failed = [f"  {t['outcome']}: {t['test']}" for t in tests.get("tests", []) if t["outcome"] != "passed"]
        lines += [line for line in failed if "skipped" not in line][:10]
    for path in sorted(folder.glob("kernels_*.json"), key=lambda p: (len(p.name), p.name)):
        kernels = load(path.name)
        if kernels is None:
            continue
        head = f"ncu T={kernels.get('tokens')}"
        if kernels.get("error"):
            lines.append(f"{head}: {kernels['error']}")
        for op, result in kernels.get("ops", {}).items():
            lines.append(f"{head} {op:8}: {result['kernels']} kernels, {result['us']:8.1f} us of device time")
        xla = kernels.get("xla_kernels")
        if xla is not None:
            lines.append(f"{head} XLA's own kernels in the call: {xla['kernels']}, {xla['us']:.1f} us")
        if kernels.get("missing"):
            lines.append(f"{head}: kernels not found: {', '.join(kernels['missing'])}")
    targets = load("targets.json")
    if targets is not None:
        lines += table(targets)
    return lines


if __name__ == "__main__":
    if sys.argv[1:2] == ["summarize"]:
        if len(sys.argv) != 3:
            raise SystemExit("usage: python -m bench.one_gpu_targets summarize DIR")
        print("\n".join(summarize(Path(sys.argv[2]))))
        sys.exit(0)
    sys.exit(main(sys.argv[1:]))
