"""The top of docs/performance.md, made from the committed results: its headline table and its plot.

    python -m bench.plot_performance [docs/performance.png]

Reads the results files named in HEADLINE under bench/results/, writes the PNG (matplotlib, Agg backend) and
prints the headline table as Markdown, which docs/performance.md holds verbatim (tests/test_bench.py checks it).
No GPU needed: every number comes from a file, and each row names the command that measured it.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
PNG = Path(__file__).resolve().parents[1] / "docs" / "performance.png"
LAYER = "`python -m bench.moe_layer_baselines OUT.json --iters 5 --ablate`"
LAYER_FILES = {"H200": "moe_layer_baselines_3f966bc_h200x1.json", "H100": "moe_layer_baselines_aaf2c52_h100x1.json"}
SM_BUDGET = "sm_budget_h200x1.json"
DECODE = "backward_weights_h200x1.json"
DECODE_RUN = "call_4_checks_9397776"  # the run of that file whose tree the decode rows measured
# Nsight Compute's device time of the kernels alone in the same device call (the loop times at T=128 are
# launch-bound): the file's training_step_kernels_128 run.
DECODE_KERNELS = "training_step_kernels_128"


@dataclass(frozen=True)
class Row:
    what: str
    gpu: str
    jax_ep: str
    beside: str
    file: str
    command: str

    def markdown(self) -> str:
        cells = (self.what, self.gpu, self.jax_ep, self.beside, self.file, self.command)
        return "| " + " | ".join(cells) + " |"


def link(name: str) -> str:
    """A results file as a link from docs/performance.md."""
    return f"[`{name}`](../bench/results/{name})"


def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def layer_rows() -> list[Row]:
    """The MoE layer's training step beside the dense einsum and the tokamax recipe, per GPU and expert count."""
    rows = []
    for gpu, name in LAYER_FILES.items():
        for run in load(name)["rows"]:
            ms = run["ms"]
            beside = (
                f"dense einsum of the same FLOPs {ms['dense']:.1f} ms: jax_ep {ms['moe'] / ms['dense']:.2f}×; "
                f"argsort + `tokamax.ragged_dot` {ms['sort_tokamax']:.1f} ms: {ms['sort_tokamax'] / ms['moe']:.2f}× "
                "jax_ep"
            )
            what = f"`jax_ep.nn.MoE` training step, E={run['experts']}"
            rows.append(Row(what, gpu, f"{ms['moe']:.1f} ms", beside, link(name), LAYER))
    return rows


def exchange_points() -> list[dict]:
    """Dispatch and combine on one H200 (a group of one) against their HBM floor: µs, floor µs, and for T=128
    the kernel's device time under Nsight Compute."""
    budget = load(SM_BUDGET)
    points = [
        dict(op=op, tokens=4096, us=budget["median_us"]["every_sm"][op], floor_us=budget["floor_us"][op])
        for op in ("dispatch", "combine")
    ]
    run = load(DECODE)[DECODE_RUN]
    decode = run["targets_128"]["decode"]
    kernels = run[DECODE_KERNELS]["ops"]
    for op in ("dispatch", "combine"):
        # the training step's kernels: its first combine kernel is the forward combine
        kernel_us = kernels[op]["list"][0]["us"]
        points.append(dict(op=op, tokens=128, us=decode[f"{op}_us"], floor_us=decode[f"{op}_floor_us"]))
        points[-1]["kernel_us"] = kernel_us
    return points


def exchange_rows() -> list[Row]:
    rows = []
    for p in exchange_points():
        beside = f"HBM floor {p['floor_us']:.1f} µs: jax_ep {p['us'] / p['floor_us']:.2f}×"
        if p["tokens"] == 4096:
            name, command = link(SM_BUDGET), "`python -m bench.sm_budget OUT.json`"
        else:
            beside += f" (a launch-bound loop; the kernel alone {p['kernel_us']:.1f} µs under Nsight Compute)"
            name = f"{link(DECODE)}, run `{DECODE_RUN}`"
            command = "`python -m bench.one_gpu_targets OUT.json --tokens 128`; the kernel: "
            command += "`bash bench/device_run_one_gpu.sh training`"
        what = f"{p['op']}, T={p['tokens']} tokens"
        rows.append(Row(what, "H200", f"{p['us']:.1f} µs", beside, name, command))
    return rows


HEADLINE: tuple[Callable[[], list[Row]], ...] = (layer_rows, exchange_rows)


def table() -> list[str]:
    """The headline table, as Markdown lines."""
    lines = ["| what | GPU | jax_ep | beside it, in the same run | file | command |", "|---|---|---|---|---|---|"]
    lines += [row.markdown() for make in HEADLINE for row in make()]
    lines.append("| dispatch and combine on two or more GPUs | – | not yet measured | | | `bash bench/device_run.sh` |")
    return lines


def plot(path: Path) -> None:
    """Left: the layer's step against its baselines; right: dispatch and combine over their HBM floor."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 4.2))
    left, right = fig.subplots(1, 2, gridspec_kw={"width_ratios": [3, 2]})

    groups, series = [], {"jax_ep.nn.MoE": [], "dense einsum, same FLOPs": [], "argsort + tokamax.ragged_dot": []}
    for gpu, name in LAYER_FILES.items():
        for run in load(name)["rows"]:
            groups.append(f"E={run['experts']}\n{gpu}")
            for label, key in zip(series, ("moe", "dense", "sort_tokamax"), strict=True):
                series[label].append(run["ms"][key])
    width = 0.8 / len(series)
    for i, (label, values) in enumerate(series.items()):
        at = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        bars = left.bar(at, values, width, label=label)
        left.bar_label(bars, fmt="%.1f", fontsize=7)
    left.set_xticks(range(len(groups)), groups)
    left.set_ylim(0, 1.3 * max(max(values) for values in series.values()))
    left.set(ylabel="ms per training step", title="MoE layer, one GPU: T=4096, H=7168, F=2048, top-8, bf16")
    left.legend(fontsize=8, ncol=3, loc="upper center")

    points = exchange_points()
    labels = [f"{p['op']}\nT={p['tokens']}" for p in points]
    ratios = [p["us"] / p["floor_us"] for p in points]
    bars = right.bar(range(len(points)), ratios, 0.6, color="tab:blue", label="loop time per call")
    right.bar_label(bars, labels=[f"{p['us']:.1f} µs" for p in points], fontsize=7)
    kernels = [(i, p["kernel_us"] / p["floor_us"]) for i, p in enumerate(points) if "kernel_us" in p]
    right.scatter(*zip(*kernels, strict=True), marker="_", s=400, color="black", label="kernel alone (Nsight Compute)")
    right.axhline(1.0, color="black", linestyle="--", linewidth=1, label="HBM floor (bytes over copy bandwidth)")
    right.set_xticks(range(len(points)), labels)
    right.set_ylim(0, 1.6 * max(ratios))
    right.set(ylabel="time / HBM floor", title="dispatch and combine, one H200 (group of one)")
    right.legend(fontsize=8, loc="upper left")
    fig.suptitle("jax_ep on one GPU (two or more GPUs: not yet measured)", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else PNG
    plot(path)
    print("\n".join(table()))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
