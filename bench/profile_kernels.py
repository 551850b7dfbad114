"""Device time of every kernel of one dispatch and one combine (backend "cuda", an EP group of one GPU).

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base --log-file K.csv \\
        python -m bench.profile_kernels run [--tokens 4096 --hidden 7168] [--step exchange]
    python -m bench.profile_kernels summarize K.csv OUT.json [--tokens 4096 --hidden 7168] [--step exchange]
    python -m bench.profile_kernels compare A.csv B.csv [...]

``run`` calls one jitted dispatch + combine (ragged layout, capacity=None, weights=d.weights) three times, with a
marker kernel (a jitted ``jnp.cbrt``, whose kernel XLA names after it) just before the last call. With ``--step``
another step takes its place: one of bench/feature_costs.py's (bench/split_steps.py), a dispatch or a
combine next to a matmul, whole (``dispatch``, ``combine``) or split (``dispatch_split``, ``combine_split``), so
that the kernels of one step of each, XLA's included, can be set side by side; or the one-GPU targets' training
step (bench/training_step.py: loss and gradients) on backend "cuda" (``training``) or "xla"
(``training_xla``, whose kernels are all XLA's).
``compare`` sets profiles of several builds side by side (ncu of the same kernels, any metrics or sections, e.g.
``--section WarpStateStats --csv --page details``): for each kernel function, its first instance in each file, every
metric that differs between the files by more than 2% (or in text), one line each.
``summarize`` keeps the kernels of the last call (those after the marker), in launch order, and splits them by
name: dispatch is the
``RoutingKernel`` and ``DispatchKernel`` launches, combine the ``CombineKernel`` launches (in a training step also
dispatch's backward pass), combine_backward the ``CombineBackwardKernel`` launches (names matched by prefix, so
template instances count). Every other kernel of the call is XLA's own (copies, fusions); those are
listed apart, each with the jax_ep kernel it follows, and never counted into an op. A kernel name that is not
found is reported under ``missing``, not an error. Nsight Compute runs kernels one at a time, so one GPU only:
on several, a kernel that waits for its peers would wait forever.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path

# Each op's kernels, by the start of their function name (a template instance matches too).
OPS = {
    "dispatch": ("RoutingKernel", "DispatchKernel"),
    "combine": ("CombineKernel",),
    "combine_backward": ("CombineBackwardKernel",),
}
CALLS = 3
MARKER = "cbrt"  # in the name of the kernel launched just before the last call
STEP_WORDS = {
    "exchange": "dispatch + combine",
    "dispatch": "dispatch next to a matmul",
    "dispatch_split": "dispatch_start, a matmul, dispatch_finish",
    "combine": "combine next to a matmul",
    "combine_split": "combine_start, a matmul, combine_finish",
    "training": "the training step's loss and gradients, backend cuda",
    "training_xla": "the training step's loss and gradients, backend xla",
}
STEPS = tuple(STEP_WORDS)


def expected_ops(step: str) -> tuple[str, ...]:
    """The ops whose kernels a step launches."""
    return {"training": tuple(OPS), "training_xla": ()}.get(step, ("dispatch", "combine"))


def run(tokens: int, hidden: int, step_name: str = "exchange") -> None:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from bench.timing import EXPERTS, TOPK, make_inputs

    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("gpu")[:1])
    group = jax_ep.initialize(mesh, "ep", num_tokens=tokens, hidden=hidden, topk=TOPK, num_experts=EXPERTS)
    x, idx, w, _ = make_inputs(1, tokens, hidden)

    def step(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=EXPERTS, axis_name="ep", backend="cuda")
        return jax_ep.combine(d.x, d.handle, weights=d.weights)

    marker_input = jax.device_put(np.arange(1, 1025, dtype=np.float32), jax.devices("gpu")[0])
    marker = jax.jit(jnp.cbrt)
    with jax.set_mesh(mesh):
        if step_name == "exchange":
            call, operands = jax.jit(jax.shard_map(step, in_specs=P("ep"), out_specs=P("ep"))), (x, idx, w)
        elif step_name.startswith("training"):
            call, operands = _training_step(step_name, x, idx, w, tokens, hidden)
        else:
            call, operands = _split_step(step_name, x, jnp.asarray(idx), w, hidden)
        for i in range(CALLS):
            if i == CALLS - 1:
                jax.block_until_ready(marker(marker_input))
            jax.block_until_ready(call(*operands))
    group.finalize()
    print(f"profile_kernels run: {CALLS} calls of step {step_name} at T={tokens}, H={hidden}", flush=True)


def _split_step(name: str, x, idx, w, hidden: int, backend: str = "cuda"):
    """One of bench/split_steps.py's steps, jitted, and its operands: the loop index (1, an argument as in a
    loop) and the global arrays over the mesh's axis "ep"."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from bench import split_steps
    from bench.timing import EXPERTS

    m = split_steps.shared_expert_weights(hidden)
    split = name.endswith("_split")
    if name.startswith("dispatch"):
        step = split_steps.dispatch_step(split, num_experts=EXPERTS, axis_name="ep", backend=backend)
        operands = (x, idx, w, m)
    else:
        step = split_steps.combine_step(split)
        operands = (x, *split_steps.combine_operands(x, idx, w, backend=backend), m)

    def body(i, *args):
        return step(i, *args)[None]

    in_specs = (P(), *[P("ep")] * len(operands))
    call = jax.jit(jax.shard_map(body, in_specs=in_specs, out_specs=P("ep")))
    return call, (jnp.int32(1), *operands)


