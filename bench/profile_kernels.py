"""Device time of every kernel of one dispatch and one combine (backend "cuda", an EP group of one GPU).

    ncu --clock-control none --metrics gpu__time_duration.sum --csv --print-units base --log-file K.csv \\
        python bench/profile_kernels.py run [--tokens 4096 --hidden 7168]
    python bench/profile_kernels.py summarize K.csv OUT.json

``run`` calls the jitted dispatch + combine three times; ``summarize`` keeps the kernels of the last call (from
its routing-layout kernel on) in launch order, with their times. Nsight Compute runs kernels one at a time, so
only one GPU: on several, a kernel that waits for its peers would wait forever.
"""

from __future__ import annotations

import argparse
import csv
import sys
from pathlib import Path


def run(tokens: int, hidden: int) -> None:
    import jax
    from jax.sharding import PartitionSpec as P

    import jax_ep
    from jax_ep.bench.__main__ import EXPERTS, TOPK, make_inputs

    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices("gpu")[:1])
    jax_ep.initialize(mesh, "ep", num_tokens=tokens, hidden=hidden, topk=TOPK, num_experts=EXPERTS)
    x, idx, w, _ = make_inputs(1, tokens, hidden)

    def step(x, idx, w):
        d = jax_ep.dispatch(x, idx, w, num_experts=EXPERTS, axis_name="ep", backend="cuda")
        return jax_ep.combine(d.x, d.handle, weights=d.weights)

    with jax.set_mesh(mesh):
        call = jax.jit(jax.shard_map(step, in_specs=P("ep"), out_specs=P("ep")))
        for _ in range(3):
            jax.block_until_ready(call(x, idx, w))
    jax_ep.finalize()


def summarize(csv_path: Path, out: Path) -> None:
    from jax_ep.bench.record import provenance, write

    text = csv_path.read_text()
    rows = list(csv.DictReader(text[text.index('"ID"') :].splitlines()))
    kernels = [
        {
            "kernel": row["Kernel Name"].split("(")[0],
            "grid": row["Grid Size"],
            "block": row["Block Size"],
            "us": float(row["Metric Value"].replace(",", "")) / 1e3,
        }
        for row in rows
        if row["Metric Name"] == "gpu__time_duration.sum"
    ]
    first = max(i for i, k in enumerate(kernels) if "RoutingLayoutKernel" in k["kernel"])
    last_call = kernels[first:]
    combine_start = max(i for i, k in enumerate(last_call) if "RowsToTokensSendKernel" in k["kernel"]) - 1
    payload = {
        **provenance("python bench/profile_kernels.py " + " ".join(sys.argv[1:])),
        "method": "Nsight Compute gpu__time_duration.sum per kernel (--clock-control none); kernels run one at a time",
        "dispatch_us": sum(k["us"] for k in last_call[:combine_start]),
        "combine_us": sum(k["us"] for k in last_call[combine_start:]),
        "kernels": last_call,
    }
    write(out, payload)
    for k in last_call:
        print(f"{k['us']:9.1f} us  grid {k['grid']:>14}  {k['kernel'][:90]}")
    print(f"dispatch kernels {payload['dispatch_us']:.1f} us, combine kernels {payload['combine_us']:.1f} us")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("run", "summarize"))
    parser.add_argument("paths", nargs="*", type=Path, help="summarize: K.csv OUT.json")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=7168)
    args = parser.parse_args()
    if args.mode == "run":
        run(args.tokens, args.hidden)
    else:
        summarize(*args.paths)


if __name__ == "__main__":
    main()
