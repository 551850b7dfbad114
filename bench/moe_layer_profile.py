"""Profile one training step (forward + backward) of jax_ep.nn.MoE on one GPU, broken down by named scope.

python -m bench.moe_layer_profile OUT.json [--tokens 4096 --hidden 7168 --intermediate 2048 --experts 256
    --topk 8 --shared 2048 --backend auto|cuda|xla --steps 5 --skew 1 [2 4 10]]

The layer is DeepSeek-V3-like at one rank's size (defaults above): bf16 tokens and weights, gated SwiGLU
experts, softmax router, a shared expert, ragged layout, ``capacity=None``, in an EP group of one GPU (a mesh
of one device, axis "ep"). With ``--backend cuda`` (or ``auto`` where the extension loads)
``jax_ep.initialize`` makes the group, so ``MoE``'s ``backend="auto"`` dispatches with the cuda backend; the
compiled step is checked for the jax_ep FFI calls. The step is ``jax.grad`` of ``sum(out * c) + 0.01 *
aux_loss`` w.r.t. the parameters and ``x``, jitted. ``--skew R`` shifts the tokens so that the router's busiest
expert gets about R times the mean load (bench/skewed_routing.py's ``skewed_tokens``; 1: as drawn), and the
output records the load it got. Several skews profile one compiled step in turn (the routing changes only the
data), and OUT.json holds ``{"runs": [...]}``, one record per skew, with a table of the step by scope last.

Method: the step's wall time is the median of ``--steps`` calls, each ended by ``block_until_ready``. The
breakdown comes from a ``jax.profiler`` trace of ``--steps`` more calls: every GPU kernel event in the
trace's XSpace (``jax.profiler.ProfileData``) names its HLO instruction (stat ``hlo_op``), whose
``op_name`` metadata in the compiled HLO holds the ``jax.named_scope`` path (``router``, ``dispatch``,
``experts`` with ``grouped_matmul_fwd/dx/dw``, ``combine``, ``shared_expert``, ``aux_loss``, all set in
``jax_ep/nn.py``); ``transpose(`` in the path marks the backward pass. XLA's command buffers (CUDA graphs)
are turned off for the whole run (``--xla_gpu_enable_command_buffer=``) so that each kernel is its own
event; ``--command-buffers`` keeps them. Kernel time is summed per scope and divided by the steps traced.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

SCOPES = ("shared_expert", "router", "dispatch", "experts", "combine", "aux_loss")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--intermediate", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=256)
    parser.add_argument("--topk", type=int, default=8)
    parser.add_argument("--shared", type=int, default=2048)
    parser.add_argument("--backend", choices=("auto", "cuda", "xla"), default="auto")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--skew", type=float, nargs="+", default=[1.0], help="busiest expert's load over the mean")
    parser.add_argument("--command-buffers", action="store_true", help="keep XLA's command buffers")
    parser.add_argument("--keep-trace", type=Path, default=None, help="copy the trace directory here")
    return parser.parse_args()


def scope_of(op_name: str) -> str:
    parts = re.split(r"[/()]", op_name)
    for scope in SCOPES:
        if scope in parts:
            if scope == "experts":
                for op in ("fwd", "dx", "dw"):
                    if f"grouped_matmul_{op}" in parts:
                        return f"experts/gemm_{op}"
            return scope
    return "other"


def hlo_op_names(hlo_text: str) -> dict[str, str]:
    """HLO instruction name -> op_name metadata, from compiled HLO text.

    An instruction without metadata (a fusion whose root lost it) gets the most common op_name scope among
    the instructions of the computation it calls, else the op_name of its first operand that has one.
    """
    names, calls, operands, computations = {}, {}, {}, collections.defaultdict(list)
    instruction = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=")
    header = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
    current = None
    for line in hlo_text.splitlines():
        match = instruction.match(line)
        if not match:
            head = header.match(line)
            if head and "=" not in line.split("{")[0]:
                current = head.group(1)
            continue
        op_name = re.search(r'op_name="([^"]*)"', line)
        if op_name:
            names[match.group(1)] = op_name.group(1)
            if current is not None:
                computations[current].append(op_name.group(1))
        args = re.search(r"=\s*\S+\s+[\w\-]+\(([^)]*)\)", line)
        if args:
            operands[match.group(1)] = re.findall(r"%([\w.\-]+)", args.group(1))
        called = re.search(r"calls=%?([\w.\-]+)", line)
        if called:
            calls[match.group(1)] = called.group(1)
    for name, computation in calls.items():
        if name not in names and computations.get(computation):
            votes = collections.Counter(scope_of(op) for op in computations[computation])
            scope = votes.most_common(1)[0][0]
            names[name] = next(op for op in computations[computation] if scope_of(op) == scope)
    for _ in range(4):  # still nothing: the op_name of the first operand that has one (its producer)
        for name, inputs in operands.items():
            if name not in names:
                known = [names[i] for i in inputs if i in names]
                if known:
                    names[name] = known[0]
    return names


def trace_events(xplane: str, device_prefix: str):
    """(plane, line, event name, duration ns, stats dict) of each event of the device planes."""
    import jax

    data = jax.profiler.ProfileData.from_file(xplane)
    planes = [p for p in data.planes if p.name.startswith(device_prefix)]
    layout = {p.name: [(line.name, sum(1 for _ in line.events)) for line in p.lines] for p in planes}
    events = []
    for plane in planes:
        lines = list(plane.lines)
        streams = [line for line in lines if line.name.startswith("Stream")]
        for line in streams or [ln for ln in lines if "XLA Modules" not in ln.name and "Steps" not in ln.name]:
            for event in line.events:
                events.append((plane.name, line.name, event.name, float(event.duration_ns), dict(event.stats)))
    return events, layout


def main() -> None:
    args = parse_args()
    if not args.command_buffers:
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_gpu_enable_command_buffer=").strip()
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from jax.sharding import AxisType

    import jax_ep
    from bench.skewed_routing import skewed_tokens
    from jax_ep.nn import MoE

    start = time.perf_counter()

    def log(message):
        print(f"[{time.perf_counter() - start:6.1f} s] {message}", flush=True)

    devices = jax.devices()[:1]
    on_gpu = devices[0].platform == "gpu"
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(AxisType.Auto,), devices=devices)
    backend = "xla"
    backend_note = ""
    if args.backend != "xla":
        if on_gpu and jax_ep.cuda_available():
            jax_ep.initialize(
                mesh,
                "ep",
                num_tokens=args.tokens,
                hidden=args.hidden,
                topk=args.topk,
                num_experts=args.experts,
                dtype=jnp.bfloat16,
            )
            backend = "cuda"
        elif args.backend == "cuda":
            raise SystemExit(f"backend cuda cannot run here: cuda_available={jax_ep.cuda_available()}")
        else:
            backend_note = f"auto -> xla: on_gpu={on_gpu}, cuda_available={jax_ep.cuda_available()}"
    import warnings

    warnings.filterwarnings("ignore", message="jax_ep: backend='auto' uses 'xla'")
    log(f"backend {backend} {backend_note}")

    with jax.set_mesh(mesh):
        model = MoE(
            args.hidden,
            args.intermediate,
            num_experts=args.experts,
            topk=args.topk,
            mesh=mesh,
            shared_intermediate=args.shared or None,
            param_dtype=jnp.bfloat16,
            rngs=nnx.Rngs(0),
        )
    graphdef, state = nnx.split(model)
    keys = jax.random.split(jax.random.key(1), 2)
    tokens = jax.random.normal(keys[0], (args.tokens, args.hidden), jnp.bfloat16)
    cotangent = jax.random.normal(keys[1], (args.tokens, args.hidden), jnp.bfloat16)
    router = jnp.asarray(model.router_kernel[...])

    def loss(state, x):
        result = nnx.merge(graphdef, state)(x)
        return jnp.sum(result.out.astype(jnp.float32) * cotangent) + 0.01 * result.aux_loss

    with jax.set_mesh(mesh):
        step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
        forward = jax.jit(loss)
        compiled = step.lower(state, tokens).compile()
        hlo = compiled.as_text()
        log("compiled")
        uses = {
            "jax_ep_cuda_ffi_calls": sum(hlo.count(f'"{t}"') for t in ("jax_ep_dispatch", "jax_ep_combine")),
            "mosaic_gpu_calls": len(re.findall(r"custom_call_target=\"mosaic_gpu[^\"]*\"", hlo)),
            "ragged_dot_ops": hlo.count(" ragged-dot("),
        }
        log(f"compiled step uses {uses}")
    names = hlo_op_names(hlo)  # the compiled step's op_name of each HLO instruction, for every skew's trace
    prefix = "/device:GPU" if on_gpu else "/host:CPU"

    def profile(skew: float) -> dict:
        """One skew's step time and kernel breakdown, with the compiled step."""
        x, routing = skewed_tokens(tokens, router, args.topk, skew)
        log(f"skew {skew}: routing {routing}")
        with jax.set_mesh(mesh):

            def timed(fn, *a):
                times = []
                for _ in range(args.steps + 1):
                    t0 = time.perf_counter()
                    jax.block_until_ready(fn(*a))
                    times.append(time.perf_counter() - t0)
                return times[1:]

            step_times = timed(compiled, state, x)
            forward_times = timed(forward, state, x)
            log(f"step {1e3 * sorted(step_times)[len(step_times) // 2]:.2f} ms")

            trace_dir = tempfile.mkdtemp(prefix="moe_profile_")
            with jax.profiler.trace(trace_dir):
                for _ in range(args.steps):
                    jax.block_until_ready(compiled(state, x))
            log(f"traced into {trace_dir}")

        xplanes = glob.glob(f"{trace_dir}/**/*.xplane.pb", recursive=True)
        events, layout = trace_events(xplanes[0], prefix)
        by_scope = collections.defaultdict(float)
        by_pass = collections.defaultdict(float)
        top = collections.defaultdict(float)
        unattributed = collections.defaultdict(float)
        total = 0.0
        for _, _, event_name, duration, stats in events:
            op = stats.get("hlo_op") or (event_name if event_name in names else None)
            if op is None:
                unattributed[event_name] += duration
                continue
            op_name = names.get(op, "")
            scope = scope_of(op_name)
            direction = "backward" if "transpose(" in op_name else "forward"
            by_scope[scope] += duration
            by_pass[f"{scope} {direction}"] += duration
            top[f"{scope} {direction} | {op} | {event_name[:60]}"] += duration
            total += duration
        per_step = 1e-3 / args.steps  # ns summed over steps -> µs per step

        def us(table):
            return {k: round(v * per_step, 1) for k, v in sorted(table.items(), key=lambda kv: -kv[1])}

        median = sorted(step_times)[len(step_times) // 2]
        payload = {
            "command": os.environ.get("JAX_EP_COMMAND") or " ".join(["python", *sys.argv]),
            "commit": os.environ.get("JAX_EP_COMMIT", "unknown"),
            "device": getattr(devices[0], "device_kind", str(devices[0])),
            "jax": jax.__version__,
            "backend": backend,
            "backend_note": backend_note,
            "cuda_extension_importable": jax_ep.ep.group.available(),  # cuda_available() also needs a GPU
            "shape": {
                "tokens": args.tokens,
                "hidden": args.hidden,
                "intermediate": args.intermediate,
                "experts": args.experts,
                "topk": args.topk,
                "shared_intermediate": args.shared,
                "dtype": "bfloat16",
                "layout": "ragged",
                "capacity": None,
                "ranks": 1,
            },
            "skew": skew,
            "routing": routing,
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "compiled_step_uses": uses,
            "method": (
                "step: median wall time of jitted value_and_grad calls, each ended by block_until_ready; breakdown: "
                "GPU kernel events of a jax.profiler trace mapped through hlo_op to the op_name (named-scope path) "
                "of the compiled HLO, summed per scope, per step"
            ),
            "step_ms": {"median": median * 1e3, "all": [t * 1e3 for t in step_times]},
            "forward_ms": {"median": sorted(forward_times)[len(forward_times) // 2] * 1e3},
            "kernel_us_per_step": {
                "total": round(total * per_step, 1),
                "by_scope": us(by_scope),
                "by_pass": us(by_pass),
            },
            "top_ops_us_per_step": dict(list(us(top).items())[:40]),
            "unattributed_us_per_step": dict(list(us(unattributed).items())[:20]),
            "trace_layout": layout,
            "events": len(events),
        }
        flops = 2 * args.tokens * args.topk * args.hidden * args.intermediate * 3  # three expert GEMMs, forward
        gemm = {
            op: payload["kernel_us_per_step"]["by_scope"].get(f"experts/gemm_{op}", 0.0) for op in ("fwd", "dx", "dw")
        }
        payload["expert_gemm_tflops"] = {op: (flops / (t * 1e-6) / 1e12 if t else None) for op, t in gemm.items()}
        if args.keep_trace:
            import shutil

            keep = args.keep_trace if len(args.skew) == 1 else args.keep_trace / f"skew_{skew:g}"
            shutil.copytree(trace_dir, keep, dirs_exist_ok=True)
        forward_ms = payload["forward_ms"]["median"]
        print(f"MoE step on {payload['device']}, backend {backend}, skew {skew:g}: {median * 1e3:.2f} ms (forward "
              f"alone {forward_ms:.2f} ms); kernels {total * per_step / 1e3:.2f} ms per step")  # fmt: skip
        for scope, t in payload["kernel_us_per_step"]["by_pass"].items():
            print(f"  {scope:28} {t / 1e3:8.3f} ms")
        print(f"  expert GEMM TFLOP/s: { {k: v and round(v, 1) for k, v in payload['expert_gemm_tflops'].items()} }")
        return payload

    runs = [profile(skew) for skew in args.skew]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(runs[0] if len(runs) == 1 else {"runs": runs}, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    print(table(runs))


def table(runs: list[dict]) -> str:
    """Each run's step and kernel time by scope (ms), a row per skew."""
    scopes = sorted({s for run in runs for s in run["kernel_us_per_step"]["by_scope"]})
    lines = [" | ".join(["skew", "max/mean", "step", "kernels", *scopes])]
    for run in runs:
        by_scope = run["kernel_us_per_step"]["by_scope"]
        cells = [f"{run['skew']:g}", f"{run['routing'].get('max_over_mean', float('nan')):.2f}"]
        cells += [f"{run['step_ms']['median']:.2f}", f"{run['kernel_us_per_step']['total'] / 1e3:.2f}"]
        lines.append(" | ".join(cells + [f"{by_scope.get(s, 0.0) / 1e3:.2f}" for s in scopes]))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