def _training_step(name: str, x, idx, w, tokens: int, hidden: int):
    """The training step's loss and gradients, jitted, and its operands as bench/one_gpu_targets.py makes them."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from bench import training_step

    backend = "xla" if name == "training_xla" else "cuda"
    c = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, hidden)), jnp.float32)
    call = jax.jit(jax.shard_map(training_step.once(backend), in_specs=P("ep"), out_specs=P("ep")))
    return call, (x, jnp.asarray(idx), w, jnp.full((1,), 0.75, jnp.float32), c)


def function_name(kernel: str) -> str:
    """The bare function name of a demangled kernel name: no namespaces, template arguments or parameters.

    ``void jax_ep::<unnamed>::DispatchKernel<8, __nv_bfloat16>(jax_ep::Params)`` gives ``DispatchKernel``.
    """
    kernel = kernel.replace("(anonymous namespace)", "<unnamed>")
    depth, kept = 0, []
    for char in kernel:
        if char == "<":
            depth += 1
        elif char == ">":
            depth = max(depth - 1, 0)
        elif depth == 0:
            if char == "(":
                break
            kept.append(char)
    words = "".join(kept).split("::")[-1].split()
    return words[-1] if words else kernel.strip()


def op_of(kernel: str) -> str | None:
    """The op ("dispatch" or "combine") that a kernel belongs to, or None for XLA's own kernels."""
    name = function_name(kernel)
    for op, prefixes in OPS.items():
        if name.startswith(prefixes):
            return op
    return None


def read_kernel_metrics(csv_path: Path) -> list[dict]:
    """Every profiled kernel, in launch order, with each of its metrics by name (ncu --csv --print-units base);
    a value that is not a number is kept as text."""
    text = csv_path.read_text(errors="replace")
    if '"ID"' not in text:
        raise ValueError(f"{csv_path} holds no ncu CSV table (no '\"ID\"' header)")
    kernels: dict[str, dict] = {}
    for row in csv.DictReader(text[text.index('"ID"') :].splitlines()):
        if not row.get("Metric Name"):
            continue
        kernel = kernels.setdefault(
            row["ID"],
            {
                "kernel": row["Kernel Name"],
                "name": function_name(row["Kernel Name"]),
                "grid": row.get("Grid Size", ""),
                "block": row.get("Block Size", ""),
                "metrics": {},
            },
        )
        value = str(row["Metric Value"])
        try:
            kernel["metrics"][row["Metric Name"]] = float(value.replace(",", ""))
        except ValueError:
            kernel["metrics"][row["Metric Name"]] = value
    return list(kernels.values())


