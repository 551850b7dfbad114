"""What the default SM budget of a group of several GPUs costs, measured where it can be: an EP group of ONE GPU.

    python -m bench.sm_budget OUT.json [--tokens 4096] [--rounds 3]

A group of several GPUs runs its transfer kernels on all but 32 SMs (at least half) unless ``initialize`` gets
``num_sms``; a group of one uses every SM. This times the training-size dispatch and combine (T=4096, H=7168, K=8,
E=256, bf16, ragged layout, ``bench.timing.time_backend``) at R=1 with ``num_sms`` = that default and with
every SM, alternating ``--rounds`` times in one process, and records the median device µs of each, their ratio,
and the HBM floor of each op (bench/one_gpu_targets.py's bytes over this run's device copy bandwidth).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

    import jax
    import numpy as np

    import jax_ep
    from bench import timing
    from bench.copy_timing import peer_copy_seconds
    from bench.one_gpu_targets import floors
    from bench.record import provenance, write
    from jax_ep.ep import group as _group

    device = jax.devices("gpu")[0]
    mesh = jax.make_mesh((1,), ("ep",), axis_types=(jax.sharding.AxisType.Auto,), devices=[device])
    sms = device.core_count
    budgets = {"every_sm": None, "default_of_several_gpus": _group._extension.default_num_sms(sms, 2)}
    sizes = dict(num_tokens=args.tokens, hidden=timing.HIDDEN, topk=timing.TOPK, num_experts=timing.EXPERTS)
    x, idx, w, _ = timing.make_inputs(1, args.tokens, timing.HIDDEN)
    ordinal = device.local_hardware_id
    copy = min(peer_copy_seconds(ordinal, ordinal, 1 << 30, 20) for _ in range(3))
    bandwidth = 2 * (1 << 30) / copy
    times = {name: {"dispatch": [], "combine": []} for name in budgets}
    used = {}
    with jax.set_mesh(mesh):
        for _ in range(args.rounds):
            for name, num_sms in budgets.items():
                group = jax_ep.initialize(mesh, "ep", **sizes, dtype=jax.numpy.bfloat16, num_sms=num_sms)
                used[name] = group.num_sms
                result = timing.time_backend("cuda", x, idx, w)
                group.check()
                for op in ("dispatch", "combine"):
                    times[name][op].append(result[f"{op}_us"])
                timing.progress(
                    f"{name} ({group.num_sms} SMs): {result['dispatch_us']:.1f} / {result['combine_us']:.1f} us"
                )
    delivered = int(np.sum(np.asarray(idx) >= 0))
    floor = floors(args.tokens, timing.HIDDEN, delivered, bandwidth)
    payload = {
        **provenance("python -m bench.sm_budget " + " ".join(argv)),
        "device": str(device),
        "sms": sms,
        "shape": {**sizes, "dtype": "bfloat16", "layout": "ragged", "ranks": 1},
        "copy_bandwidth_gbps": bandwidth / 1e9,
        "floor_us": {op: floor[f"{op}_floor_us"] for op in ("dispatch", "combine")},
        "num_sms": used,
        "us": times,
        "median_us": {n: {op: statistics.median(v) for op, v in t.items()} for n, t in times.items()},
    }
    med = payload["median_us"]
    payload["ratio_default_over_every_sm"] = {
        op: med["default_of_several_gpus"][op] / med["every_sm"][op] for op in ("dispatch", "combine")
    }
    write(args.out, payload)
    print(f"{'num_sms':>26} {'dispatch us':>12} {'combine us':>11}")
    for name in budgets:
        print(f"{name + ' (' + str(used[name]) + ')':>26} {med[name]['dispatch']:12.1f} {med[name]['combine']:11.1f}")
    ratio = payload["ratio_default_over_every_sm"]
    print(f"{'ratio':>26} {ratio['dispatch']:12.3f} {ratio['combine']:11.3f}")
    print(f"{'HBM floor':>26} {payload['floor_us']['dispatch']:12.1f} {payload['floor_us']['combine']:11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