def read_kernels(csv_path: Path) -> list[dict]:
    """Every profiled kernel, in launch order, with its device time in µs (ncu --csv --print-units base)."""
    kernels = []
    for k in read_kernel_metrics(csv_path):
        ns = k.pop("metrics").get("gpu__time_duration.sum")
        if isinstance(ns, float):
            kernels.append({**k, "us": ns / 1e3})
    return kernels


def split_last_call(kernels: list[dict], step: str = "exchange") -> dict:
    """The kernels of the last of the calls, by op, with XLA's own kernels apart; names not found are listed.

    The last call is every kernel after the last marker kernel. Without a marker, it is every kernel after the
    jax_ep kernels of the call before it, which also takes in XLA's kernels that end the call before
    (``"boundary"`` says which). A call starts at its routing kernel (or its first jax_ep kernel). A step that
    launches no jax_ep kernel (``training_xla``) needs the marker.
    """
    ours = [i for i, k in enumerate(kernels) if op_of(k["kernel"])]
    wanted = [prefix for op in expected_ops(step) for prefix in OPS[op]]
    found = {prefix for k in kernels for prefix in wanted if k["name"].startswith(prefix)}
    missing = [prefix for prefix in wanted if prefix not in found]
    markers = [i for i, k in enumerate(kernels) if MARKER in k["name"]]
    if not ours and (wanted or not markers):
        return {"missing": missing, "error": "no jax_ep kernel in the profile", "calls_seen": 0}
    routing = [i for i in ours if kernels[i]["name"].startswith(OPS["dispatch"])]
    first = kernels[(routing or ours)[0]]["name"] if ours else None  # the kernel each call starts with
    starts = [i for i in ours if kernels[i]["name"] == first]
    if markers:
        begin, boundary = markers[-1] + 1, f"the {MARKER} marker kernel"
    else:
        previous = [i for i in ours if i < starts[-1]]
        begin = previous[-1] + 1 if previous else starts[-1]
        boundary = "no marker: the previous call's last jax_ep kernel (its trailing XLA kernels are counted too)"
    last_call = kernels[begin:]
    ends = [*starts[1:], len(kernels)] if starts else []
    per_call = [sum(1 for i in ours if a <= i < b) for a, b in zip(starts, ends, strict=True)]
    ops = {op: {"kernels": 0, "us": 0.0, "list": []} for op in expected_ops(step)}
    xla = {"kernels": 0, "us": 0.0, "list": []}
    after = None
    for k in last_call:
        op = op_of(k["kernel"])
        entry = {key: k[key] for key in ("name", "us", "grid", "block", "kernel")}
        if op:
            ops.setdefault(op, {"kernels": 0, "us": 0.0, "list": []})
            ops[op]["kernels"] += 1
            ops[op]["us"] += k["us"]
            ops[op]["list"].append(entry)
            after = k["name"]
        else:
            xla["kernels"] += 1
            xla["us"] += k["us"]
            xla["list"].append({**entry, "after": after})
    result = {
        "missing": missing,
        "calls_seen": len(starts),
        "boundary": boundary,
        "jax_ep_kernels_per_call": per_call,
        "ops": ops,
        "xla_kernels": xla,
        "last_call": [{key: k[key] for key in ("name", "us", "grid")} for k in last_call],
    }
    if wanted and len(starts) != CALLS:
        result["warning"] = f"{len(starts)} calls starting with {first} were profiled, not {CALLS}"
    return result


def summarize(csv_path: Path, out: Path, tokens: int | None, hidden: int | None, step: str = "exchange") -> int:
    from bench.record import provenance, write

    payload = {
        **provenance("python -m bench.profile_kernels " + " ".join(sys.argv[1:])),
        "tokens": tokens,
        "hidden": hidden,
        "step": step,
        "method": "Nsight Compute gpu__time_duration.sum per kernel (--clock-control none); kernels run one at a "
        f"time; the last of {CALLS} calls of one jitted step ({STEP_WORDS[step]})",
        "ops_by_kernel_name": {op: list(prefixes) for op, prefixes in OPS.items()},
    }
    try:
        kernels = read_kernels(csv_path)
    except (OSError, ValueError) as error:
        payload["error"] = f"no profile read: {error}"
        kernels = []
    if kernels:
        payload.update(split_last_call(kernels, step))
    elif "error" not in payload:
        payload["error"] = "the profile holds no kernel"
    if "ops" not in payload:  # help find out why: the end of what was profiled
        payload["profiled_kernels_tail"] = [{key: k[key] for key in ("name", "us", "grid")} for k in kernels[-60:]]
    write(out, payload)
    for line in table(payload):
        print(line)
    return 0


def table(payload: dict) -> list[str]:
    """A few lines: each op's kernel count and summed device µs, XLA's kernels between, what is missing."""
    head = f"ncu T={payload.get('tokens')}"
    lines = []
    if payload.get("error"):
        lines.append(f"{head}: {payload['error']}")
    for op, result in payload.get("ops", {}).items():
        kernels = ", ".join(f"{k['name']} {k['us']:.1f}" for k in result["list"])
        lines.append(f"{head} {op:8}: {result['kernels']} kernels, {result['us']:8.1f} us  ({kernels})")
    xla = payload.get("xla_kernels")
    if xla is not None:
        shown = 40 if payload.get("step", "").startswith("training") else 6
        kernels = ", ".join(f"{k['name']} {k['us']:.1f} after {k['after']}" for k in xla["list"][:shown])
        more = f", ... {xla['kernels'] - shown} more" if xla["kernels"] > shown else ""
        lines.append(f"{head} XLA's own: {xla['kernels']} kernels, {xla['us']:8.1f} us  ({kernels}{more})")
    if payload.get("missing"):
        lines.append(f"{head}: kernels not found: {', '.join(payload['missing'])}")
    if payload.get("warning"):
        lines.append(f"{head}: {payload['warning']}")
    return lines


def compare(paths: list[Path], tolerance: float = 0.02) -> list[str]:
    """Lines ``kernel metric: value (file) ...`` for each metric whose values in the files (each kernel function's
    first instance) differ by more than ``tolerance`` relative to the first, or differ as text; a kernel missing from
    a file shows as ``-``."""
    firsts = []
    for path in paths:
        seen: dict[str, dict] = {}
        for kernel in read_kernel_metrics(path):
            seen.setdefault(kernel["name"], kernel["metrics"])
        firsts.append(seen)
    lines = [f"compare: {' | '.join(path.name for path in paths)}"]
    for name in dict.fromkeys(n for seen in firsts for n in seen):
        metrics = [seen.get(name, {}) for seen in firsts]
        for metric in dict.fromkeys(m for values in metrics for m in values):
            values = [values.get(metric, "-") for values in metrics]
            numbers = [v for v in values if isinstance(v, float)]
            if len(numbers) == len(values):
                base = abs(numbers[0]) or 1.0
                if max(abs(v - numbers[0]) for v in numbers) <= tolerance * base:
                    continue
            elif len(set(map(str, values))) == 1:
                continue
            shown = " | ".join(f"{v:,.4g}" if isinstance(v, float) else str(v) for v in values)
            lines.append(f"{name} {metric}: {shown}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("run", "summarize", "compare"))
    parser.add_argument("paths", nargs="*", type=Path, help="summarize: K.csv OUT.json; compare: two CSVs or more")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    parser.add_argument("--step", choices=STEPS, default="exchange", help="what one call runs (see above)")
    args = parser.parse_args()
    if args.mode == "run":
        run(args.tokens, args.hidden, args.step)
    elif args.mode == "compare":
        if len(args.paths) < 2:
            parser.error("compare takes two CSVs or more")
        print("\n".join(compare(args.paths)))
    elif len(args.paths) != 2:
        parser.error("summarize takes K.csv OUT.json")
    else:
        sys.exit(summarize(*args.paths, args.tokens, args.hidden, args.step))


if __name__ == "__main__":
    main()
